"""The mxfp8 decode kernel on bf16 register operands (kernels_triton/hopper/_e4m3_decode.py): the e4m3 ->
bf16 bit placement for all 256 codes against the formats/ e4m3 decode, and the kernel against the
oracle at M = 1, 5, 16 with split-K, a bias, NaN codes, NaN and 0x00 scale bytes and the widest
exact scale range.

Bounds: every decoded operand is exact (code * 2^e, e in [-124, 119]: the module docstring), so
are the bf16 products in the fp32 accumulator; the kernel differs from the oracle only by the fp32
summation and the output rounding, conftest.gemm_bound's fp32 form (fp8_interval 0). Under the
interpreter the same kernel runs on fp32 operands (the placement as plain integer ops); on a GPU
with the inline PTX, which test_asm_decode_all_codes checks code by code."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import formats
from conftest import DEVICE, assert_within_bound, device_name, gemm_bound, make_input
from kernels_triton.hopper import _e4m3_decode as dec
from kernels_triton import interpreting
from kernels_triton.hopper._route import TileConfig

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _e4m3_values() -> torch.Tensor:
    """formats' decode of every code, float64 [256] (NaN for 0x7F / 0xFF)."""
    return CODES.view(torch.float8_e4m3fn).to(torch.float64)


@triton.jit
def _place_kernel(c_ptr, out_ptr, USE_ASM: tl.constexpr):
    offs = tl.arange(0, 256)
    c = tl.load(c_ptr + offs)
    if USE_ASM:  # the kernel's PTX: value, 2^120 already applied
        v = tl.inline_asm_elementwise(dec._E4M3_BF16_ASM, "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        tl.store(out_ptr + offs, v.to(tl.uint16, bitcast=True))
    else:  # the plain-op placement: value * 2^-120
        tl.store(out_ptr + offs, dec.e4m3_bf16_bits(c))


def _bits_as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float64)


def test_placement_is_value_times_2_pow_minus_120_for_all_codes():
    """The claim of the module docstring, exhaustively: sign at bit 15 and the 7 magnitude bits at
    bf16 bits 10..4 are exactly value * 2^-120 for every finite code (subnormals and +-0 included),
    bit for bit; the NaN codes give a NaN pattern."""
    out = torch.empty(256, dtype=torch.int16, device=DEVICE)
    _place_kernel[(1,)](CODES.to(DEVICE), out.view(torch.int16), USE_ASM=False, num_warps=1)
    bits = out.cpu().view(torch.int16).to(torch.int32) & 0xFFFF
    ref = _e4m3_values()
    finite = ~ref.isnan()
    want = (ref[finite] * 2.0**-120).to(torch.bfloat16)  # exact: 4 significant bits, >= 2^-129
    assert torch.equal(bits[finite].to(torch.int16), want.view(torch.int16).to(torch.int32).to(torch.int16))
    assert torch.equal(_bits_as_float(bits[finite]) * 2.0**120, ref[finite])
    assert _bits_as_float(bits[~finite]).isnan().all() and int(finite.sum()) == 254
    # the signed zeros stay signed zeros (their sign bit, nothing else)
    assert int(bits[0x00]) == 0x0000 and int(bits[0x80]) == 0x8000


