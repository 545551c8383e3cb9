"""The native (tl.dot_scaled) GEMM path against the oracle, the path policy, and NVFP4 W4A16.

Where the native kernels run: under the CPU interpreter (Triton >= 3.8 has dot_scaled there, right
for E8M0 scales; it decodes e4m3 scales as E8M0, so NVFP4's native kernel cannot be checked here:
those cases skip saying so), on any GPU where Triton compiles them (emulated on sm_90), and natively
on SM12x. Forced with path="native"; the default path is checked separately.

Bounds: the kernel and formats.reference_linear sum the same exact products (e2m1/e4m3 codes times
power-of-two or e4m3 scales are exact in fp32, and so are their pairwise products' significands:
at most 2 x 6 bits), the kernel in fp32, the oracle in float64. fp32 summation of K terms errs by
at most K * 2^-24 * sum_k |a_k b_k| (Higham's gamma_K); alpha / bias each add one rounding of |y|.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _e4m3_testlib import fp8_interval
from conftest import DEVICE, device_name, make_input
from kernels_triton import interpreting

import formats
import kernels_triton
from formats import FORMAT_NAMES, spec
from kernels_triton import _common as _paths  # the path policy lives in _common
from kernels_triton._common import TileConfig

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
U = 2.0 ** -24
E4M3_SCALED = tuple(f for f in FORMAT_NAMES if spec(f).scale.startswith("e4m3"))  # nvfp4
FP4 = tuple(f for f in FORMAT_NAMES if spec(f).element == "e2m1")
A16 = _paths.A16_FORMATS  # the weight-only ones: W4A16 (FP4), W8A16 (mxfp8)


def _native_skip(fmt: str):
    """Why the native kernel of fmt cannot be checked on this process's device, or None."""
    if fmt in E4M3_SCALED and interpreting():
        return (f"{fmt}: the Triton interpreter decodes e4m3 scales as E8M0, so its native dot_scaled "
                f"kernel cannot be checked here (found {device_name()})")
    if fmt in E4M3_SCALED and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] != 12:
        major, minor = (int(v) for v in __import__("triton").__version__.split(".")[:2])
        if (major, minor) < (3, 7):
            return f"{fmt}: dot_scaled with e4m3 scales does not compile on {device_name()} with this Triton (triton#7549)"
    return None


def _opts(fmt: str, ue8m0: bool):
    return {"ue8m0": True} if ue8m0 else {}


def _bound(xq, qw, bias, k, u=U, fp8_interval=0):
    """Elementwise bound on |y - ref| for fp32 output: ((K + 3) u + L 2^-12) (|x| . |w|^T + |bias|),
    u the accumulator's unit roundoff (2^-24 for fp32), L > 0 the fp8 MMA's promotion interval where
    the kernel sums L products on Hopper's fp8 MMA first (conftest.gemm_bound)."""
    xa = formats.dequantize(xq.to("cpu"), torch.float64).abs()
    wa = formats.dequantize(qw.to("cpu"), torch.float64).abs()
    mag = xa @ wa.T
    if bias is not None:
        mag = mag + bias.cpu().double().abs()
    return ((k + 3) * u + fp8_interval * 2.0 ** -12) * mag + 1e-30


CASES = [(f, False) for f in FORMAT_NAMES] + [("fp8_block", True)]


@pytest.mark.parametrize("fmt,ue8m0", CASES, ids=[f + ("-ue8m0" if u else "") for f, u in CASES])
@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (37, 72, 384), (130, 24, 640)])
def test_native_gemm_matches_oracle(fmt, ue8m0, m, n, k):
    why = _native_skip(fmt)
    if why:
        pytest.skip(why)
    mod = kernels_triton.module(fmt)
    opts = _opts(fmt, ue8m0)
    qw = formats.quantize(make_input((n, k)), fmt, **opts).to(DEVICE)
    xq = formats.quantize(make_input((m, k)), fmt, role="activation", **opts).to(DEVICE)
    bias = torch.randn(n, device=DEVICE)
    y = mod.gemm(xq, qw, bias, out_dtype=FP32, path="native", **opts).cpu().double()
    ref = formats.reference_linear(xq.to("cpu"), qw.to("cpu"), bias.cpu(), out_dtype=torch.float64)
    err = (y - ref).abs()
    assert bool((err <= _bound(xq, qw, bias, k)).all()), f"max err {err.max().item():.3g}"
    # and the native path really differs from a wrong answer: not all zeros
    assert ref.abs().max() > 0 and y.abs().max() > 0


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if f not in E4M3_SCALED])
def test_native_small_tile_and_bf16_output_match_portable(fmt):
    """The native kernel with a small tile (``tile=``: several programs, four K steps) and a bf16
    store gives what the portable path gives, within the fp32 bound of two different summation
    orders, then one bf16 rounding."""
    mod = kernels_triton.module(fmt)
    m, n, k = 5, 48, 512
    tile = TileConfig(16, 64, 128, GROUP_M=1, num_warps=4, num_stages=1)
    qw = formats.quantize(make_input((n, k)), fmt).to(DEVICE)
    xq = formats.quantize(make_input((m, k)), fmt, role="activation").to(DEVICE)
    bias = torch.randn(n, device=DEVICE)
    y32 = mod.gemm(xq, qw, bias, out_dtype=FP32, path="native", tile=tile).cpu().double()
    p32 = mod.gemm(xq, qw, bias, out_dtype=FP32, path="portable").cpu().double()
    # On a GPU the portable fp8_tensor / fp8_block kernels dot the e4m3 tiles directly, and so does
    # mxfp8's sm_90 decode kernel at this M (32-deep partials): Hopper's fp8 MMA accumulates with
    # 2^-12 per addition inside a promotion interval of L products (conftest.gemm_bound), so the
    # portable side's bound is ((K + 3) 2^-24 + L 2^-12) |x| . |w|^T.
    portable = _bound(xq, qw, bias, k, fp8_interval=fp8_interval(fmt, m))
    assert bool(((y32 - p32).abs() <= _bound(xq, qw, bias, k) + portable).all())
    yb = mod.gemm(xq, qw, bias, out_dtype=BF16, path="native", tile=tile).cpu().double()
    # bf16 RNE of a value within the fp32 bound: half a bf16 ulp (2^-9 relative) plus the bound
    assert bool(((yb - y32).abs() <= y32.abs() * 2.0 ** -8 + 2 * _bound(xq, qw, bias, k)).all())


