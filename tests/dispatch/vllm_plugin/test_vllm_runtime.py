"""The serving side: torch.compile(fullgraph=True), reload into the same storage, warmup that
dedupes and compiles nothing twice, and bad checkpoints that fail at load naming layer and tensor."""

from __future__ import annotations

import pytest
import torch

from _vllm_env import ckpt, ckpt_root, dist, forward, impl, kernel_of, loaded  # noqa: F401
import harness
from conftest import make_input

from dispatch.vllm_plugin import convert, ops, warmup


def _x(k, m=4, seed=0):
    return make_input((m, k), torch.bfloat16, generator=torch.Generator().manual_seed(seed), device="cpu")


@pytest.mark.parametrize("kind", ["ct_nvfp4", "ct_fp8", "ct_mxfp4"])
def test_torch_compile_fullgraph(kind, dist, ckpt, impl):
    """The layer's forward (vLLM's parallel linear + our op) traces with fullgraph=True; the fake
    implementation gives the right shape, and the compiled output equals eager's."""
    impl("reference")
    torch._dynamo.reset()
    layers, cfg = loaded(ckpt(kind), ("qkv",))
    layer = layers["qkv"]
    x = _x(384)
    eager = forward(layer, x)
    compiled = torch.compile(lambda t: forward(layer, t), fullgraph=True, backend="aot_eager", dynamic=True)
    with harness.vllm_context(ckpt(kind)):
        y = compiled(x)
        y2 = compiled(_x(384, m=7, seed=1))  # a second token count, same graph (dynamic M)
    assert torch.equal(y, eager)
    assert y2.shape == (7, 1152)


def test_fake_impl_shape_and_dtype(dist, ckpt, impl):
    impl("reference")
    layers, _ = loaded(ckpt("ct_mxfp8"), ("up",))
    layer = layers["up"]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 3, 384, dtype=torch.bfloat16)
        y = torch.ops.b12x_dual.linear(x, None, layer.b12x_dual_handle, layer.b12x_dual_n)
    assert y.shape == (5, 3, 1536) and y.dtype == torch.bfloat16


def _prepared_ptrs(layer) -> dict[str, int]:
    st = ops.state(layer.b12x_dual_handle)
    return {k: t.data_ptr() for k, t in st.prepared.tensors().items()}


