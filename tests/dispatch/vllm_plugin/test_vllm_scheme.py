"""The variant a layer serves comes from the checkpoint's own scheme (dispatch/vllm_plugin/scheme.py),
never from a default of vLLM's scheme class.

vLLM maps every compressed-tensors MXFP4-weight scheme to its W4A4 class (activation key: dynamic
MXFP4) and every MXFP8-weight scheme to its W8A8 class; a weight-only checkpoint must still be
served weight-only (MXFP4A16 -> mxfp4_w4a16, MXFP8A16 -> mxfp8_w8a16), or refused at load by name
where b12x-dual has no variant for it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from _vllm_env import ckpt, ckpt_root, dist, forward, impl, loaded  # noqa: F401
import formats
from conftest import make_input

from dispatch.vllm_plugin import scheme

PRESETS = pytest.importorskip("compressed_tensors.quantization.quant_scheme").PRESET_SCHEMES

# compressed-tensors preset -> the variant that computes it as written (None: not served, refused).
EXPECTED = {
    "FP8": "fp8_tensor",
    "FP8_BLOCK": "fp8_block",
    "FP8_DYNAMIC": "fp8_channel",  # per-channel weight scales, dynamic per-token activations
    "MXFP8": "mxfp8",
    "MXFP8A16": "mxfp8_w8a16",
    "MXFP4": "mxfp4",
    "MXFP4A16": "mxfp4_w4a16",
    "NVFP4": "nvfp4",
    "NVFP4A16": "nvfp4_w4a16",
    # outside our formats (integer weights or activations)
    "W8A16": None, "W4A16": None, "W4A16_ASYM": None, "W8A8": None, "INT8": None, "W4A8": None, "W4AFP8": None,
}


def test_every_preset_is_in_the_table():
    names = {k for k in PRESETS if k != "UNQUANTIZED"}
    assert names == set(EXPECTED), f"presets not in the table: {names ^ set(EXPECTED)}"


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_variant_of_each_preset(preset):
    p = PRESETS[preset]
    variant, why = scheme.variant_of(p["weights"], p.get("input_activations"))
    assert variant == EXPECTED[preset], f"{preset}: {variant} ({why})"
    assert (why == "") == (variant is not None)


def test_weight_only_differs_from_w4a4_only_by_the_activations():
    """The two MXFP4 presets have equal weight args: only input_activations can tell them apart."""
    assert PRESETS["MXFP4"]["weights"] == PRESETS["MXFP4A16"]["weights"]
    assert scheme.variant_of(PRESETS["MXFP4"]["weights"], None)[0] == "mxfp4_w4a16"


def test_describe_names_the_checkpoints_terms():
    assert scheme.describe(PRESETS["FP8_DYNAMIC"]["weights"]) == "float8 channel static"
    assert scheme.describe(PRESETS["FP8_DYNAMIC"]["input_activations"]) == "float8 token dynamic"
    assert scheme.describe(PRESETS["MXFP4"]["input_activations"]) == "float4 group 32 dynamic"
    assert scheme.describe(None).startswith("none")


def test_mxfp4a16_is_served_weight_only_and_logged_once(dist, ckpt, impl, caplog):
    """vLLM builds the W4A4 class for this weight-only checkpoint; the layer serves mxfp4_w4a16 and
    its output is the oracle's with bf16 activations (a16=True), bit for bit, and differs from W4A4's."""
    from dispatch.vllm_plugin import ops

    impl("reference")
    d = ckpt("ct_mxfp4a16")
    with caplog.at_level(logging.WARNING, logger="dispatch.vllm_plugin"):
        layers, _ = loaded(d, ("o",))
    layer = layers["o"]
    assert ops.state(layer.b12x_dual_handle).variant == "mxfp4_w4a16"
    from test_vllm_checkpoints import _bias, expected

    qw, act, a16 = expected("ct_mxfp4a16", d, "o")
    assert a16
    x = make_input((4, qw.k), torch.bfloat16, generator=torch.Generator().manual_seed(1), device="cpu")
    y = forward(layer, x)
    b = _bias(d, "o")
    assert torch.equal(y, formats.reference_linear(x, qw, b, a16=True))
    assert not torch.equal(y, formats.reference_linear(x, qw, b, a16=False)), "W4A4 would give the same output"
    said = [r.getMessage() for r in caplog.records if "as the checkpoint says" in r.getMessage()]
    assert len(said) <= 1 and (not said or "mxfp4_w4a16" in said[0])


def test_channel_fp8_schemes_outside_what_fp8_channel_computes_are_named():
    """Per-channel weights with dynamic per-tensor (or no) activations: fp8_channel scales activations
    per token (dynamic) or per tensor (static) only, so these are refused, saying what is served."""
    w = PRESETS["FP8_DYNAMIC"]["weights"]
    a = dict(PRESETS["FP8_DYNAMIC"]["input_activations"].model_dump(), strategy="tensor", dynamic=True)
    for inputs in (a, None):
        variant, why = scheme.variant_of(w, inputs)
        assert variant is None and "dynamically per token or statically per tensor" in why
    static = dict(a, dynamic=False)
    assert scheme.variant_of(w, static) == ("fp8_channel", "")


def test_a_scheme_we_do_not_serve_is_refused_at_load_by_name(dist, ckpt, impl):
    """Per-channel FP8 weights with activations scaled dynamically per tensor (no preset; written by
    compressed-tensors from that scheme): vLLM builds a per-token kernel for it, which would compute
    another activation quantization than the checkpoint's. The load fails naming the layer, the
    scheme and what is served, never serving it as something else."""
    impl("reference")
    with pytest.raises(Exception) as e:
        loaded(ckpt("ct_fp8_channel_tensor_dynamic"), ("o",))
    msg = str(e.value)
    assert "encoder.layer.0.attention.output.dense" in msg, msg
    assert "weights float8 channel static, input activations float8 tensor dynamic" in msg, msg
    assert "dynamically per token or statically per tensor" in msg and "B12xDualFp8ChannelKernel serves fp8_channel" in msg


@pytest.mark.parametrize("kind,variant", [("ct_mxfp8a16", "mxfp8_w8a16"), ("ct_fp8_channel", "fp8_channel")])
def test_the_presets_refused_before_are_served(kind, variant, dist, ckpt, impl):
    """MXFP8A16 and FP8_DYNAMIC were refused at load (no variant); each is served now, as the
    checkpoint's scheme names it, bit for bit against the oracle on the checkpoint's operands."""
    from dispatch.vllm_plugin import ops
    from test_vllm_checkpoints import _bias, expected

    impl("reference")
    d = ckpt(kind)
    layers, _ = loaded(d, ("o",))
    assert ops.state(layers["o"].b12x_dual_handle).variant == variant
    qw, act, a16 = expected(kind, d, "o")
    x = make_input((4, qw.k), torch.bfloat16, generator=torch.Generator().manual_seed(2), device="cpu")
    y = forward(layers["o"], x)
    assert torch.equal(y, formats.reference_linear(x, qw, _bias(d, "o"), a16=a16, **act))
    if a16:  # and it differs from what W8A8 would give
        assert not torch.equal(y, formats.reference_linear(x, qw, _bias(d, "o")))