def test_asm_decode_all_codes():
    """The inline PTX (prmt, shift, mask, NaN select, mul.rn.bf16x2 by 2^120) on all 256 codes
    equals formats' e4m3 decode bit for bit as bf16; NaN codes give NaN."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"the PTX needs a GPU with mul.rn.bf16x2 (sm_90+); found {device_name()}")
    out = torch.empty(256, dtype=torch.int16, device=DEVICE)
    _place_kernel[(1,)](CODES.to(DEVICE), out, USE_ASM=True, num_warps=1)
    got = out.cpu().view(torch.bfloat16).to(torch.float64)
    ref = _e4m3_values()
    finite = ~ref.isnan()
    assert torch.equal(out.cpu()[finite], ref[finite].to(torch.bfloat16).view(torch.int16))
    assert got[~finite].isnan().all()


def _tile(bn: int, split: int, bk: int = 128, warps: int = 4) -> TileConfig:
    return TileConfig(16, bn, bk, GROUP_M=1, num_warps=warps, num_stages=1 if interpreting() else 3, SPLIT_K=split)


def _operands(M, N, K, zero_blocks=True):
    w = formats.quantize(make_input((N, K), zero_blocks=zero_blocks) * 0.05, "mxfp8", role="weight")
    xq = formats.quantize(make_input((M, K), zero_blocks=zero_blocks), "mxfp8", role="activation")
    return xq, w


def _launch(xq, w, bias, cfg, out_dtype=torch.float32, **kw):
    y = torch.empty(xq.rows, w.rows, dtype=out_dtype, device=w.data.device)
    return dec.launch_e4m3_decode(xq.data.contiguous(), xq.scale.contiguous(), w.data.contiguous(),
                                  w.scale.contiguous(), bias, y, config=cfg, **kw)


# (M, N, K, BLOCK_N, split, warps, out_dtype): K = 320 is 2.5 steps of 128 (the K mask), N = 40 / 72
# / 200 leave a partial weight tile; splits of one step per program (K = 256 in 2) and uneven ranges
# (320 in 3); 8 warps (two warpgroups of 64 weight rows each on a GPU)
CASES = [
    (1, 72, 256, 64, 1, 4, torch.float32),
    (1, 40, 320, 64, 3, 4, torch.bfloat16),
    (5, 40, 320, 64, 1, 4, torch.float32),
    (5, 72, 256, 128, 2, 4, torch.float16),
    (16, 72, 512, 64, 2, 4, torch.float32),
    (16, 40, 320, 128, 3, 4, torch.bfloat16),
    (16, 200, 512, 128, 2, 8, torch.float32),
    (1, 200, 384, 128, 1, 8, torch.bfloat16),
]


@pytest.mark.parametrize("M,N,K,bn,split,warps,out_dtype", CASES)
def test_kernel_matches_oracle(M, N, K, bn, split, warps, out_dtype):
    xq, w = _operands(M, N, K)
    bias = make_input((N,), torch.float32, zero_blocks=False, outliers=False)
    y = _launch(xq, w, bias, _tile(bn, split, warps=warps), out_dtype)
    ref = formats.reference_linear(xq, w, bias, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    # the GEMM itself must be far from zero, or a kernel adding the bias alone passes
    assert formats.reference_linear(xq, w, out_dtype=torch.float32).abs().max().item() > 0.1
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, out_dtype, ref), "bf16 decode")


def test_register_cap():
    """maxnreg (the probe's knob; ptxas may spill under it) leaves the result within the bound."""
    M, N, K = 16, 136, 512
    xq, w = _operands(M, N, K)
    y = _launch(xq, w, None, _tile(128, 2), maxnreg=128)
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32)
    assert_within_bound(y, ref, gemm_bound(xq, w, None, torch.float32, ref), "bf16 decode")


def test_default_tile_and_k_below_one_step():
    """decode_config's tile (the interpreter's wide one here, the SM-count policy on a GPU) with K = 96,
    below one 128-wide step: the K mask covers it."""
    M, N, K = 3, 48, 96
    xq, w = _operands(M, N, K)
    y = _launch(xq, w, None, None)
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32)
    assert (ref != 0).any()
    assert_within_bound(y, ref, gemm_bound(xq, w, None, torch.float32, ref), "bf16 decode")


def test_widest_exact_scale_range():
    """Scale bytes 3 and 246 (2^-124 and 2^119, the ends of the exact range) and everything between:
    per block k an exponent E_k, the weight's ew = E_k + d and the activation's ex = -E_k + d'
    (|d|, |d'| <= 4, clamped to the range), so every product is an fp32 number far from overflow and
    underflow. A decode that rounds or overflows at either end misses the bound."""
    M, N, K = 4, 64, 512
    g = torch.Generator().manual_seed(11)
    xq, w = _operands(M, N, K, zero_blocks=False)
    nb = K // 32
    big = torch.randint(-119, 120, (nb,), generator=g)
    big[:4] = torch.tensor([-120, 115, 120, -115])  # with d = -4 / +4 below: the range's ends
    ew = (big[None, :] + torch.randint(-4, 5, (N, nb), generator=g)).clamp(-124, 119)
    ex = (-big[None, :] + torch.randint(-4, 5, (M, nb), generator=g)).clamp(-124, 119)
    ew[0, 0], ew[1, 1], ex[0, 2], ex[1, 3] = -124, 119, -124, 119
    w = dataclasses.replace(w, scale=(ew + 127).to(torch.uint8).to(w.scale.device))
    xq = dataclasses.replace(xq, scale=(ex + 127).to(torch.uint8).to(xq.scale.device))
    y = _launch(xq, w, None, _tile(64, 2))
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32)
    assert torch.isfinite(ref).all() and (ref != 0).any()
    assert_within_bound(y, ref, gemm_bound(xq, w, None, torch.float32, ref), "bf16 decode")


