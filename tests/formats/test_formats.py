"""Pin each format's quantize / dequantize / reference_linear to hand-computed values.

Modules: formats/fp8_tensor.py, formats/fp8_block.py, formats/mxfp8.py, formats/nvfp4.py,
formats/mxfp4.py and their MX scale rule formats/_mx.py, formats/oracle.py.
"""

import dataclasses
import math

import pytest
import torch

import formats as F
from formats import codecs


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# fp8_tensor
# --------------------------------------------------------------------------------------------
def test_fp8_tensor_dynamic_scale_is_amax_over_448():
    q = F.quantize(t([[0.5, -1.0, 3.5, 7.0]]), "fp8_tensor")
    assert q.scale.item() == 7.0 / 448  # 1/64
    assert q.data.float().tolist() == [[32.0, -64.0, 224.0, 448.0]]
    assert F.dequantize(q).tolist() == [[0.5, -1.0, 3.5, 7.0]]


def test_fp8_tensor_static_scale_saturates():
    q = F.quantize(t([[1.0, -300.0]]), "fp8_tensor", role="activation", scale=0.5)
    assert q.scale.item() == 0.5 and q.data.float().tolist() == [[2.0, -448.0]]


def test_fp8_tensor_tiny_gemm_by_hand():
    x = t([[1.0, 2.0], [3.0, 4.0]])
    w = F.quantize(t([[1.0, 0.0], [0.0, -1.0], [2.0, 2.0]]), "fp8_tensor")  # exact: 224, 448 codes
    # x: scale 4/448; 3/(4/448) = 336 is the tie 320|352 -> 320 (even mantissa), so x[1,0] -> 320*4/448
    x10 = 320 * 4 / 448
    y = F.reference_linear(x, w, out_dtype=torch.float32)
    want = t([[1.0, -2.0, 6.0], [x10, -4.0, 2 * (x10 + 4.0)]])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# fp8_block
# --------------------------------------------------------------------------------------------
def test_fp8_block_scales_per_group_and_per_128x128_block():
    x = torch.cat([torch.ones(1, 64), 2 * torch.ones(1, 64), 4 * torch.ones(1, 128)], dim=1)  # K = 256
    qx = F.quantize(x, "fp8_block", role="activation")
    assert qx.scale.shape == (1, 2)
    assert torch.equal(qx.scale, torch.tensor([[2.0, 4.0]]) / 448)  # float32 division, as specified
    w = torch.full((130, 128), 0.5)
    w[129] = -3.0  # second 128-row block, amax 3
    qw = F.quantize(w, "fp8_block")
    assert qw.scale.shape == (2, 1) and qw.scale.flatten().tolist() == pytest.approx([0.5 / 448, 3 / 448], rel=1e-7)
    assert qw.data[0, 0].float().item() == 448.0 and qw.data[129, 0].float().item() == -448.0
    # partial row block 1 (rows 128..129): row 128 is 0.5 under scale 3/448 -> 74.67 -> e4m3 72
    assert qw.data[128, 0].float().item() == 72.0


def test_fp8_block_ue8m0_rounds_scales_up_to_powers_of_two():
    x = torch.cat([torch.ones(1, 64), 2 * torch.ones(1, 64)], dim=1)
    q = F.quantize(x, "fp8_block", role="activation", ue8m0=True)
    assert q.scale.item() == 2.0**-7  # 2/448 = 2^-7.807 -> 2^-7
    assert q.data.float().unique().tolist() == [128.0, 256.0]


def test_fp8_block_tiny_gemm_by_hand():
    x = torch.cat([torch.ones(1, 64), 2 * torch.ones(1, 64)], dim=1)
    w = torch.cat([torch.full((1, 128), 0.5), torch.full((1, 128), -1.0)])
    y = F.reference_linear(x, F.quantize(w, "fp8_block"), bias=t([1.0, 0.0]), out_dtype=torch.float64)
    # codes are exact (224/448); only the float32 scales amax/448 carry rounding (~1e-7)
    torch.testing.assert_close(y, torch.tensor([[64 * 0.5 + 64 * 1.0 + 1.0, -64 - 128.0]], dtype=torch.float64), rtol=2e-7, atol=0)


