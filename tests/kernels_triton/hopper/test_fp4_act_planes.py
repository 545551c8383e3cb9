"""The W4A4 activation quantizers that write the sm_90 FP4 decode GEMM's planes themselves
(nvfp4: hopper._nvfp4_quant.quantize_planes, mxfp4: hopper.mxfp4.quantize_planes, both through
hopper._fp4_decode.store_planes) against the two-launch chain they replace: quantize_activation (bit
for bit the oracle's codes and scales, its own tests) then hopper._fp4_decode.act_planes_kernel.

Every plane value is exact in the plane dtype (e2m1 * scale, _fp4_decode's docstring), so the
planes must be equal bit for bit wherever finite and NaN where the chain's are; the GEMM then reads
the same tensor, so the linear's output is equal bit for bit too (the same kernel on the same
inputs)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

import formats
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input
from kernels_triton import interpreting
from kernels_triton.hopper import _fp4_decode, _nvfp4_quant, mxfp4, nvfp4
from kernels_triton.hopper._route import TileConfig

GROUP = {"nvfp4": 16, "mxfp4": 32}


def _x(fmt, M, K):
    x = make_input((M, 2 * K))[:, ::2]  # K stride 2: the quantizers take any strides
    if M > 2 and (fmt == "mxfp4" or M == 5):
        x[2, 37] = float("nan")  # the non-finite rule: that block (nvfp4 dynamic g: the whole tensor) is NaN
    return x


def _quantize_planes(fmt, x, plane_k, k_pad):
    dt = torch.float32 if interpreting() else (torch.float16 if fmt == "nvfp4" else torch.bfloat16)
    p = torch.full((x.shape[0], k_pad), 7.0, dtype=dt, device=DEVICE)  # not zeros: the padding must be written
    if fmt == "nvfp4":
        g = _nvfp4_quant.quantize_planes(x, p, plane_k)
    else:
        mxfp4.quantize_planes(x, p, plane_k)
        g = None
    return p, g


def _chain_planes(fmt, x, plane_k, k_pad, dtype):
    """quantize_activation then act_planes_kernel, as launch_fp4_decode launches them."""
    xq = (nvfp4 if fmt == "nvfp4" else mxfp4).quantize_activation(x)
    M, K = x.shape
    p = torch.empty((M, k_pad), dtype=dtype, device=DEVICE)
    interp = interpreting()
    dot = tl.float32 if interp else (tl.float16 if fmt == "nvfp4" else tl.bfloat16)
    a, sa = xq.data.contiguous(), xq.scale.contiguous().view(torch.uint8)
    _fp4_decode.act_planes_kernel[(k_pad // plane_k,)](
        a, sa, p, M, K, a.stride(0), 1, sa.stride(0), p.stride(0),
        GROUP=GROUP[fmt], SCALE_E4M3=fmt == "nvfp4", A16=False, F16_DEQUANTIZE=fmt == "nvfp4", USE_ASM=not interp,
        DOT_DTYPE=dot, EVEN_K=K % plane_k == 0, BLOCK_M=16, BLOCK_K=plane_k, num_warps=4)
    return p, xq


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,K,plane_k", [(1, 256, 128), (5, 320, 128), (16, 512, 256), (4, 1024, 128)])
def test_quantizer_planes_equal_the_chain(fmt, M, K, plane_k):
    """K = 320: the last plane tile is 64 columns past K (zeros); plane_k below the quantizer's tile
    (512 / 1024 wide): several plane tiles per quantizer program."""
    x = _x(fmt, M, K)
    k_pad = -(-K // plane_k) * plane_k
    got, g = _quantize_planes(fmt, x, plane_k, k_pad)
    ref, xq = _chain_planes(fmt, x, plane_k, k_pad, got.dtype)
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], ref[~nan])
    if fmt == "nvfp4" and M == 5:  # a NaN g: every element NaN, the padding still zero
        assert int(nan.sum()) == M * K and g.isnan().all() and xq.global_scale.isnan()
        assert int((got == 0).sum()) == M * (k_pad - K)
        return
    assert (ref[~nan] != 0).sum() > (~nan).sum() // 2  # mostly nonzero: a zero or constant scratch fails
    if fmt == "nvfp4":
        assert torch.equal(g.reshape(()), xq.global_scale)
    if M > 2 and fmt == "mxfp4":  # only row 2's block of 32 holds the NaN
        assert int(nan.sum()) == 32 and int(nan[2].sum()) == 32


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,N,K,split", [(1, 72, 256, 1), (5, 40, 320, 3), (16, 72, 512, 2)])
def test_linear_on_quantizer_planes_equals_the_chain(fmt, M, N, K, split):
    x = make_input((M, K))
    w = formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")
    nv = fmt == "nvfp4"
    bk = max(4 * GROUP[fmt], 128)
    cfg = TileConfig(16, 64, bk, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=split)
    k_pad = -(-K // bk) * bk
    planes, g = _quantize_planes(fmt, x, bk, k_pad)
    xq = (nvfp4 if nv else mxfp4).quantize_activation(x)
    bias = make_input((N,), torch.float32, zero_blocks=False, outliers=False)
    gw = w.global_scale.reshape(1).float() if nv else None
    common = dict(M=M, N=N, K=K, group=GROUP[fmt], scale_e4m3=nv, bias=bias, out_dtype=torch.float32,
                  gw=gw, config=cfg)
    wd, ws = w.data.contiguous(), w.scale.contiguous().view(torch.uint8)
    y = _fp4_decode.launch_fp4_decode(None, None, wd, ws, gx=g, planes=planes, plane_k=bk, **common)
    y_chain = _fp4_decode.launch_fp4_decode(xq.data.contiguous(), xq.scale.contiguous().view(torch.uint8), wd, ws,
                                            gx=xq.global_scale.reshape(1).float() if nv else None, **common)
    ref = formats.reference_linear(xq.to("cpu"), w.to("cpu"), bias.cpu(), out_dtype=torch.float32)
    assert ref.abs().max().item() > 0.1  # the GEMM is far from zero
    assert torch.isfinite(y).all() and torch.equal(y, y_chain)
    # the oracle on the same operands (xq equals formats.quantize bit for bit): exact products, fp32
    # sums of K terms and an fp32 output (conftest.gemm_bound)
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, torch.float32, ref), "planes linear vs oracle")


def _plane_dtype(fmt):
    return torch.float32 if interpreting() else (torch.float16 if fmt == "nvfp4" else torch.bfloat16)


def test_planes_of_the_wrong_layout_are_refused():
    M, N, K = 4, 40, 256
    w = formats.quantize(make_input((N, K)) * 0.05, "mxfp4", role="weight")
    cfg = TileConfig(16, 64, 128, GROUP_M=1, num_warps=4, num_stages=1)
    bad = torch.zeros(M, 128, dtype=_plane_dtype("mxfp4"), device=DEVICE)  # K_pad 256
    with pytest.raises(ValueError, match=r"planes must be a K-contiguous 2-D .* \[4, 256\].*got .* \[4, 128\]"):
        _fp4_decode.launch_fp4_decode(None, None, w.data, w.scale, M=M, N=N, K=K, group=32, scale_e4m3=False,
                                      bias=None, out_dtype=torch.float32, config=cfg, planes=bad, plane_k=128)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_planes_of_another_plane_k_are_refused(fmt):
    """K = 1024: planes written at PLANE_K 128 have the K_pad (1024) of a BLOCK_K 256 launch, but each
    128-K tile is in its own dot order, so the 256 launch would sum wrong pairs (max |diff| 21 against
    max |ref| 14 when it was let through): the launcher takes plane_k and refuses the mismatch, and
    planes without their plane_k."""
    M, N, K = 2, 40, 1024
    nv = fmt == "nvfp4"
    w = formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")
    x = make_input((M, K))
    planes, g = _quantize_planes(fmt, x, 128, K)
    common = dict(M=M, N=N, K=K, group=GROUP[fmt], scale_e4m3=nv, bias=None, out_dtype=torch.float32,
                  gx=g, gw=w.global_scale.reshape(1).float() if nv else None, planes=planes,
                  config=TileConfig(16, 64, 256, GROUP_M=1, num_warps=4, num_stages=1))
    wd, ws = w.data.contiguous(), w.scale.contiguous().view(torch.uint8)
    for plane_k in (128, None):
        with pytest.raises(ValueError, match=f"plane_k must be the launched BLOCK_K = 256 .*got {plane_k}"):
            _fp4_decode.launch_fp4_decode(None, None, wd, ws, plane_k=plane_k, **common)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizer_refuses_planes_of_the_wrong_layout(fmt):
    """Every way planes can miss plane_layout's [M, K_pad] K-contiguous tensor (the kernel writes M rows
    up to K_pad by raw offsets: fewer rows aborted the process before this check), and a 3-D x2."""
    M, K, plane_k = 4, 320, 128  # K_pad 384
    mod = _nvfp4_quant if fmt == "nvfp4" else mxfp4
    dt = _plane_dtype(fmt)
    x = make_input((M, K))
    wrong_dtype = torch.bfloat16 if fmt == "nvfp4" else torch.float16  # not exact / not the GEMM's
    cases = [
        (torch.zeros(2, 384, dtype=dt, device=DEVICE), r"\[2, 384\]"),  # rows != M
        (torch.zeros(M, 320, dtype=dt, device=DEVICE), r"\[4, 320\]"),  # K_pad of no plane_k
        (torch.zeros(M, 512, dtype=dt, device=DEVICE), r"\[4, 512\]"),  # another plane_k's K_pad
        (torch.zeros(M, 384, dtype=wrong_dtype, device=DEVICE), str(wrong_dtype).removeprefix("torch.")),
        (torch.zeros(M, 384, dtype=torch.int16, device=DEVICE), "int16"),
        (torch.zeros(384, M, dtype=dt, device=DEVICE).T, r"strides \(1, 4\)"),  # K stride 4
        (torch.zeros(M, 384, dtype=dt, device=DEVICE).as_strided((M, 384), (128, 1)), r"strides \(128, 1\)"),
        (torch.zeros(1, M, 384, dtype=dt, device=DEVICE), r"\[1, 4, 384\]"),  # 3-D
        (torch.zeros(M, 384, dtype=dt, device="meta"), "on meta"),  # another device
        (None, "got NoneType"),
    ]
    for planes, got in cases:
        with pytest.raises(ValueError, match=r"planes must be a K-contiguous 2-D .*\[4, 384\] tensor on .*" + got):
            mod.quantize_planes(x, planes, plane_k)
    with pytest.raises(ValueError, match=r"x2 must be 2-D \[M, K\], got shape \(1, 4, 320\)"):
        mod.quantize_planes(x[None], torch.zeros(M, 384, dtype=dt, device=DEVICE), plane_k)


@pytest.mark.parametrize("mod", [_nvfp4_quant, mxfp4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("plane_k", [32, 96])
def test_bad_plane_k_is_refused(mod, plane_k):
    x = make_input((2, 256))
    with pytest.raises(ValueError, match=f"plane_k must be a power of two .* got {plane_k}"):
        mod.quantize_planes(x, torch.empty(2, 256, device=DEVICE), plane_k)
