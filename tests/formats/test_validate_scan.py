"""formats.validate.scan_values / scan_scalar / scan_raw: the value findings of a quantized weight
(what b12x-dual diff's checkpoint stage and the vLLM plugin's load checks report), checked against
the decoders of formats.codecs over every byte value a code or scale can hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_input

import formats
from formats import validate as V
from formats.codecs import decode_e4m3, decode_e8m0

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def _weight(fmt: str, n: int = 256, k: int = 256):
    w = make_input((n, k), torch.float32, device="cpu", zero_blocks=False) * 0.05
    return formats.quantize(w, fmt, role="weight")


def _kinds(findings) -> dict:
    return {(f["tensor"], f["kind"]): f for f in findings}


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4"])
def test_a_weight_the_oracle_quantized_has_no_finding(fmt):
    assert V.scan_values(_weight(fmt)) == []


def test_every_e4m3_weight_code():
    """Each of the 256 e4m3 bytes once in row 3: exactly the codes that decode to NaN (0x7F, 0xFF)
    are findings, at their columns (K-block = column // 32 for mxfp8)."""
    q = _weight("mxfp8")
    d = q.data.clone()
    d.view(torch.uint8)[3] = ALL_BYTES
    (f,) = V.scan_values(dataclasses.replace(q, data=d))
    nan_cols = torch.isnan(decode_e4m3(ALL_BYTES)).nonzero().reshape(-1).tolist()
    assert nan_cols == [0x7F, 0xFF]
    assert (f["tensor"], f["kind"], f["severity"], f["count"]) == ("weight.data", "nan_code", V.UNSOUND, 2)
    assert f["positions"] == [{"row": 3, "column": c, "kblock": c // 32} for c in nan_cols]


def test_every_e4m3_block_scale_byte():
    """nvfp4 block scales: each byte once in scale row 5 (K = 4096: 256 blocks): NaN codes -> nan_scale,
    negative non-zero values -> negative_scale, +-0 -> zero_scale (a warning, the block's codes being
    non-zero), everything else (positive) -> nothing; classified by decode_e4m3's values."""
    q = _weight("nvfp4", 16, 4096)
    s = q.scale.clone()
    s.view(torch.uint8)[5] = ALL_BYTES
    got = _kinds(V.scan_values(dataclasses.replace(q, scale=s)))
    v = decode_e4m3(ALL_BYTES)
    want = {"nan_scale": torch.isnan(v), "negative_scale": v < 0, "zero_scale": v == 0}
    assert set(got) == {("weight.scale", k) for k in want}
    for kind, mask in want.items():
        f = got[("weight.scale", kind)]
        cols = mask.nonzero().reshape(-1).tolist()
        assert f["count"] == len(cols) and f["severity"] == (V.WARNING if kind == "zero_scale" else V.UNSOUND)
        assert f["positions"] == [{"row": 5, "kblock": c, "columns": [16 * c, 16 * c + 15]} for c in cols[:V.SCAN_LIMIT]]


def test_a_zero_block_scale_over_zero_codes_is_no_finding():
    """The quantizer writes scale 0 for an all-zero block (formats/nvfp4.py): not a finding."""
    w = make_input((16, 64), torch.float32, device="cpu", zero_blocks=False) * 0.05
    w[2, 16:32] = 0
    q = formats.quantize(w, "nvfp4", role="weight")
    assert q.scale.view(torch.uint8)[2, 1] == 0 and V.scan_values(q) == []
    d = q.data.clone()
    d[2, 8:16] = 0x88  # e2m1 -0 in both nibbles: still an all-zero block
    assert V.scan_values(dataclasses.replace(q, data=d)) == []
    d[2, 15] = 0x18  # one element +0.5: the zero scale now hides a non-zero code
    (f,) = V.scan_values(dataclasses.replace(q, data=d))
    assert (f["kind"], f["positions"]) == ("zero_scale", [{"row": 2, "kblock": 1, "columns": [16, 31]}])


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_every_e8m0_scale_byte(fmt):
    """E8M0: only 0xFF (NaN) is a finding; 0x00 is 2^-127, not zero (decode_e8m0)."""
    q = _weight(fmt, 16, 256 * 32)
    s = q.scale.clone()
    s[4] = ALL_BYTES
    (f,) = V.scan_values(dataclasses.replace(q, scale=s))
    assert torch.isnan(decode_e8m0(ALL_BYTES)).nonzero().reshape(-1).tolist() == [255]
    assert decode_e8m0(ALL_BYTES[:1]).item() == 2.0 ** -127
    assert (f["kind"], f["count"], f["positions"]) == ("e8m0_nan", 1, [{"row": 4, "kblock": 255,
                                                                          "columns": [8160, 8191]}])


@pytest.mark.parametrize("value,kind", [(float("nan"), "nonfinite_scale"), (float("inf"), "nonfinite_scale"),
                                        (float("-inf"), "nonfinite_scale"), (0.0, "nonpositive_scale"),
                                        (-0.5, "nonpositive_scale")])
def test_float_scales(value, kind):
    """fp8_block fp32 block scales (the weight rows a scale row covers are named), fp8_tensor's one
    scale, nvfp4's global scale, a static input scale: NaN, +-Inf, 0 and negatives are findings."""
    q = _weight("fp8_block")
    s = q.scale.clone()
    s[1, 0] = value
    (f,) = V.scan_values(dataclasses.replace(q, scale=s))
    assert (f["kind"], f["positions"]) == (kind, [{"row": 1, "kblock": 0, "columns": [0, 127], "rows": [128, 255]}])
    q = _weight("fp8_tensor")
    (f,) = V.scan_values(dataclasses.replace(q, scale=torch.tensor(value)))
    assert f["kind"] == kind and f["tensor"] == "weight.scale"
    q = _weight("nvfp4")
    (f,) = V.scan_values(dataclasses.replace(q, global_scale=torch.tensor(value)))
    assert f["kind"] == kind and f["tensor"] == "weight.global_scale"
    (f,) = V.scan_scalar(torch.tensor(value), "input scale")
    assert f["kind"] == kind and f["tensor"] == "input scale"


def test_swizzled_scales_are_reported_in_linear_positions():
    q = _weight("mxfp8")
    s = q.scale.clone()
    s[130 % 256, 5] = 0xFF
    sw = dataclasses.replace(q, scale=formats.swizzle_128x4(s), scale_layout="swizzled_128x4")
    (f,) = V.scan_values(sw)
    assert f["positions"] == [{"row": 130, "kblock": 5, "columns": [160, 191]}]


def test_raw_tensors_are_read_by_dtype_and_name():
    """scan_raw on stored checkpoint tensors: an e4m3 scale's NaN and negative codes, an e4m3 weight's
    NaN codes, E8M0 scale bytes 0xFF (uint8 weight bytes are e2m1: no finding), float scales <= 0 or
    non-finite; positions are indices into the stored tensor."""
    s = torch.full((4, 8), 0x38, dtype=torch.uint8)
    s[1, 2], s[3, 0] = 0x7F, 0xB8
    got = _kinds(V.scan_raw(s.view(torch.float8_e4m3fn), "m.weight_scale"))
    assert got[("m.weight_scale", "nan_scale")]["positions"] == [{"index": [1, 2]}]
    assert got[("m.weight_scale", "negative_scale")]["positions"] == [{"index": [3, 0]}]
    (f,) = V.scan_raw(s.view(torch.float8_e4m3fn), "m.weight")
    assert (f["kind"], f["positions"]) == ("nan_code", [{"index": [1, 2]}])
    b = torch.zeros(3, 5, dtype=torch.uint8)
    b[2, 4] = 0xFF
    assert V.scan_raw(b, "m.weight_packed") == []
    (f,) = V.scan_raw(b, "m.weight_scale")
    assert (f["kind"], f["positions"]) == ("e8m0_nan", [{"index": [2, 4]}])
    (f,) = V.scan_raw(torch.tensor(0.0), "m.weight_global_scale")
    assert f["kind"] == "nonpositive_scale"
    assert "index (2, 4)" in V.describe_finding(V.scan_raw(b, "m.weight_scale")[0])
