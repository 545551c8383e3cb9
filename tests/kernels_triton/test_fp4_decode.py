"""The decode-sized FP4 kernel of the performance module (kernels_triton/_fp4_decode.py: swapped
operands, fp16 bit-placement decode for nvfp4, split-K), against the lesson kernel and the oracle.

Both kernels sum exact products (every decoded value and every product is exact in the dot dtype,
see the modules' docstrings) in fp32, so with fp32 output they may differ only by the order of the
fp32 additions: |y_fast - y_lesson| <= 2 * K * 2^-24 * (|x| . |w|^T) (two summations of K terms,
each within K * 2^-24 of the exact sum). On a GPU the policy picks the kernel for M <= 16 on sm_90;
here it is called directly, with a K tail, a partial N tile, a bias and split-K."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import formats
from conftest import DEVICE, make_input
from kernels_triton import _fp4_decode, _fp4_gemm
from kernels_triton._common import TileConfig, interpreting

GROUP = {"nvfp4": 16, "mxfp4": 32}


def _operands(fmt, M, N, K, a16):
    w = formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")
    x = make_input((M, K)).to(torch.bfloat16)
    xq = None if a16 else formats.quantize(x, fmt, role="activation")
    return w, x, xq


def _launch(fn, fmt, w, x, xq, bias, a16, **kw):
    nv = fmt == "nvfp4"
    one = torch.ones(1, dtype=torch.float32, device=DEVICE)
    gx = (one if a16 else xq.global_scale.reshape(1).float()) if nv else None
    gw = w.global_scale.reshape(1).float() if nv else None
    a = x if a16 else xq.data.contiguous()
    sa = None if a16 else xq.scale.contiguous().view(torch.uint8)
    N, K = w.shape
    return fn(a, sa, w.data.contiguous(), w.scale.contiguous().view(torch.uint8), M=x.shape[0], N=N, K=K,
              group=GROUP[fmt], scale_e4m3=nv, bias=bias, out_dtype=torch.float32, gx=gx, gw=gw, a16=a16, **kw)


@pytest.mark.parametrize("fmt,a16", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True), ("mxfp4", True)])
@pytest.mark.parametrize("split", [1, 3])
def test_decode_kernel_matches_lesson(fmt, a16, split):
    M, N, K = 5, 40, 320  # K = 2.5 tiles of 128: a tail; N = 40 of a 64-wide tile
    w, x, xq = _operands(fmt, M, N, K, a16)
    bias = make_input((N,)).to(DEVICE)
    cfg = TileConfig(16, 64, 128, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=split)
    fast = _launch(_fp4_decode.launch_fp4_decode, fmt, w, x, xq, bias, a16, config=cfg)
    slow = _launch(_fp4_gemm.launch_fp4_gemm, fmt, w, x, xq, bias, a16,
                   config=TileConfig(16, 64, 64, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3))
    xd = x.double() if a16 else formats.dequantize(xq, torch.float64)
    wd = formats.dequantize(w, torch.float64)
    ref = xd @ wd.T + bias.double()
    bound = 2 * K * 2.0**-24 * (xd.abs() @ wd.abs().T + bias.double().abs())  # module docstring
    assert torch.isfinite(fast).all()
    assert ((fast.double() - slow.double()).abs() <= bound).all()
    assert ((fast.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("a16", [True, False])
def test_decode_keeps_subnormal_scales(a16):
    """E8M0 scale bytes 0 and 1 (2^-127, 2^-126) make bf16 subnormals of the decoded weights (0.5 *
    2^-127); the bf16 decode must keep them, as the lesson's fp32 decode does. The activation is
    scaled up by 2^100 so that the products, and the output, are normal fp32 numbers."""
    M, N, K = 3, 64, 256
    w, x, _ = _operands("mxfp4", M, N, K, True)
    g = torch.Generator().manual_seed(5)
    scale = torch.randint(0, 4, w.scale.shape, generator=g, dtype=torch.uint8).to(w.scale.device)  # 0..3
    w = dataclasses.replace(w, scale=scale)
    x = x * 2.0**100
    xq = None if a16 else formats.quantize(x, "mxfp4", role="activation")
    cfg = TileConfig(16, 64, 128, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=1)
    fast = _launch(_fp4_decode.launch_fp4_decode, "mxfp4", w, x, xq, None, a16, config=cfg)
    xd = x.double() if a16 else formats.dequantize(xq, torch.float64)
    wd = formats.dequantize(w, torch.float64)
    assert (wd != 0).any() and wd.abs().max() < 2.0**-120  # the subnormal-making scales are in use
    ref = xd @ wd.T
    bound = 2 * K * 2.0**-24 * (xd.abs() @ wd.abs().T)  # module docstring
    assert ((fast.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("fmt,a16", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True), ("mxfp4", True)])
def test_nan_scale_makes_its_row_nan(fmt, a16):
    """A weight block scale holding the NaN code (E8M0 0xFF, e4m3 0x7F) makes that output column NaN
    (the non-finite rule: never a silent finite number); the other columns stay finite."""
    M, N, K = 4, 64, 256
    w, x, xq = _operands(fmt, M, N, K, a16)
    scale = w.scale.clone()
    raw = scale.view(torch.uint8)
    raw[5, 3] = 0xFF if fmt == "mxfp4" else 0x7F
    w = dataclasses.replace(w, scale=scale)
    cfg = TileConfig(16, 64, 128, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=1)
    y = _launch(_fp4_decode.launch_fp4_decode, fmt, w, x, xq, None, a16, config=cfg)
    assert torch.isnan(y[:, 5]).all()
    assert torch.isfinite(torch.cat([y[:, :5], y[:, 6:]], dim=1)).all()


def test_f16_decode_is_exact():
    """The fp16 decode's arithmetic: bit placement gives e2m1 * 2^-14 for all 16 codes, and times
    every finite e4m3 scale the fp16 product is exact (the kernel's claim, checked exhaustively)."""
    codes = torch.arange(16, dtype=torch.uint8)
    e2m1 = formats.codecs.decode_e2m1(codes).double()
    bits = ((codes.int() & 7) << 9) | ((codes.int() & 8) << 12)
    v16 = bits.to(torch.int16).view(torch.float16)
    assert torch.equal(v16.double(), e2m1 * 2.0**-14)
    s = formats.codecs.decode_e4m3(torch.arange(256, dtype=torch.uint8)).double()
    s = s[torch.isfinite(s)]
    prod16 = (v16[:, None] * s.to(torch.float16)[None, :]).double()  # fp16 product, rounded once
    assert torch.equal(prod16, e2m1[:, None] * 2.0**-14 * s[None, :])


def test_policy_domain():
    f = _fp4_decode.decode_applies
    assert f(16, (9, 0), False, torch.bfloat16, True)  # nvfp4 W4A4 on sm_90
    assert f(1, (9, 0), True, torch.bfloat16, False)  # W4A16, bf16 activations
    assert f(16, (9, 0), False, torch.bfloat16, False)  # mxfp4 W4A4 (bf16 planes)
    assert not f(17, (9, 0), False, torch.bfloat16, True)
    assert not f(1, (12, 0), False, torch.bfloat16, True)  # SM12x: native path and its tables
    assert not f(1, (9, 0), True, torch.float16, True)  # fp16 W4A16: the exact hi/lo split
    assert not f(1, None, False, torch.bfloat16, True)  # CPU / interpreter
