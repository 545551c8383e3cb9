"""The non-finite rule in the oracle (docs/formats.md, "Non-finite values"): an activation's NaN or
Inf makes the scale of the block that holds it NaN (the tensor's, for fp8_tensor's dynamic scale
and nvfp4's dynamic global scale), with the codes of that block defined; a weight's raises."""

import pytest
import torch

import formats as F
from formats.codecs import decode_e4m3, decode_e8m0, encode_e4m3

NAN, INF = float("nan"), float("inf")
VALUES = [NAN, INF, -INF]
# (fmt, options, scale per tensor?) for every way an activation is quantized
CASES = [("fp8_tensor", {}, True), ("fp8_tensor", {"scale": 0.01}, False), ("fp8_block", {}, False),
         ("fp8_block", {"ue8m0": True}, False), ("mxfp8", {}, False), ("mxfp8", {"scale_rule": "floor"}, False),
         ("nvfp4", {}, True), ("nvfp4", {"global_scale": 200.0}, False), ("mxfp4", {}, False),
         ("fp8_channel", {}, False), ("fp8_channel", {"scale": 0.01}, False)]
BLOCK = {"fp8_tensor": 1, "fp8_block": 128, "mxfp8": 32, "nvfp4": 16, "mxfp4": 32, "fp8_channel": 256}  # fp8_channel: the row


def _x(v, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, k, generator=g)
    x[1, 37] = v
    return x


def test_encode_e4m3_nan_is_0x7f_and_inf_saturates():
    codes = encode_e4m3(torch.tensor([NAN, -NAN, INF, -INF, 1.0])).view(torch.uint8)
    assert codes.tolist() == [0x7F, 0x7F, 0x7E, 0xFE, 0x38]


def test_nan_codes_decode_to_nan():
    assert decode_e4m3(torch.tensor([0x7F, 0xFF, 0x7E], dtype=torch.uint8)).isnan().tolist() == [True, True, False]
    assert decode_e8m0(torch.tensor([0xFF, 0xFE], dtype=torch.uint8)).isnan().tolist() == [True, False]


@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fmt,opts,per_tensor", CASES, ids=lambda c: str(c))
def test_activation_nonfinite_poisons_its_block_only(fmt, opts, per_tensor, v):
    x = _x(v)
    q = F.quantize(x, fmt, role="activation", **opts)
    d = F.dequantize(q)
    bad = torch.zeros_like(d, dtype=torch.bool)
    if per_tensor:
        bad[:] = True
    elif "scale" in opts:  # fp8_tensor, fp8_channel static scale: only the element (its code is 0x7F)
        bad[1, 37] = True
    else:
        b = BLOCK[fmt]
        bad[1, (37 // b) * b:(37 // b + 1) * b] = True
    assert torch.equal(d.isnan(), bad)  # NaN exactly where the rule says, finite elsewhere
    # the finite blocks are what they would be without the bad element (block formats)
    if not per_tensor:
        x0 = x.clone()
        x0[1, 37] = 0.0
        d0 = F.dequantize(F.quantize(x0, fmt, role="activation", **opts))
        assert torch.equal(d[~bad], d0[~bad])


@pytest.mark.parametrize("fmt,opts,per_tensor", CASES, ids=lambda c: str(c))
def test_activation_nonfinite_codes_are_defined(fmt, opts, per_tensor):
    q = F.quantize(_x(NAN), fmt, role="activation", **opts)
    spec = F.spec(fmt)
    if fmt in ("fp8_tensor", "fp8_block", "fp8_channel"):
        s = q.scale
        assert bool(s.isnan().any()) == ("scale" not in opts)
        if fmt == "fp8_channel" and "scale" not in opts:  # the row's scale only
            assert s.isnan().tolist() == [False, True, False, False]
    elif fmt in ("mxfp8", "mxfp4"):
        assert q.scale[1, 37 // 32].item() == 0xFF and int((q.scale == 0xFF).sum()) == 1
    else:  # nvfp4: e4m3 block scale 0x7F; dynamic: every block and g
        sb = q.scale.view(torch.uint8)
        assert sb[1, 37 // 16].item() == 0x7F
        assert int((sb == 0x7F).sum()) == (sb.numel() if per_tensor else 1)
        assert bool(q.global_scale.isnan()) == per_tensor
    if spec.element == "e4m3":
        assert q.data.view(torch.uint8)[1, 37].item() == 0x7F
    else:  # e2m1 has no NaN code: a NaN-scale block's codes are 0
        b = BLOCK[fmt]
        assert int(q.data[1, (37 // b) * b // 2:(37 // b + 1) * b // 2].max()) == 0


@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fmt,opts,per_tensor", CASES, ids=lambda c: str(c))
def test_reference_linear_follows_the_rule(fmt, opts, per_tensor, v):
    w = F.quantize(torch.randn(8, 256, generator=torch.Generator().manual_seed(1)), fmt)
    y = F.reference_linear(_x(v).bfloat16(), w, **opts)
    nonfinite_rows = (~torch.isfinite(y)).all(1).tolist()
    assert nonfinite_rows == ([True] * 4 if per_tensor else [False, True, False, False])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_w4a16_propagates_nonfinite_to_its_row(fmt):
    w = F.quantize(torch.randn(8, 256), fmt)
    y = F.reference_linear(_x(NAN).bfloat16(), w, a16=True)
    assert (~torch.isfinite(y)).all(1).tolist() == [False, True, False, False]


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
def test_weight_with_nonfinite_values_raises(fmt, v):
    with pytest.raises(ValueError, match="x contains NaN or Inf; quantizing a weight needs finite values"):
        F.quantize(_x(v), fmt, role="weight")


@pytest.mark.parametrize("bad", [0.0, -1.0, INF, NAN])
@pytest.mark.parametrize("fmt,key", [("fp8_tensor", "scale"), ("nvfp4", "global_scale")])
def test_bad_static_scale_raises_in_the_oracle(fmt, key, bad):
    # numbers or tensors alike: the oracle may read the value (it is the reference, not a kernel)
    for value in (bad, torch.tensor(bad)):
        with pytest.raises(ValueError, match=rf"{key} must be one finite positive number"):
            F.quantize(_x(1.0), fmt, role="activation", **{key: value})