def test_nan_codes_and_nan_scales():
    """The non-finite rule: weight codes 0x7F (row 3) and 0xFF (row 9) and the weight scale byte 0xFF
    (row 20) make those columns NaN for every m; the activation code 0x7F (row 1) and scale byte 0xFF
    (row 4) make those rows NaN; everything else matches the oracle within the bound."""
    M, N, K = 6, 40, 256
    xq, w = _operands(M, N, K)
    xd, wd, sx, sw = xq.data.clone(), w.data.clone(), xq.scale.clone(), w.scale.clone()
    wd.view(torch.uint8)[3, 17], wd.view(torch.uint8)[9, 200], sw[20, 5] = 0x7F, 0xFF, 0xFF
    xd.view(torch.uint8)[1, 130], sx[4, 2] = 0x7F, 0xFF
    xq, w = dataclasses.replace(xq, data=xd, scale=sx), dataclasses.replace(w, data=wd, scale=sw)
    y = _launch(xq, w, None, _tile(64, 2)).cpu()
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32).cpu()
    nan = torch.zeros(M, N, dtype=torch.bool)
    nan[[1, 4]], nan[:, [3, 9, 20]] = True, True
    assert torch.equal(ref.isnan(), nan) and torch.equal(y.isnan(), nan)
    rows, cols = [0, 2, 3, 5], [j for j in range(N) if j not in (3, 9, 20)]
    keep = lambda t: t[rows][:, cols]  # noqa: E731
    assert_within_bound(keep(y), keep(ref), keep(gemm_bound(xq, w, None, torch.float32, ref)), "bf16 decode")


@pytest.mark.parametrize("side", ["activation", "weight"])
def test_zero_scale_byte_is_2_pow_minus_127(side):
    """E8M0 0x00 is 2^-127, not 0 and not 2^-126: one row of one operand gets 0x00 in every block,
    against a partner operand at 2^103 (byte 230) so that its products are normal fp32 numbers; the
    other rows of that operand sit at 2^-103 (byte 24). The 0x00 row's codes have magnitudes in
    [0.5, 1) (exponent field 6), so code * 2^-127 is a multiple of 2^-131: exact in bf16 (subnormal
    grid 2^-133). Decoding 0x00 as 0 leaves that row (column) zero, as 2^-126 doubles it: either
    misses the bound."""
    M, N, K = 3, 40, 256
    xq, w = _operands(M, N, K, zero_blocks=False)
    q, row, other = (xq, 0, w) if side == "activation" else (w, 5, xq)
    data, scale = q.data.clone(), torch.full_like(q.scale, 24)
    data.view(torch.uint8)[row] = (data.view(torch.uint8)[row] & 0x87) | 0x30  # sign and mantissa kept
    scale[row] = 0
    q = dataclasses.replace(q, data=data, scale=scale)
    other = dataclasses.replace(other, scale=torch.full_like(other.scale, 230))
    xq, w = (q, other) if side == "activation" else (other, q)
    y = _launch(xq, w, None, _tile(64, 1))
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32)
    hit = ref[row] if side == "activation" else ref[:, row]
    assert hit.abs().min().item() > 2.0**-40  # far above the fp32 accumulation bound of these sums
    assert_within_bound(y, ref, gemm_bound(xq, w, None, torch.float32, ref), "bf16 decode")


