"""The variant a layer serves comes from the checkpoint's own scheme (dispatch/vllm_plugin/scheme.py),
never from a default of vLLM's scheme class.

vLLM maps every compressed-tensors MXFP4-weight scheme to its W4A4 class (activation key: dynamic
MXFP4) and every MXFP8-weight scheme to its W8A8 class; a weight-only checkpoint must still be
served weight-only (MXFP4A16 -> mxfp4_w4a16), or refused at load by name where b12x-dual has no
variant for it (MXFP8A16 today).
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
    "FP8_DYNAMIC": None,  # per-channel weight scales: no variant yet
    "MXFP8": "mxfp8",
    "MXFP8A16": None,  # weight-only MXFP8: no variant yet
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


@pytest.mark.parametrize("kind,what", [("ct_mxfp8a16", "input activations none"),
                                       ("ct_fp8_channel", "weights float8 channel static")])
def test_scheme_we_do_not_serve_is_refused_at_load_by_name(kind, what, dist, ckpt, impl):
    """A checkpoint whose scheme has no b12x-dual variant fails at load naming the layer and the
    scheme, never served as something else. (FP8_DYNAMIC is turned away earlier, in can_implement,
    when vLLM asks for a per-channel kernel; the load check is for a class vLLM built anyway.)"""
    impl("reference")
    d = ckpt(kind)
    try:
        loaded(d, ("o",))
    except Exception as e:  # noqa: BLE001
        msg = str(e)
    else:
        if kind == "ct_fp8_channel":
            pytest.skip("vLLM picked one of its own kernels for per-channel FP8 (ours declined in can_implement)")
        raise AssertionError(f"{kind} loaded without an error")
    if kind == "ct_fp8_channel" and "Failed to find a kernel" in msg:
        return  # declined at selection, naming per-channel scales: not served as something else
    assert "encoder.layer.0.attention.output.dense" in msg and what in msg, msg