# formats with one 1-byte scale per row and block (the swizzled 128x4 layout's domain): mxfp8, nvfp4, mxfp4
ONE_BYTE_SCALES = tuple(f for f in FORMAT_NAMES if formats.format_module(f).SCALE_DTYPE.itemsize == 1)


@pytest.mark.parametrize("fmt", ONE_BYTE_SCALES)
def test_native_reads_swizzled_128x4_weight_scales(fmt):
    """The same weight with scales in the swizzled 128x4 layout (formats.swizzle_128x4) gives the
    same bits as with linear scales; N = 200 leaves a partial 128-row scale tile."""
    if _native_skip(fmt):
        pytest.skip(_native_skip(fmt))
    mod = kernels_triton.module(fmt)
    n, k = 200, 384
    qw = formats.quantize(make_input((n, k)), fmt)
    qs = replace(qw, scale=formats.swizzle_128x4(qw.scale), scale_layout="swizzled_128x4")
    xq = formats.quantize(make_input((9, k)), fmt, role="activation").to(DEVICE)
    y_lin = mod.gemm(xq, qw.to(DEVICE), out_dtype=FP32, path="native")
    y_swz = mod.gemm(xq, qs.to(DEVICE), out_dtype=FP32, path="native")
    assert torch.equal(y_lin, y_swz)
    with pytest.raises(ValueError, match="scale_layout"):
        mod.gemm(xq, qs.to(DEVICE), path="portable")
    bad = replace(qs, scale=qs.scale[:-1])
    with pytest.raises(ValueError, match="128x4 swizzled layout"):
        mod.gemm(xq, bad.to(DEVICE), path="native")
    x = make_input((3, k))
    assert torch.equal(mod.linear(x, qs.to(DEVICE), path="native"), mod.linear(x, qw.to(DEVICE), path="native"))


def test_fp8_block_ue8m0_native_refuses_non_power_of_two_scales():
    """ue8m0=True on a weight with ordinary fp32 scales: the native kernel cannot represent them as
    E8M0, so y is NaN (never a silently wrong finite number); the portable path is right."""
    mod = kernels_triton.module("fp8_block")
    n, k = 130, 256
    qw = formats.quantize(make_input((n, k)), "fp8_block").to(DEVICE)
    assert not bool((torch.frexp(qw.scale.cpu()).mantissa == 0.5).all())  # some scale is not 2^e
    xq = formats.quantize(make_input((4, k)), "fp8_block", role="activation", ue8m0=True).to(DEVICE)
    y = mod.gemm(xq, qw, out_dtype=FP32, ue8m0=True, path="native").cpu()
    bad_cols = (torch.frexp(qw.scale.cpu()).mantissa != 0.5).any(dim=1).repeat_interleave(128)[:n]
    assert bool(y[:, bad_cols].isnan().all()) and not bool(y[:, ~bad_cols].isnan().any())


# ---------------------------------------------------------------------------------------------
# path policy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_gemm_path_by_device_family(fmt):
    triton_version = tuple(int(v) for v in __import__("triton").__version__.split(".")[:2])
    for cap, need in (((12, 0), (3, 6)), ((12, 1), (3, 8))):  # triton#8494 / #10010
        path, why = kernels_triton.gemm_path(fmt, cap)
        assert f"sm_{cap[0]}{cap[1]}" in why
        if triton_version >= need:
            assert path == "native" and "block_scale" in why
        else:
            assert path == "portable" and "triton#" in why
    for cap in ((9, 0), (8, 9), (10, 0)):
        path, why = kernels_triton.gemm_path(fmt, cap)
        assert path == "portable" and f"sm_{cap[0]}{cap[1]}" in why
    assert kernels_triton.gemm_path(fmt, None)[0] == "portable"
    if fmt in A16:
        path, why = kernels_triton.gemm_path(fmt, (12, 0), a16=True)
        assert path == "portable" and ("W4A16" if fmt in FP4 else "W8A16") in why
    else:
        with pytest.raises(ValueError, match="W4A16 / W8A16"):
            kernels_triton.gemm_path(fmt, (12, 0), a16=True)