# --------------------------------------------------------------------------------------------
# MX scale rules (mxfp8, mxfp4)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt,amax,ceil_byte,floor_byte",
    [
        ("mxfp8", 1.0, 127 - 8, 127 - 8),  # 1/448 -> 2^-8 either way
        ("mxfp8", 3.0, 127 - 7, 127 - 7),
        ("mxfp8", 448.0, 127, 127),
        ("mxfp8", 500.0, 128, 127),  # ceil: 500/448 -> 2^1; floor: 2^(8-8) and 500 saturates
        ("mxfp4", 6.0, 127, 127),
        ("mxfp4", 7.0, 128, 127),  # ceil: 7/6 -> 2^1; floor: 2^(2-2), 7 saturates to 6
        ("mxfp4", 0.75, 127 - 3, 127 - 3),  # ceil(log2(0.125)) = -3; floor(log2 .75) - 2 = -3
        ("mxfp4", 1.0, 127 - 2, 127 - 2),  # ceil(log2(1/6)) = -2; floor: 0 - 2
    ],
)
def test_mx_scale_rules_by_hand(fmt, amax, ceil_byte, floor_byte):
    x = torch.zeros(1, 32)
    x[0, 3] = amax
    x[0, 4] = -amax / 3
    assert F.quantize(x, fmt).scale.item() == ceil_byte
    assert F.quantize(x, fmt, scale_rule="floor").scale.item() == floor_byte


def test_mxfp4_codes_and_nibble_order_by_hand():
    x = torch.zeros(1, 32)
    x[0, :4] = t([7.0, 1.0, -0.75, 0.0])
    q = F.quantize(x, "mxfp4")
    # scale 2^1: 3.5 -> tie -> 4 (code 6), 0.5 (code 1), -0.375 -> -0.5 (code 9), 0 (code 0)
    assert q.scale.item() == 128
    assert q.data[0, :2].tolist() == [0x16, 0x09]  # element 0 in the low nibble
    assert F.dequantize(q)[0, :4].tolist() == [8.0, 1.0, -1.0, 0.0]


def test_mxfp8_codes_by_hand():
    x = torch.zeros(2, 32)
    x[0, :3] = t([500.0, 1.0, -3.0])
    q = F.quantize(x, "mxfp8")
    # scale 2^1: 500/2 = 250 rounds to 256 (e4m3 has 240, 256 there), 1/2, -3/2 exact
    assert q.scale[0].item() == 128 and q.data[0, :3].float().tolist() == [256.0, 0.5, -1.5]
    # zero block: amax is floored at 2^-100, so the scale is 2^ceil(log2(2^-100 / 448)) = 2^-108
    assert q.scale[1].item() == 127 - 108 and (q.data[1].view(torch.uint8) == 0).all()


def test_mx_tiny_gemm_by_hand():
    x = torch.zeros(1, 32)
    x[0, :2] = t([7.0, 1.0])
    w = torch.zeros(2, 32)
    w[0, :2] = t([1.0, 1.0])
    w[1, :2] = t([0.75, -6.0])
    y = F.reference_linear(x, F.quantize(w, "mxfp4"), out_dtype=torch.float32)
    # x -> [8, 1] (scale 2); w0 -> [1, 1] (scale 2^-2: codes 4, 4); w1 -> [0.75?]: amax 6 -> scale 1,
    # 0.75 -> tie 0.5|1.0 -> 1.0, -6 -> -6
    assert y.tolist() == [[9.0, 8.0 - 6.0]]


# --------------------------------------------------------------------------------------------
# nvfp4
# --------------------------------------------------------------------------------------------
def test_nvfp4_two_level_scales_by_hand():
    x = torch.zeros(1, 32)
    x[0, :5] = t([6.0, 3.0, 1.5, -0.75, 0.25])
    x[0, 16:18] = t([0.3, 0.1])
    q = F.quantize(x, "nvfp4")
    assert q.global_scale.item() == 448.0  # 2688 / amax 6
    # block 0: s = e4m3(6/6 * 448) = 448 -> codes x * 448 / 448
    # block 1: s = e4m3(0.3/6 * 448 = 22.4) = 22 (1.375 * 16); 0.3*448/22 = 6.1 -> 6; 0.1*448/22 -> 2
    assert codecs.decode_e4m3(q.scale).tolist() == [[448.0, 22.0]]
    vals = codecs.decode_e2m1(codecs.unpack_e2m1(q.data))[0]
    assert vals[:5].tolist() == [6.0, 3.0, 1.5, -1.0, 0.0] and vals[16:18].tolist() == [6.0, 2.0]
    deq = F.dequantize(q)[0]
    assert deq[16].item() == pytest.approx(6 * 22 / 448) and deq[3].item() == -1.0


def test_nvfp4_static_global_scale_and_tiny_gemm():
    x = torch.zeros(1, 16)
    x[0, :3] = t([6.0, 3.0, -1.5])
    w = torch.ones(2, 16)
    w[1] = -0.5
    qw = F.quantize(w, "nvfp4")
    assert qw.global_scale.item() == 2688.0
    y = F.reference_linear(x, qw, out_dtype=torch.float32, global_scale=448.0)
    assert y.tolist() == [[7.5, -3.75]]
    with pytest.raises(ValueError, match="global_scale must be one finite positive number"):
        F.quantize(x, "nvfp4", role="activation", global_scale=0.0)