@pytest.mark.parametrize("M,K,tile,word", [
    (17, 128, None, "M must be <= 16"),
    (4, 48, None, "positive multiple of 32"),
    (4, 256, TileConfig(16, 64, 64, GROUP_M=1), "BLOCK_K=64"),  # below 4 scale blocks
    (4, 256, TileConfig(16, 64, 192, GROUP_M=1), "BLOCK_K=192"),  # not a power of two
    (9, 256, TileConfig(8, 64, 128, GROUP_M=1), "BLOCK_M=8"),  # fewer rows than M
])
def test_bad_calls_are_refused_on_the_host(M, K, tile, word):
    n = 8
    x = torch.zeros(M, K, dtype=torch.uint8, device=DEVICE)
    sx = torch.zeros(M, max(1, K // 32), dtype=torch.uint8, device=DEVICE)
    w = torch.zeros(n, K, dtype=torch.uint8, device=DEVICE)
    sw = torch.zeros(n, max(1, K // 32), dtype=torch.uint8, device=DEVICE)
    y = torch.empty(M, n, device=DEVICE)
    with pytest.raises(ValueError, match=word):
        dec.launch_e4m3_decode(x, sx, w, sw, None, y, config=tile)


@pytest.mark.parametrize("n_sms,N,K,split", [(132, 8192, 8192, 4), (132, 8192, 1024, 2), (132, 28672, 4096, 1),
                                             (132, 4096, 8192, 8), (48, 8192, 8192, 1), (132, 40, 320, 1)])
def test_decode_tile_policy(n_sms, N, K, split):
    """The GPU tile for a device described by its SM count: 128 x 16 x 128 s3, split-K while the grid
    stays within 2 programs per SM and every split keeps >= 4 K steps."""
    cfg = dec.decode_tile(16, N, K, n_sms)
    assert (cfg.BLOCK_N, cfg.BLOCK_M, cfg.BLOCK_K, cfg.num_stages, cfg.SPLIT_K) == (128, 16, 128, 3, split)
    programs = triton.cdiv(N, 128) * split
    assert (split == 1 or programs <= 2 * n_sms) and (split == 1 or triton.cdiv(K, 128) >= 4 * split)


@pytest.mark.parametrize("bad,word", [
    ("x_k_stride", "x must be e4m3 codes"), ("w_short_k", "w has K="), ("sx_shape", "sx must be"),
    ("sw_dtype", "sw must be"), ("y_shape", "y must be"), ("bias_dtype", "bias must be"),
])
def test_bad_operands_are_refused_on_the_host(bad, word):
    """Operands that break launch_e4m3_decode's Args raise a ValueError naming the argument (a K
    stride of 4 once read four times the codes; a shorter weight K read past the activation)."""
    M, N, K = 4, 8, 256
    x = torch.zeros(M, K, dtype=torch.uint8, device=DEVICE)
    sx = torch.full((M, K // 32), 127, dtype=torch.uint8, device=DEVICE)
    w = torch.zeros(N, K, dtype=torch.uint8, device=DEVICE)
    sw = torch.full((N, K // 32), 127, dtype=torch.uint8, device=DEVICE)
    y = torch.empty(M, N, device=DEVICE)
    bias = None
    if bad == "x_k_stride":
        x = torch.zeros(M, 4 * K, dtype=torch.uint8, device=DEVICE)[:, ::4]
    elif bad == "w_short_k":
        w = torch.zeros(N, K // 2, dtype=torch.uint8, device=DEVICE)
    elif bad == "sx_shape":
        sx = sx[:, :-1]
    elif bad == "sw_dtype":
        sw = sw.float()
    elif bad == "y_shape":
        y = torch.empty(M, N + 1, device=DEVICE)
    elif bad == "bias_dtype":
        bias = torch.zeros(N, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=word):
        dec.launch_e4m3_decode(x, sx, w, sw, bias, y)


def test_decoded_linear_refuses_a_non_16_bit_activation():
    w = torch.zeros(8, 256, dtype=torch.uint8, device=DEVICE)
    sw = torch.full((8, 8), 127, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        dec.launch_e4m3_decode_linear(torch.zeros(2, 256, device=DEVICE), w, sw, None, torch.empty(2, 8, device=DEVICE))


def test_reported_split_is_the_launched_split():
    """decode_tile reports the split splitk_plan launches: at N = 1024, K = 130 x 128 the rule asks for
    split 32, and 130 K steps in chunks of 5 run as 26 programs (the bench prints the reported tile)."""
    from kernels_triton.hopper._twopass import splitk_plan

    for N, K in ((1024, 130 * 128), (4096, 4224), (4096, 5248), (8192, 8192)):
        cfg = dec.decode_tile(16, N, K, 132)
        assert cfg.SPLIT_K == splitk_plan(K, cfg)[0]
    assert dec.decode_tile(16, 1024, 130 * 128, 132).SPLIT_K == 26