def test_gemm_path_rejects_unknown_format_and_path():
    with pytest.raises(ValueError, match="fmt must be one of"):
        kernels_triton.gemm_path("int4", (12, 0))
    qw = formats.quantize(make_input((8, 64)), "mxfp4").to(DEVICE)
    with pytest.raises(ValueError, match="path must be"):
        kernels_triton.linear(make_input((2, 64)), qw, path="fast")
    with pytest.raises(ValueError, match="no native kernel"):
        kernels_triton.linear(make_input((2, 64)), qw, a16=True, path="native")


@pytest.mark.skipif(not interpreting(), reason=f"interpreter-only check; found {device_name()}")
@pytest.mark.parametrize("fmt", E4M3_SCALED)
def test_native_nvfp4_is_refused_under_the_interpreter(fmt):
    qw = formats.quantize(make_input((8, 64)), fmt)
    with pytest.raises(ValueError, match="decodes e4m3 scales as E8M0"):
        kernels_triton.linear(make_input((2, 64)), qw, path="native")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_default_path_is_the_policy_for_this_device(fmt, monkeypatch):
    """With path=None the kernels take gemm_path's choice for the operand's device."""
    taken = []
    real_route = kernels_triton._common.route_path

    def spy_route(path, f, capability, **kw):  # every lesson decides its path with route_path
        out = real_route(path, f, capability, **kw)
        taken.append(out[0])
        return out

    for name in FORMAT_NAMES:
        monkeypatch.setattr(kernels_triton.module(name), "route_path", spy_route)
    qw = formats.quantize(make_input((16, 128)), fmt).to(DEVICE)
    kernels_triton.linear(make_input((3, 128)), qw)
    expect = kernels_triton.gemm_path(fmt, _paths.device_capability(qw.device))[0]
    assert taken[0] == expect  # gemm's choice (the portable e4m3 launch then asks for its portable tile)
    # tile_config (what the bench reports) follows the same path
    taken.clear()
    kernels_triton.module(fmt).tile_config(3, 16, 128)
    assert taken[0] == expect


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] != 12,
                    reason=f"needs an SM12x GPU (sm_120 / sm_121); found {device_name()}")
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_sm12x_default_is_native_and_matches_oracle(fmt):
    assert kernels_triton.gemm_path(fmt, torch.cuda.get_device_capability())[0] == "native"
    m, n, k = 64, 256, 1024
    qw = formats.quantize(make_input((n, k)), fmt).to(DEVICE)
    xq = formats.quantize(make_input((m, k)), fmt, role="activation").to(DEVICE)
    y = kernels_triton.module(fmt).gemm(xq, qw, out_dtype=FP32).cpu().double()
    ref = formats.reference_linear(xq.to("cpu"), qw.to("cpu"), out_dtype=torch.float64)
    assert bool(((y - ref).abs() <= _bound(xq, qw, None, k)).all())


# ---------------------------------------------------------------------------------------------
# NVFP4 W4A16
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,dtype,has_bias", [
    (1, 40, 64, BF16, True), (3, 24, 96, FP16, False), (130, 40, 256, BF16, False), (0, 8, 32, FP16, True),
])
def test_nvfp4_w4a16_matches_reference(m, n, k, dtype, has_bias):
    from kernels_triton import nvfp4

    x = make_input((m, k), dtype)
    qw = formats.quantize(make_input((n, k)), "nvfp4").to(DEVICE)
    bias = torch.randn(n, device=DEVICE) if has_bias else None
    y = nvfp4.gemm_w4a16(x, qw, bias, out_dtype=FP32)
    assert y.shape == (m, n) and y.dtype == FP32
    if not m:
        return
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), None if bias is None else bias.cpu(), a16=True,
                                   out_dtype=torch.float64)
    # exact products (x is bf16/fp16, the decoded weight e2m1 * e4m3 is exact in bf16; fp16 x is
    # split exactly into two bf16 halves on GPU), fp32 sums, then alpha = 1/g_w (one rounding) and
    # its product (one more): (K + 4) * 2^-24 relative to sum |x| |w|
    mag = x.cpu().double().abs() @ formats.dequantize(qw.to("cpu"), torch.float64).abs().T
    if bias is not None:
        mag = mag + bias.cpu().double().abs()
    assert bool(((y.cpu().double() - ref).abs() <= (k + 4) * U * mag + 1e-30).all())
    # linear(a16=True) is the same kernel, in x's dtype, with leading dims
    y3 = nvfp4.linear(x.reshape(1, m, k), qw, bias, a16=True)
    assert y3.shape == (1, m, n) and y3.dtype == dtype
    assert torch.equal(y3.reshape(m, n), y.to(dtype))