@pytest.mark.parametrize("kind", ["ct_nvfp4", "deepseek_fp8_block"])
def test_reload_keeps_storage_addresses(kind, dist, ckpt, impl):
    """vLLM's layerwise reload (record metadata, re-create on meta, load, process, copy back) with
    changed weights: the prepared weight keeps its addresses and serves the new values."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    impl("reference")
    d = ckpt(kind)
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("o",))
        model = torch.nn.ModuleDict(layers)
        record_metadata_for_reloading(model)
        harness.load(layers, d)
        x = _x(384)
        y0 = forward(model["o"], x)
        ptrs = _prepared_ptrs(model["o"])
        handle = model["o"].b12x_dual_handle

        # Reload with the weight's dequantized values doubled (NVFP4: the global scale, a divisor,
        # halved; block FP8: the fp32 block scales doubled) and the bias doubled: the output
        # doubles exactly.
        tensors = harness.checkpoint_tensors(d)
        scale_leaf = "weight_global_scale" if kind == "ct_nvfp4" else "weight_scale_inv"
        factor = 0.5 if kind == "ct_nvfp4" else 2.0
        initialize_layerwise_reload(model)
        params = dict(model["o"].named_parameters())
        base = f"{harness.PREFIX}.{harness.LINEARS['o'][0]}."
        for key, t in tensors.items():
            if key.startswith(base) and key[len(base):] in params:
                leaf = key[len(base):]
                if leaf == scale_leaf:
                    t = (t.float() * factor).to(t.dtype)
                if leaf == "bias":
                    t = t * 2
                params[leaf].weight_loader(params[leaf], t)
        finalize_layerwise_reload(model, cfg.model_config)
        y1 = forward(model["o"], x)
    assert model["o"].b12x_dual_handle == handle
    assert _prepared_ptrs(model["o"]) == ptrs
    assert torch.equal(y1, (y0.double() * 2).to(torch.bfloat16))


def test_warmup_dedupes_and_compiles_nothing_twice(dist, ckpt, impl):
    """vLLM's own b12x warmup collection over our layers: identical signatures share one unit, and
    a second warmup compiles nothing. (vLLM's _compile_warmup_units ends with a device
    synchronize that needs an accelerator, so the units are run here as it runs them.)"""
    from vllm.model_executor.warmup.b12x_warmup import _collect_warmup_units

    impl("reference")
    d = ckpt("ct_mxfp8")
    with harness.vllm_context(d) as cfg:
        qc = harness.quant_config(cfg)
        a = harness.make_layers(qc, ("o", "up"))
        b = harness.make_layers(qc, ("o",))  # same signature as a["o"]
        harness.load(a, d)
        harness.load(b, d)
    model = torch.nn.ModuleList([a["o"], a["up"], b["o"]])
    counts = warmup.token_counts((2, 8), 64)
    assert counts == (1, 2, 8, 64)
    units = list(_collect_warmup_units(model, counts, torch.bfloat16))
    assert len(units) == 2  # o-shaped twice, up once
    before = warmup.compiles
    with torch.inference_mode():
        for u in units:
            u.compile()
    assert warmup.compiles - before == 2 * len(counts)
    assert warmup.warmup_model(model, counts) == {"b12x-dual mxfp8": 2}
    assert warmup.compiles - before == 2 * len(counts)  # nothing ran twice
    assert all(ops.state(m.b12x_dual_handle).warmed >= set(counts) for m in model)


# ---------------------------------------------------------------------------------------------
# Bad checkpoints fail at load, naming the layer and the tensor
# ---------------------------------------------------------------------------------------------
def _corrupt_then_process(d, which, corrupt):
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), (which,))
        harness.load(layers, d, process=False)
        corrupt(layers[which])
        layers[which].quant_method.process_weights_after_loading(layers[which])


def test_missing_input_scale_for_static_fp8(dist, ckpt, impl):
    impl("reference")

    def drop(layer):
        del layer.input_scale  # a static-activation checkpoint without its input scale

    with pytest.raises(convert.CheckpointError, match=r"layer encoder\.layer\.0\.attention\.output\.dense.*'input_scale'.*missing"):
        _corrupt_then_process(ckpt("ct_fp8"), "o", drop)


def test_missing_block_scale_modelopt(dist, ckpt, impl):
    """ModelOpt NVFP4 without weight_scale: the plugin's load record names layer and tensor before
    vLLM's own NaN-sentinel check would (which says "never loaded" without the layer's prefix)."""
    impl("reference")
    d = ckpt("modelopt_nvfp4")
    with harness.vllm_context(d) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), ("o",))
        with pytest.raises(convert.CheckpointError,
                           match=r"layer encoder\.layer\.0\.attention\.output\.dense: .*'weight_scale' missing from the checkpoint"):
            harness.load(layers, d, skip=("weight_scale",))


def test_nan_block_scale(dist, ckpt, impl):
    impl("reference")

    def nan(layer):
        layer.weight_scale.data[3, 2] = float("nan")

    with pytest.raises(convert.CheckpointError, match=r"intermediate\.dense.*'weight_scale'.*NaN"):
        _corrupt_then_process(ckpt("ct_fp8_block"), "up", nan)


def test_wrong_scale_dtype(dist, ckpt, impl):
    impl("reference")

    def wrong(layer):
        layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.float(), requires_grad=False)

    with pytest.raises(convert.CheckpointError, match=r"output\.dense.*'weight_scale' has dtype float32; allowed: float8_e4m3fn"):
        _corrupt_then_process(ckpt("ct_nvfp4"), "down", wrong)


def test_shard_k_not_a_block_multiple(dist, ckpt, impl):
    """K = 1440 per rank (e.g. 2880 at TP = 2) is no multiple of 128: block FP8 is refused with the
    shard's K, when vLLM builds the layer (before any weight is read)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    impl("reference")
    d = ckpt("ct_fp8_block")
    with harness.vllm_context(d) as cfg:
        with pytest.raises(ValueError, match=r"K \(input features of this shard\) is 1440; block FP8 needs a positive multiple of 128"):
            RowParallelLinear(1440, 256, bias=False, quant_config=harness.quant_config(cfg),
                              prefix=f"{harness.PREFIX}.{harness.LINEARS['down'][0]}")


def test_nvfp4_shard_k_named_at_load(dist, ckpt, impl):
    """NVFP4's kernel config carries no shape, so the shard's K is checked at load, with the layer."""
    impl("reference")

    def cut(layer):  # as if the shard held K = 8 (not a multiple of 16)
        layer.weight_packed = torch.nn.Parameter(layer.weight_packed.data[:, :4].contiguous(), requires_grad=False)

    with pytest.raises(convert.CheckpointError, match=r"output\.dense.*multiple of 16, got K=8"):
        _corrupt_then_process(ckpt("ct_nvfp4"), "down", cut)
