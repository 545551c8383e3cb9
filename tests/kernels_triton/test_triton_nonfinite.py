"""The non-finite rule in the Triton kernels (docs/formats.md, "Non-finite values"): activation
quantization equals the oracle bit for bit on NaN/Inf input, a NaN/Inf in a row of x never gives a
finite output for that row and reaches other rows only for per-tensor scales, NaN weight codes
decode to NaN, a bad tensor-valued nvfp4 global scale gives NaN (never zeros), and no finite
input whose exact result is finite overflows in the epilogue. Every GEMM path the device runs."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, device_name
from kernels_triton import interpreting

import formats as F
from formats.validate import check_scale_values
import kernels_triton as kt
from formats import FORMAT_NAMES

NAN, INF = float("nan"), float("inf")
VALUES = [NAN, INF, -INF]
VIDS = ["nan", "inf", "-inf"]
CASES = [("fp8_tensor", {}, True), ("fp8_tensor", {"scale": 0.01}, False), ("fp8_block", {}, False),
         ("fp8_block", {"ue8m0": True}, False), ("mxfp8", {}, False), ("mxfp8", {"scale_rule": "floor"}, False),
         ("nvfp4", {}, True), ("nvfp4", {"global_scale": 200.0}, False), ("mxfp4", {}, False),
         ("fp8_channel", {}, False), ("fp8_channel", {"scale": 0.01}, False)]
CIDS = [f"{f}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'dynamic'}" for f, o, _ in CASES]
GEMM_OPTS = {"ue8m0"}  # options that also go to gemm (fp8_block's UE8M0 native MMA)


def _paths_for(fmt):
    """The GEMM paths this device runs for fmt: portable always; native where it is right here
    (not nvfp4 under the interpreter, whose dot_scaled decodes e4m3 scales as E8M0)."""
    paths = ["portable"]
    if not (fmt == "nvfp4" and (interpreting() or torch.cuda.get_device_capability()[0] != 12)):
        paths.append("native")
    return paths


PATH_CASES = [(f, o, p, pt) for f, o, pt in CASES for p in ("portable", "native")]
PIDS = [f"{c}-{p}" for c, (_, _, p, _) in zip([i for i in CIDS for _ in (0, 1)], PATH_CASES)]


def _x(v, dtype=torch.bfloat16, m=4, k=256):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g)
    x[1, 37] = v
    return x.to(dtype).to(DEVICE)


def _weight(fmt, n=24, k=256, **opts):
    g = torch.Generator().manual_seed(8)
    return F.quantize(torch.randn(n, k, generator=g), fmt, **opts).to(DEVICE)


def _bits(t):
    """The raw bits; an fp32 NaN's payload is not part of the rule (GPUs write 0x7FFFFFFF, CPUs
    0x7FC00000), so every fp32 NaN compares as 0x7FC00000. 1-byte codes are compared exactly."""
    if t.dtype != torch.float32:
        return t.view(torch.uint8)
    return torch.where(t.isnan(), torch.tensor(0x7FC00000, dtype=torch.int32, device=t.device), t.view(torch.int32))


@pytest.mark.parametrize("v", VALUES, ids=VIDS)
@pytest.mark.parametrize("fmt,opts,per_tensor", CASES, ids=CIDS)
def test_quantize_nonfinite_matches_oracle_bit_for_bit(fmt, opts, per_tensor, v):
    x = _x(v)
    q = kt.quantize_activation(x, fmt, **opts)
    r = F.quantize(x.cpu(), fmt, role="activation", **opts)
    assert torch.equal(_bits(q.data).cpu(), _bits(r.data))
    assert torch.equal(_bits(q.scale).cpu(), _bits(r.scale))
    if fmt == "nvfp4":
        assert torch.equal(_bits(q.global_scale).cpu(), _bits(r.global_scale))


@pytest.mark.parametrize("v", VALUES, ids=VIDS)
@pytest.mark.parametrize("fmt,opts,path,per_tensor", PATH_CASES, ids=PIDS)
def test_linear_nonfinite_row_is_never_finite(fmt, opts, path, per_tensor, v):
    if path not in _paths_for(fmt):
        pytest.skip(f"{fmt} {path}: not checkable on {device_name()} (see test_native)")
    x, w = _x(v), _weight(fmt, **{k: o for k, o in opts.items() if k in GEMM_OPTS})
    y = kt.linear(x, w, path=path, **opts)
    ref = F.reference_linear(x.cpu(), w.to("cpu"), **opts)
    rows = (~torch.isfinite(y)).all(1).tolist()
    assert rows == ([True] * 4 if per_tensor else [False, True, False, False])
    assert torch.equal(torch.isfinite(y).cpu(), torch.isfinite(ref))  # same pattern as the oracle


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a16_nonfinite_stays_in_its_row(fmt):
    y = kt.linear(_x(NAN), _weight(fmt), a16=True)
    assert (~torch.isfinite(y)).all(1).tolist() == [False, True, False, False]


def _poison_weight(w):
    """w with element (0, 5)'s NaN code (e4m3 formats) or row 0's first block scale NaN (FP4)."""
    data, scale = w.data.clone(), w.scale.clone()
    if w.fmt in ("fp8_tensor", "fp8_block", "mxfp8", "fp8_channel"):
        data.view(torch.uint8)[0, 5] = 0xFF  # the negative NaN code: it must decode as NaN too
    elif w.fmt == "nvfp4":
        scale.view(torch.uint8)[0, 0] = 0x7F
    else:
        scale[0, 0] = 0xFF
    return F.QuantizedTensor(w.fmt, w.role, data, scale, w.global_scale, w.block_shape, w.shape, w.scale_layout)


@pytest.mark.parametrize("path", ["portable", "native"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_nan_weight_codes_decode_to_nan(fmt, path):
    if path not in _paths_for(fmt):
        pytest.skip(f"{fmt} {path}: not checkable on {device_name()} (see test_native)")
    w = _poison_weight(_weight(fmt))
    x = _x(1.0)
    y = kt.linear(x, w, path=path)
    # column 0 (the poisoned weight row) is NaN in every row; every other column stays finite
    assert bool(y[:, 0].isnan().all()) and bool(torch.isfinite(y[:, 1:]).all())


def test_nan_weight_scale_w4a16():
    y = kt.linear(_x(1.0), _poison_weight(_weight("mxfp4")), a16=True)
    assert bool(y[:, 0].isnan().all()) and bool(torch.isfinite(y[:, 1:]).all())
    # nvfp4 W4A16 decodes its weight scales without the NaN select (the kernel is at its register
    # limit: kernels_triton._codecs.dequantize_e4m3_finite); a NaN scale code is refused at load instead
    with pytest.raises(ValueError, match="must be non-negative and not NaN"):
        check_scale_values(_poison_weight(_weight("nvfp4")))


@pytest.mark.parametrize("g", [0.0, -1.0, INF, NAN], ids=["zero", "negative", "inf", "nan"])
def test_bad_tensor_global_scale_gives_nan_never_zeros(g):
    x, w = _x(1.0), _weight("nvfp4")
    y = kt.linear(x, w, global_scale=torch.tensor(g, device=DEVICE))
    assert bool(y.isnan().all())
    # the quantizer itself records NaN as the g it used, so another GEMM (CuTe's, whose alpha is
    # 1 / g_x) cannot turn it into zeros either: for g = Inf, 1 / g would be 0
    xq = kt.quantize_activation(x, "nvfp4", global_scale=torch.tensor(g, device=DEVICE))
    assert bool(xq.global_scale.isnan())
    empty = kt.quantize_activation(x[:0], "nvfp4", global_scale=torch.tensor(g, device=DEVICE))  # no launch
    assert bool(empty.global_scale.isnan())
    # the same value as a Python number is refused on the host
    with pytest.raises(ValueError, match="global_scale must be one finite positive number"):
        kt.linear(x, w, global_scale=g)


@pytest.mark.parametrize("g", [0.0, -1.0, INF, NAN], ids=["zero", "negative", "inf", "nan"])
def test_bad_weight_global_scale_gives_nan(g):
    w = _weight("nvfp4")
    bad = F.QuantizedTensor(w.fmt, w.role, w.data, w.scale, torch.tensor(g, device=DEVICE), w.block_shape, w.shape)
    assert bool(kt.linear(_x(1.0), bad).isnan().all())
    assert bool(kt.linear(_x(1.0), bad, a16=True).isnan().all())


# ---------------------------------------------------------------------------------------------
# Epilogue overflow at the edges of the output dtype's range
# ---------------------------------------------------------------------------------------------
EDGES = [(torch.bfloat16, 3.0e38), (torch.bfloat16, 3.0e36), (torch.float16, 60000.0)]


@pytest.mark.parametrize("dtype,big", EDGES, ids=["bf16-3e38", "bf16-3e36", "fp16-6e4"])
@pytest.mark.parametrize("path", ["portable", "native"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_no_overflow_when_the_exact_result_is_finite(fmt, path, dtype, big):
    if fmt == "mxfp4" and big > 1e38:
        pytest.skip("mxfp4 activations this close to FLT_MAX quantize to 2^128 (not an fp32 number): "
                    "test_mxfp4_activation_near_flt_max_quantizes_past_fp32 documents it")
    if path not in _paths_for(fmt):
        pytest.skip(f"{fmt} {path}: not checkable on {device_name()} (see test_native)")
    g = torch.Generator().manual_seed(9)
    k = 256
    # each row of x holds one huge value; the weight's entries are small (|w| <= 1/8), so the exact
    # |y| <= big * (1/8 + K * max|x_rest| * 1/8) stays inside the dtype's range
    x = torch.randn(8, k, generator=g) * 0.01
    x[:, 3] = big * torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0)
    x = x.to(dtype).to(DEVICE)
    w = F.quantize(torch.rand(16, k, generator=g) / 8, fmt).to(DEVICE)
    y = kt.linear(x, w, path=path)
    ref = F.reference_linear(x.cpu(), w.to("cpu"))
    assert bool(torch.isfinite(ref).all())
    assert bool(torch.isfinite(y).all()), "the epilogue overflowed where the exact result is finite"
    # y is dominated by big * w[:, 3]: the kernel and the oracle sum the same exact products, so
    # they agree to the fp32 accumulation (K * 2^-24 relative) plus one rounding to the output dtype
    # (2^-8 for bf16, 2^-11 for fp16): 2^-7 relative is a loose, safe bound
    err = (y.double().cpu() - ref.double()).abs()
    assert bool((err <= 2.0 ** -7 * ref.double().abs().amax(1, keepdim=True)).all())


def test_mxfp4_activation_near_flt_max_quantizes_past_fp32():
    # The ceil rule gives 3e38 the scale 2^126 and the e2m1 code 4 (3e38 / 2^126 = 3.53 rounds to
    # 4): the quantized value 2^128 exceeds FLT_MAX, so the oracle's fp32 dequantize is Inf there
    # and the kernel's row is non-finite (the float64 reference_linear stays finite).
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 0] = 3.0e38
    assert bool(F.dequantize(F.quantize(x, "mxfp4", role="activation"))[0, 0].isinf())
    w = F.quantize(torch.full((4, 64), 0.1), "mxfp4").to(DEVICE)
    y = kt.linear(x.to(DEVICE), w)
    assert (~torch.isfinite(y)).all(1).tolist() == [True, False]
