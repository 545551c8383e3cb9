"""The decode-sized FP4 kernel of the hopper implementation (kernels_triton/hopper/_fp4_decode.py:
swapped operands, fp16 bit-placement dequantization for nvfp4, bf16 planes for mxfp4 / W4A16, split-K),
against hopper's fused kernel (hopper._fp4_gemm) and the oracle.

Both kernels sum exact products (every decoded value and every product is exact in the dot dtype,
see the modules' docstrings) in fp32, so with fp32 output they may differ only by the order of the
fp32 additions: |y_fast - y_lesson| <= 2 * K * 2^-24 * (|x| . |w|^T) (two summations of K terms,
each within K * 2^-24 of the exact sum). On a GPU the policy picks the kernel for M <= 16 on sm_90;
here it is called directly, with a K tail, a partial N tile, a bias and split-K. The tile policy is
tested with the device described by its SM count.

Modules: kernels_triton/hopper/_fp4_decode.py, kernels_triton/hopper/_fp4_decode_tile.py (sm_90 GPU only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from triton.runtime.errors import InterpreterError

import formats
from _e4m3_testlib import sm90_sm_count
from conftest import DEVICE, make_input
from kernels_triton.hopper import _fp4_decode, _fp4_gemm, _twopass, mxfp4, nvfp4
from kernels_triton import interpreting
from kernels_triton.hopper._route import TileConfig

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


@pytest.mark.parametrize("fmt,a16", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True), ("mxfp4", True)])
@pytest.mark.parametrize("K", [32, 64])
def test_short_k_takes_the_default_tile(fmt, a16, K):
    """K below one 4-block step (mxfp4: 4 * 32 = 128) with the default tile: decode_config's BLOCK_K
    is at least 4 * group (scale_planes), the K tail masked. Bound as above."""
    M, N = 3, 48
    w, x, xq = _operands(fmt, M, N, K, a16)
    assert _fp4_decode.decode_config(M, N, K, w.data.device, fmt, a16).BLOCK_K >= 4 * GROUP[fmt]
    y = _launch(_fp4_decode.launch_fp4_decode, fmt, w, x, xq, None, a16)
    xd = x.double() if a16 else formats.dequantize(xq, torch.float64)
    wd = formats.dequantize(w, torch.float64)
    bound = 2 * K * 2.0**-24 * (xd.abs() @ wd.abs().T)  # module docstring
    assert torch.isfinite(y).all() and (y != 0).any()
    assert ((y.double() - xd @ wd.T).abs() <= bound).all()


@pytest.mark.parametrize("fmt,tile,word", [
    ("mxfp4", TileConfig(16, 64, 64, GROUP_M=1), "BLOCK_K=64"),  # below 4 * 32
    ("nvfp4", TileConfig(16, 64, 32, GROUP_M=1), "BLOCK_K=32"),  # below 4 * 16
    ("nvfp4", TileConfig(16, 64, 96, GROUP_M=1), "BLOCK_K=96"),  # not a power of two
    ("nvfp4", TileConfig(8, 64, 128, GROUP_M=1), "BLOCK_M=8"),  # fewer rows than M = 9
])
def test_bad_tile_is_rejected_on_the_host(fmt, tile, word):
    w, x, xq = _operands(fmt, 9, 64, 256, False)
    with pytest.raises(ValueError, match=word):
        _launch(_fp4_decode.launch_fp4_decode, fmt, w, x, xq, None, False, config=tile)


def test_kernel_asserts_block_k_of_four_blocks():
    """The kernel's own guard (tl.static_assert) for a caller that skips launch_fp4_decode's check:
    mxfp4 with BLOCK_K = 64 fails at trace time, naming BLOCK_K, not inside scale_planes' reshape."""
    M, N, K = 2, 64, 256
    w, _, _ = _operands("mxfp4", M, N, K, False)
    a = torch.zeros((M, K), dtype=torch.float32, device=DEVICE)  # the decoded activation (act_planes_kernel)
    wd, sw = w.data.contiguous(), w.scale.contiguous().view(torch.uint8)
    out = torch.empty((M, N), dtype=torch.float32, device=DEVICE)
    # the interpreter wraps the AssertionError; a GPU compile raises a CompilationError
    with pytest.raises((InterpreterError, triton.CompilationError), match=r"BLOCK_K must be >= 4 \* GROUP"):
        _fp4_decode.fp4_decode_gemm_kernel[(1, 1)](
            a, wd, sw, sw, sw, out, out, out, M, N, K, K,
            a.stride(0), wd.stride(0), sw.stride(0), out.stride(0),
            GROUP=32, SCALE_E4M3=False, HAS_GLOBAL=False, HAS_BIAS=False, F16_DEQUANTIZE=False,
            USE_ASM=False, DOT_DTYPE=triton.language.float32, ROUND_BF16=False, EVEN_K=True,
            BLOCK_N=64, BLOCK_M=16, BLOCK_K=64, SPLIT_K=1)


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