# --------------------------------------------------------------------------------------------
# All formats: zeros, error bounds, errors
# --------------------------------------------------------------------------------------------
K_FOR = {"fp8_tensor": 128, "fp8_block": 256, "mxfp8": 96, "nvfp4": 48, "mxfp4": 96, "fp8_channel": 100}


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_all_zero_tensor_gives_zero_codes_and_finite_positive_scales(fmt):
    q = F.quantize(torch.zeros(3, K_FOR[fmt]), fmt)
    assert (q.data.view(torch.uint8) == 0).all()
    scale = codecs.decode_e4m3(q.scale) if fmt == "nvfp4" else (
        codecs.decode_e8m0(q.scale) if fmt.startswith("mx") else q.scale)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    if q.global_scale is not None:
        assert math.isfinite(q.global_scale.item()) and q.global_scale.item() > 0
    assert (F.dequantize(q) == 0).all()


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_zero_and_denormal_blocks_inside_a_tensor(fmt):
    x = torch.randn(4, 256)
    x[1, :128] = 0.0
    x[2, 128:] = 1e-40  # float32 denormals
    q = F.quantize(x, fmt, role="activation")
    d = F.dequantize(q)
    assert torch.isfinite(d).all() and (d[1, :128] == 0).all()
    assert d[2, 128:].abs().max() <= 1e-39


# measured on N(0, 1) 256x512: fp8 formats 0.0263-0.0266, nvfp4 0.0955, mxfp4 0.115
ROUND_TRIP_BOUND = {"fp8_tensor": 0.028, "fp8_block": 0.028, "mxfp8": 0.028, "nvfp4": 0.100, "mxfp4": 0.121,
                    "fp8_channel": 0.028}


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_round_trip_error_bounds(fmt):
    x = torch.randn(256, 512)
    err = ((F.dequantize(F.quantize(x, fmt)) - x).norm() / x.norm()).item()
    assert 0.01 < err < ROUND_TRIP_BOUND[fmt]


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_reference_linear_shapes_bias_and_dtypes(fmt):
    k = K_FOR[fmt]
    w = F.quantize(torch.randn(5, k), fmt)
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    b = torch.randn(5)
    y = F.reference_linear(x, w, b)
    assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16
    xq = F.quantize(x, fmt, role="activation")
    y2 = F.reference_linear(xq, w, b, out_dtype=torch.float16)
    assert y2.shape == (6, 5) and torch.allclose(y2.float(), y.reshape(6, 5).float(), rtol=2e-2, atol=2e-2)
    # a16: activations stay unquantized
    ya = F.reference_linear(x, w, a16=True, out_dtype=torch.float64)
    want = x.double().reshape(6, k) @ F.dequantize(w, torch.float64).T
    assert torch.equal(ya.reshape(6, 5), want)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])  # the formats with 1-byte block scales
def test_swizzled_scales_dequantize_the_same(fmt):
    q = F.quantize(torch.randn(130, 256), fmt)
    qs = dataclasses.replace(q, scale=F.swizzle_128x4(q.scale), scale_layout="swizzled_128x4")
    assert torch.equal(F.dequantize(qs), F.dequantize(q))


@pytest.mark.parametrize("fmt,k,multiple", [("fp8_block", 100, 128), ("mxfp8", 48, 32), ("nvfp4", 24, 16), ("mxfp4", 40, 32)])
def test_k_alignment_error_names_format_value_and_multiple(fmt, k, multiple):
    with pytest.raises(ValueError, match=rf"{fmt} needs K .* multiple of {multiple}, got {k}"):
        F.quantize(torch.randn(4, k), fmt)


def test_input_errors():
    with pytest.raises(ValueError, match="fmt must be one of"):
        F.quantize(torch.randn(2, 32), "fp6")
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        F.quantize(torch.tensor([[1.0, float("nan")] * 16]), "mxfp8")
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        F.quantize(torch.randn(2, 2, 32), "mxfp8")
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16"):
        F.quantize(torch.ones(2, 32, dtype=torch.int32), "mxfp8")
    with pytest.raises(ValueError, match="role must be one of"):
        F.quantize(torch.randn(2, 32), "mxfp8", role="bias")
    with pytest.raises(ValueError, match="mxfp8: .*unexpected keyword"):
        F.quantize(torch.randn(2, 32), "mxfp8", ue8m0=True)
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        F.quantize(torch.randn(2, 32), "mxfp4", scale_rule="round")
    w = F.quantize(torch.randn(4, 64), "mxfp8")
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal the weight's K=64, got 32"):
        F.reference_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        F.reference_linear(torch.randn(2, 64), w, torch.randn(3))