def test_folded_e4m3_scale_is_exact():
    """nvfp4 W4A16's fold (fp4_planes FOLD_E4M3): the bf16 plane value e2m1 * 2^-126 (bits 8..6 and
    15; the code 0.5 is the bf16 subnormal 2^-127) times the scale as bf16 e4m3 * 2^118 is exactly
    e2m1 * e4m3 * 2^-8 for all 16 codes and every finite e4m3 scale (checked exhaustively), so the
    epilogue's 2^8 gives the unfolded product; a NaN scale stays NaN."""
    codes = torch.arange(16, dtype=torch.uint8)
    e2m1 = formats.codecs.decode_e2m1(codes).double()
    bits = ((codes.int() & 7) << 6) | ((codes.int() & 8) << 12)
    raw = bits.to(torch.int16).view(torch.bfloat16)
    assert torch.equal(raw.double(), e2m1 * 2.0**-126)
    s = formats.codecs.decode_e4m3(torch.arange(256, dtype=torch.uint8)).double()
    sv = (s.float() * _fp4_decode.E4M3_FOLD.value).to(torch.bfloat16)  # the kernel's scale, via fp32
    fin = torch.isfinite(s)
    assert torch.equal(sv[fin].double(), s[fin] * 2.0**118) and torch.isnan(sv[~fin]).all()
    prod = (raw[:, None] * sv[None, fin]).double()  # bf16 product, rounded once
    assert torch.equal(prod, e2m1[:, None] * s[None, fin] * 2.0**-8)
    nz = prod[e2m1 != 0][:, s[fin] != 0].abs()
    assert (nz >= 2.0**-18).all() and (nz <= 2688 * 2.0**-8).all()  # bf16 normals: nothing flushed or rounded
    assert _fp4_decode.FOLD_SCALE_BACK.value == 2.0**8


def test_policy_domain():
    f = _fp4_decode.decode_applies
    assert f(16, (9, 0), False, torch.bfloat16)  # W4A4 on sm_90 (nvfp4: fp16 planes, mxfp4: bf16)
    assert f(1, (9, 0), True, torch.bfloat16)  # W4A16, bf16 activations
    assert not f(17, (9, 0), False, torch.bfloat16)
    assert not f(0, (9, 0), False, torch.bfloat16)
    assert not f(1, (12, 0), False, torch.bfloat16)  # SM12x: native path and its tables
    assert not f(1, (9, 0), True, torch.float16)  # fp16 W4A16: the exact hi/lo split
    assert not f(1, None, False, torch.bfloat16)  # CPU / interpreter


@pytest.mark.parametrize("fmt,a16", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True), ("mxfp4", True)])
@pytest.mark.parametrize("n_sms", [132, 114, 78, 16, 1])  # H200/H100 SXM, H100 PCIe, H20, small parts
@pytest.mark.parametrize("M,N,K", [(16, 8192, 8192), (1, 8192, 8192), (5, 1024, 2048), (16, 40, 320),
                                   (4, 28672, 4096), (16, 4096, 14336)])
def test_tile_policy_of_an_sm_count(fmt, a16, n_sms, M, N, K):
    """decode_tile for a device given by its SM count (the value tile_config and the launcher both
    pass): 128 x 16 x BLOCK_K w4 s3, BLOCK_K 256 for nvfp4 W4A4 with K >= 1024 and 128 otherwise,
    SPLIT_K from the largest power of two p that keeps the grid within two programs per SM and each
    program >= 4 K steps (docs/perf_notes.md), as launched: K in ranges of
    cdiv(K steps, p) whole steps, so cdiv(K steps, that) programs, which is what splitk_plan (the
    launcher's rule) gives back for the reported tile."""
    cfg = _fp4_decode.decode_tile(M, N, K, n_sms, fmt, a16)
    bk = 256 if fmt == "nvfp4" and not a16 and K >= 1024 else 128
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages) == (16, 128, bk, 4, 3)
    tiles, k_tiles = -(-N // 128), -(-K // bk)

    def fits(split):
        return split == 1 or (tiles * split <= 2 * n_sms and k_tiles >= 4 * split)

    p = max(q for q in (1, 2, 4, 8, 16, 32, 64) if fits(q))
    per = -(-k_tiles // p)
    assert cfg.SPLIT_K == -(-k_tiles // per), (n_sms, M, N, K, p, cfg.SPLIT_K)
    assert _twopass.splitk_plan(K, cfg) == (cfg.SPLIT_K, per * bk)  # reported = launched


@pytest.mark.parametrize("N,K,n_sms,reported", [
    (4096, 4224, 132, 7),  # 33 steps: power of two 8, ranges of 5 steps, 7 programs
    (4096, 5248, 132, 7),  # 41 steps: 8 -> ranges of 6, 7 programs
    (4096, 4096, 132, 8),  # 32 steps: 8 ranges of 4, as the power of two
    (8192, 4224, 132, 4),  # 64 N tiles: 4 -> ranges of 9 steps, 4 programs
    (4096, 4224, 16, 1),  # 32 N tiles already fill 16 SMs twice
    (1024, 2944, 78, 4),  # 8 N tiles on an H20, 23 steps: 4 (>= 4 steps each) -> ranges of 6, 4 programs
])
def test_reported_split_is_the_launched_split(N, K, n_sms, reported):
    """mxfp4 (BLOCK_K 128) on devices given by their SM count: the reported SPLIT_K is the count the
    launcher's splitk_plan launches for it, where the power of two does not divide the K steps too."""
    cfg = _fp4_decode.decode_tile(16, N, K, n_sms, "mxfp4")
    assert cfg.SPLIT_K == reported
    assert _twopass.splitk_plan(K, cfg)[0] == reported


def test_tile_policy_follows_the_sm_count():
    """N = K = 8192 splits 4 ways on 132 SMs (256 programs) but 2 on an H100 PCIe's 114, for every
    format (nvfp4 W4A4 over BLOCK_K 256, the rest over 128)."""
    for fmt, a16 in (("nvfp4", False), ("mxfp4", False), ("nvfp4", True), ("mxfp4", True)):
        assert _fp4_decode.decode_tile(16, 8192, 8192, 132, fmt, a16).SPLIT_K == 4
        assert _fp4_decode.decode_tile(16, 8192, 8192, 114, fmt, a16).SPLIT_K == 2
    assert _fp4_decode.decode_tile(16, 8192, 8192, 132, "nvfp4").BLOCK_K == 256
    assert _fp4_decode.decode_tile(16, 8192, 8192, 132, "nvfp4", a16=True).BLOCK_K == 128
    with pytest.raises(ValueError, match="fmt must be 'nvfp4' or 'mxfp4'.*'mxfp8'"):
        _fp4_decode.decode_tile(16, 8192, 8192, 132, "mxfp8")


@pytest.mark.gpu
@pytest.mark.parametrize("mod", [nvfp4, mxfp4], ids=["nvfp4", "mxfp4"])
def test_reported_tile_is_the_launched_tile_on_sm90(mod):
    """The route (what the bench reports) and launch_fp4_decode (config=None) both take decode_tile
    with this GPU's SM count."""
    n_sms = sm90_sm_count()
    dev = torch.device(DEVICE)
    for M, N, K in ((1, 8192, 8192), (16, 8192, 8192), (5, 1024, 2048)):
        tile = _fp4_decode.decode_tile(M, N, K, n_sms, mod.FMT)
        assert _fp4_decode.decode_config(M, N, K, dev, mod.FMT) == tile
        assert mod.route(M, N, K, capability=(9, 0), sm_count=n_sms).tile == str(tile)
