"""Decode-sized FP4 GEMM (M <= 16) for GPUs without block-scaled MMA (sm_90): the performance path.

The lessons' portable kernel (kernels_triton.nvfp4 / mxfp4, ``_portable_gemm_kernel``) puts the activation on the MMA's M side, so at
M <= 16 the dequantized weight is the MMA's B operand: on Hopper it makes a round trip through shared
memory before every MMA, and each element costs ~6 instructions to dequantize (fp32 bit placement,
two fmuls, a cvt). Here the product is computed transposed ("swap AB"):

    acc[n, m] = sum_k  W~[n, k] * X~[m, k]          acc [BLOCK_N, BLOCK_M], BLOCK_M = 16 >= M
    y[m, n]   = acc[n, m] * 2^28 * alpha + bias[n]    (2^28 only for the fp16 dequantization below)

so the dequantized weight tile is the MMA's A operand and stays in registers (wgmma takes A from
registers); the activation tile (16 rows) is the small B operand. Split-K spreads the few
N tiles over all SMs; the fp32 partials go through _twopass's ordered reduction (deterministic).

Nibble planes (``fp4_planes``): a packed byte holds elements 2j (low nibble) and
2j + 1 (high nibble). Instead of interleaving the two dequantized nibbles back into K order (a join
that re-packs every MMA register), the K loop keeps them as two planes, the even and the odd
elements, and dots [even plane, odd plane] of the weight with the same of the activation: the
sum over K is the same sum in another order. Both operands' columns are also put in the wgmma
A-fragment order (``fragment_order``), so a lane's bytes of a row are consecutive (16-byte loads)
and each dequantized register is a fragment register as it comes out of the asm.

fp16 dequantization (nvfp4 W4A4, ``F16_DEQUANTIZE``): the 3 magnitude bits of an e2m1 code placed at fp16
bits 11..9 and its sign at bit 15 are exactly value * 2^-14 for every code (the subnormal 0.5 too).
Such an fp16 number has a zero low byte, so four codes become four high bytes with one pass of
byte-parallel integer ops, and one ``prmt`` per register places two of them (``_PLANE_LO/HI_ASM``).
The e4m3 block scales convert with ``cvt.rn.f16x2.e4m3x2`` (exact). Times the scale, as fp16, the
product is still exact: it is a multiple of 2^-24 (fp16's smallest subnormal) with at most 6
significant bits, below 6 * 448 * 2^-14. Both operands carry 2^-14, hence 2^28 in the epilogue;
the fp16 products are exact in the fp32 accumulator, so the function equals the lesson kernel's
up to the order of the fp32 additions.

bf16 dequantization (mxfp4 W4A4, and W4A16 with bf16 activations): E8M0 scales exceed fp16's range. The
magnitude bits at bf16 bits 8..6 and the sign at bit 15 are value * 2^-126 (as for fp32 in
``_codecs.dequantize_e2m1``), and one ``mul.rn.bf16x2`` by 2^126 restores the value (``_BF16_LO/HI_ASM``;
the multiply keeps the subnormal 0.5 * 2^-126); the scale, bf16 by bit placement (``e8m0_bf16``)
or from the e4m3 dequantization, multiplies in bf16, exactly (e2m1 * scale has at most 6 significant bits
and stays in bf16's range whenever the lesson's fp32 product does).

The activation is dequantized once per call (``act_planes_kernel``) into a 16-bit [M, K] tensor in the
K loop's dot order, and the GEMM loads it with a plain pipelined load: then no dot operand is
stored to shared memory inside the loop, which is what Triton's WGMMA pipeliner needs to make the
wgmmas asynchronous (the dot split along K), so the weight dequantization of later slices runs while earlier
slices' MMAs execute (an activation dequantized inside the loop would go through shared memory
each step, and the loop would wait for all its MMAs before the next weight dequantization). The W4A4
decode linears (hopper.nvfp4.linear, hopper.mxfp4.linear) skip that launch: their activation
quantizers, which hold the values, write the same planes themselves (``store_planes``,
``plane_layout``) and pass them as ``planes``.

Under TRITON_INTERPRET=1 the dot runs on fp32 operands (exact: the dequantized values are fp32 numbers)
and the integer dequantization runs as plain Triton ops instead of inline PTX.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._codecs import dequantize_e2m1, dequantize_e4m3, dequantize_e8m0, global_alpha, round_to_bf16_rne
from .._common import interpreting, launch
from ._route import TileConfig
from ._fp4_decode_tile import (DECODE_MAX_M, PLANE_DTYPES, check_planes, check_quantize_planes,  # noqa: F401
                               decode_applies, decode_config, decode_tile, min_block_k, plane_layout)
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import (ALPHA_GLOBAL_RECIP, ALPHA_NONE, launch_splitk_reduce, splitk_plan, splitk_workspace,
                       store_splitk_partial, swapped_tile)
_TORCH_DTYPE = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}
F16_SCALE_BACK = tl.constexpr(268435456.0)  # 2^28: undoes 2^-14 on each operand of the fp16 dequantization


# ---------------------------------------------------------------------------------------------
# e2m1 -> fp16 (value * 2^-14) / bf16, four packed bytes at a time
# ---------------------------------------------------------------------------------------------
# The planes' dequantization (fp4_planes): one byte-parallel pass builds the fp16 high bytes of four codes,
# h = sign << 7 | magnitude << 1 (the low byte of every value is 0), then one prmt per output register
# places two of them: byte selector 0x1404 makes [0, h0, 0, h1], 0x3424 makes [0, h2, 0, h3].
_PLANE_LO_ASM = tl.constexpr("""{
.reg .b32 m, s;
and.b32 m, $2, 0x07070707; and.b32 s, $2, 0x08080808; shl.b32 m, m, 1; shl.b32 s, s, 4; or.b32 m, m, s;
prmt.b32 $0, m, 0, 0x1404; prmt.b32 $1, m, 0, 0x3424;
}""")
_PLANE_HI_ASM = tl.constexpr("""{
.reg .b32 m, s;
shr.b32 m, $2, 3; and.b32 m, m, 0x0E0E0E0E; and.b32 s, $2, 0x80808080; or.b32 m, m, s;
prmt.b32 $0, m, 0, 0x1404; prmt.b32 $1, m, 0, 0x3424;
}""")


# bf16 planes (mxfp4, W4A16): prmt spreads bytes (0, 1) / (2, 3) into the two 16-bit lanes, the
# magnitude goes to bf16 bits 8..6 and the sign to bit 15 (value * 2^-126, the subnormal 0.5 too, as
# for fp32 in _codecs.dequantize_e2m1), and one bf16x2 multiply by 2^126 (0x7E80) restores the value;
# without it (``restore`` False) the planes stay value * 2^-126 (FOLD_E4M3 in fp4_planes).
def _bf16_plane_asm(high: bool, restore: bool) -> str:
    mag, mag_shl, sgn, sgn_shl = ("0x00700070", 2, "0x00800080", 8) if high else ("0x00070007", 6, "0x00080008", 12)
    out = ["a", "a"] if restore else ["$0", "$1"]
    half = [f"prmt.b32 x, $2, 0, {sel};\n"
            f"and.b32 a, x, {mag}; shl.b32 a, a, {mag_shl}; and.b32 s, x, {sgn}; shl.b32 s, s, {sgn_shl}; "
            f"or.b32 {dst}, a, s;\n" + (f"mul.rn.bf16x2 ${i}, a, c;\n" if restore else "")
            for i, (sel, dst) in enumerate(zip(("0x4140", "0x4342"), out))]
    return "{\n.reg .b32 x, a, s, c;\n" + ("mov.b32 c, 0x7E807E80;\n" if restore else "") + "".join(half) + "}"


_BF16_LO_ASM = tl.constexpr(_bf16_plane_asm(False, True))
_BF16_HI_ASM = tl.constexpr(_bf16_plane_asm(True, True))
_BF16_LO_RAW_ASM = tl.constexpr(_bf16_plane_asm(False, False))
_BF16_HI_RAW_ASM = tl.constexpr(_bf16_plane_asm(True, False))
E4M3_FOLD = tl.constexpr(2.0**118)  # 2^118: the share of 2^126 an e4m3 scale (<= 448) carries
FOLD_SCALE_BACK = tl.constexpr(256.0)  # 2^8: the rest, in the epilogue


@triton.jit
def e8m0_bf16(code):
    """E8M0 byte b -> 2^(b - 127) as bf16, exactly, by bit placement: b << 7 is the value for b in
    1..254; b = 0 (2^-127) is the bf16 subnormal 0x0040 and b = 255 the NaN 0x7FC0, both b << 7 plus
    bit 6."""
    c = code.to(tl.uint16)
    return ((c << 7) | (((c == 0) | (c == 255)).to(tl.uint16) << 6)).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_f16_scaled(nibble):
    """4-bit e2m1 code (0..15) -> fp16 value * 2^-14, by bit placement (the plain-op form)."""
    c = nibble.to(tl.uint16)
    return (((c & 0x7) << 9) | ((c & 0x8) << 12)).to(tl.float16, bitcast=True)


@triton.jit
def fp4_planes(data_ptr, scale_ptr, offs_r, r_mask, k0, K, stride_dr, stride_sr,
               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr,
               F16: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, FOLD_E4M3: tl.constexpr = False):
    """The even and odd K elements of rows ``offs_r`` x K [k0, k0 + BLOCK_K) of a packed e2m1 matrix,
    block scales applied: (lo, hi), each [BLOCK_R, BLOCK_K // 2], lo[:, j] = element k0 + 2j (the low
    nibble of byte j), hi[:, j] = element k0 + 2j + 1, both in fragment order (``fragment_order``).
    F16 (e4m3 scales only): fp16, value * 2^-14. Else bf16 with USE_ASM, float32 without; all exact
    (the caller's cast to its dot dtype is exact too). Masked reads give 0. FOLD_E4M3 (bf16 with
    USE_ASM and e4m3 scales): value * 2^-8, the planes' 2^-126 left in and the scale times 2^118
    instead of a multiply by 2^126 per register; the caller multiplies by 2^8 (FOLD_SCALE_BACK).
    Exact: e2m1 * 2^-126 (2^-127 for the subnormal 0.5, a bf16 subnormal the multiply keeps) times
    e4m3 * 2^118 (2^109 .. 448 * 2^118 < 2^127, bf16 normals) has at most 2 + 4 significant bits
    and lies in [2^-18, 2688 * 2^-8]: a bf16 normal, no rounding; a NaN scale stays NaN. The cost:
    until the epilogue every product in the fp32 accumulator is 2^8 smaller, so a product (unfolded
    value) below 2^-118 becomes an fp32 subnormal and loses bits, and one below ~2^-141, which
    unfolded was a representable fp32 subnormal, underflows to 0 (activations near 1e-38).

    Not joining the planes back into K order is the point: a dot over K is the dot over the even
    elements plus the dot over the odd ones, and each asm output register (the low nibbles of two
    neighbouring bytes) is then already a wgmma A-fragment pair, with nothing to re-pack."""
    rows = offs_r.to(tl.int64)
    # k0 is a multiple of BLOCK_K (splitk_plan), which lets the loads be 16 bytes wide
    offs_kb = tl.multiple_of(k0 // 2, BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    if EVEN_K:
        b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_kb[None, :], mask=r_mask[:, None], other=0)
    else:
        b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_kb[None, :],
                    mask=r_mask[:, None] & (offs_kb[None, :] < K // 2), other=0)
    offs_ks = tl.multiple_of(k0 // GROUP, BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)  # wide loads
    if EVEN_K:  # a row mask alone lets the scale bytes of a row load as one vector (and pipeline)
        s = tl.load(scale_ptr + rows[:, None] * stride_sr + offs_ks[None, :], mask=r_mask[:, None], other=0)
    else:
        s = tl.load(scale_ptr + rows[:, None] * stride_sr + offs_ks[None, :],
                    mask=r_mask[:, None] & (offs_ks[None, :] < K // GROUP), other=0)
    if F16 and USE_ASM:
        lo = tl.inline_asm_elementwise(_PLANE_LO_ASM, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_PLANE_HI_ASM, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        sv = s.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # cvt.rn.f16x2.e4m3x2: exact, NaN stays NaN
    elif F16:
        lo = e2m1_f16_scaled(b & 0xF)
        hi = e2m1_f16_scaled(b >> 4)
        sv = dequantize_e4m3(s).to(tl.float16)  # every e4m3 value is an fp16 value
    elif USE_ASM and FOLD_E4M3:
        lo = tl.inline_asm_elementwise(_BF16_LO_RAW_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_BF16_HI_RAW_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        sv = (dequantize_e4m3(s) * E4M3_FOLD).to(tl.bfloat16)  # exact: a power of two, no overflow
    elif USE_ASM:
        lo = tl.inline_asm_elementwise(_BF16_LO_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True,
                                       pack=4)
        hi = tl.inline_asm_elementwise(_BF16_HI_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True,
                                       pack=4)
        sv = dequantize_e4m3(s).to(tl.bfloat16) if SCALE_E4M3 else e8m0_bf16(s)  # exact
    else:
        lo = dequantize_e2m1(b & 0xF)
        hi = dequantize_e2m1(b >> 4)
        sv = dequantize_e4m3(s) if SCALE_E4M3 else dequantize_e8m0(s)
    lo = scale_planes(fragment_order(lo, BLOCK_R, BLOCK_K // 2), sv, BLOCK_R, BLOCK_K // 2, GROUP)
    hi = scale_planes(fragment_order(hi, BLOCK_R, BLOCK_K // 2), sv, BLOCK_R, BLOCK_K // 2, GROUP)
    return lo, hi


@triton.jit
def fragment_order(x, BLOCK_R: tl.constexpr, KP: tl.constexpr):
    """Columns of x [BLOCK_R, KP] reordered, p = (KP / 4) q + 4c + 2h + e -> j = 16c + 8h + 2q + e
    (q < 4, c < KP / 16, h, e < 2). A dot's sum over K does not depend on the order of K, so applying
    the same order to both operands changes nothing but the fp32 summation order. It is the order of
    the wgmma A fragment: lane q of a quad holds columns 16c + 8h + 2q + e, so in byte order it
    holds KP / 4 consecutive bytes of each row (16-byte loads) instead of pairs 8 bytes apart."""
    x = x.reshape(BLOCK_R, 4, KP // 16, 2, 2)
    return tl.permute(x, (0, 2, 3, 1, 4)).reshape(BLOCK_R, KP)


@triton.jit
def scale_planes(v, sv, BLOCK_R: tl.constexpr, KP: tl.constexpr, GROUP: tl.constexpr):
    """v [BLOCK_R, KP] (a plane in fragment order) times its block scales sv [BLOCK_R, 2 KP / GROUP]
    (K order). Byte p = (KP / 4) q + 4c + .. is in group p // (GROUP / 2) = q NG + c // (GROUP / 8),
    NG = KP / (2 GROUP) groups per lane slot q; the broadcast is written in the fragment order itself,
    so that the dequantized registers keep their layout (scaling in byte order makes Triton move
    the mxfp4 planes through shared memory)."""
    NG: tl.constexpr = KP // (2 * GROUP)
    sq = tl.permute(sv.reshape(BLOCK_R, 4, NG), (0, 2, 1))  # [BLOCK_R, NG, 4 (q)]
    v = v.reshape(BLOCK_R, NG, GROUP // 8, 2, 4, 2) * sq[:, :, None, None, :, None]
    return v.reshape(BLOCK_R, KP)


@triton.jit
def planes_k(lo, hi, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R, BLOCK_K]: lo's columns, then hi's."""
    return tl.permute(tl.join(lo, hi), (0, 2, 1)).reshape(BLOCK_R, BLOCK_K)


@triton.jit
def a16_planes(a_ptr, offs_m, m_mask, k0, K, stride_am, stride_ak, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The even and odd K columns of the 16-bit activation rows ``offs_m`` x K [k0, k0 + BLOCK_K), in
    fragment order to match the weight planes (fp4_planes); masked reads give 0."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak,
                mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    lo, hi = a.reshape(BLOCK_M, BLOCK_K // 2, 2).split()
    return fragment_order(lo, BLOCK_M, BLOCK_K // 2), fragment_order(hi, BLOCK_M, BLOCK_K // 2)


@triton.jit
def store_planes(p_ptr, v, offs_m, m_mask, k0, K, K_PAD, stride_pm,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PLANE_K: tl.constexpr):
    """Store v [BLOCK_M, BLOCK_K] (the dequantized activation of K [k0, k0 + BLOCK_K) in K order, fp32
    values exact in p's dtype; k0 and BLOCK_K multiples of PLANE_K) into p [M, K_PAD] as
    act_planes_kernel writes it: each PLANE_K tile [even plane, odd plane], both in fragment order,
    zeros past K (whatever v holds there: a NaN global scale must not reach the padding). An
    activation quantizer that holds the values calls it instead of storing codes (the decode
    linear's quantizer; a launch less)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    v = tl.where((offs_k < K)[None, :], v, 0.0)
    R: tl.constexpr = BLOCK_M * (BLOCK_K // PLANE_K)  # row-major: each PLANE_K tile of a row is a row here
    lo, hi = v.reshape(R, PLANE_K // 2, 2).split()
    lo = fragment_order(lo, R, PLANE_K // 2).to(p_ptr.dtype.element_ty)
    hi = fragment_order(hi, R, PLANE_K // 2).to(p_ptr.dtype.element_ty)
    p = planes_k(lo, hi, R, PLANE_K).reshape(BLOCK_M, BLOCK_K)
    tl.store(p_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + offs_k[None, :], p,
             mask=m_mask[:, None] & (offs_k < K_PAD)[None, :])


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def act_planes_kernel(
    a_ptr, a_scale_ptr, p_ptr, M, K, stride_am, stride_ak, stride_asm, stride_pm,
    GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr, A16: tl.constexpr, F16_DEQUANTIZE: tl.constexpr,
    USE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,  # _pdl
):
    """p [M, K_pad] (DOT_DTYPE, K_pad a multiple of BLOCK_K): the activation dequantized, each BLOCK_K
    tile in the order the GEMM's K loop dots it, [even plane, odd plane] in fragment order (zeros
    past K). One program per K tile, all rows."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    pdl_wait(USE_PDL)  # the quantized activation
    if A16:
        lo, hi = a16_planes(a_ptr, offs_m, m_mask, k0, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
    else:
        lo, hi = fp4_planes(a_ptr, a_scale_ptr, offs_m, m_mask, k0, K, stride_am, stride_asm,
                            BLOCK_M, BLOCK_K, GROUP, SCALE_E4M3, F16_DEQUANTIZE, USE_ASM, EVEN_K)
    pdl_launch_dependents(USE_PDL)
    p = planes_k(lo.to(DOT_DTYPE), hi.to(DOT_DTYPE), BLOCK_M, BLOCK_K)
    tl.store(p_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + (k0 + tl.arange(0, BLOCK_K))[None, :], p,
             mask=m_mask[:, None])


@triton.jit
def fp4_decode_gemm_kernel(
    a_ptr, w_ptr, w_scale_ptr, gx_ptr, gw_ptr, bias_ptr, c_ptr, ws_ptr,
    M, N, K, K_PER,
    stride_am, stride_wn, stride_wsn, stride_cm,
    GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, F16_DEQUANTIZE: tl.constexpr, USE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ROUND_BF16: tl.constexpr, EVEN_K: tl.constexpr,  # EVEN_K: K % BLOCK_K == 0, no K masks
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl
    FOLD_E4M3: tl.constexpr = False,  # fp4_planes: the weight's 2^126 restore folded into its scale
):
    """acc [BLOCK_N, BLOCK_M] over this program's K range, then the transposed store (module
    docstring). a_ptr: the activation as act_planes_kernel wrote it (DOT_DTYPE, K padded)."""
    # scale_planes: each of a lane quad's 4 slots of a plane (BLOCK_K / 8 bytes) holds whole blocks
    tl.static_assert(BLOCK_K >= 4 * GROUP, "BLOCK_K must be >= 4 * GROUP (min_block_k)")
    offs_n, offs_m, n_mask, m_mask, k_lo, k_hi = swapped_tile(N, M, K, K_PER, BLOCK_N, BLOCK_M)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl_wait(USE_PDL)  # the dequantized activation
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_lo, w_hi = fp4_planes(w_ptr, w_scale_ptr, offs_n, n_mask, k0, K, stride_wn, stride_wsn,
                                BLOCK_N, BLOCK_K, GROUP, SCALE_E4M3, F16_DEQUANTIZE, USE_ASM, EVEN_K, FOLD_E4M3)
        # one dot over both planes (K order: the even elements, then the odd ones): the join
        # only moves whole registers
        w = planes_k(w_lo.to(DOT_DTYPE), w_hi.to(DOT_DTYPE), BLOCK_N, BLOCK_K)
        # the activation tile arrives dequantized, by a load the pipeliner copies into its shared-memory
        # ring: with no dot operand stored to shared memory inside the loop, the wgmmas are async
        # (the pipeliner splits the dot along K; Triton 3.6: per 16 K) and the weight dequantization of
        # later slices runs while earlier slices' MMAs execute
        a = tl.load(a_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(a), acc)

    pdl_launch_dependents(USE_PDL)
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if F16_DEQUANTIZE:
        out = out * F16_SCALE_BACK
    if FOLD_E4M3:
        out = out * FOLD_SCALE_BACK
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        store_splitk_partial(ws_ptr, out, tl.program_id(1), offs_m, offs_n, M, N, mask)
        return
    if HAS_GLOBAL:
        out = out * global_alpha(tl.load(gx_ptr), tl.load(gw_ptr))  # NaN for a bad global scale
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        out = round_to_bf16_rne(out)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             out.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# The launcher (its policy: _fp4_decode_tile)
# ---------------------------------------------------------------------------------------------
def launch_fp4_decode(a, a_scale, w, w_scale, *, M, N, K, group, scale_e4m3, bias, out_dtype,
                      gx=None, gw=None, a16=False, config: TileConfig | None = None,
                      use_asm: bool | None = None, fold_scale: bool | None = None,
                      planes: torch.Tensor | None = None, plane_k: int | None = None) -> torch.Tensor:
    """y [M, N] = dequant(a) . dequant(w)^T (* alpha) (+ bias) for M <= 16, as
    the lessons' portable GEMM computes it (up to the order of the fp32 additions). Launches
    act_planes_kernel (the activation dequantized into an [M, K rounded up to BLOCK_K] scratch of the
    dot dtype: fp16 for nvfp4 W4A4, bf16 otherwise, fp32 under the interpreter), the GEMM, and
    with split-K the ordered reduction, all with PDL where it applies (_pdl).

    Args:
        a: W4A4: packed e2m1 uint8 [M, K/2] (element 2j in the low nibble of byte j; row stride
            free, K stride 1), with a_scale: block-scale bytes uint8 [M, K/group] (e4m3 for
            nvfp4, E8M0 for mxfp4; row stride free). a16: the bf16 activation [M, K] (any
            strides; fp16 takes hopper._fp4_gemm's exact hi/lo kernel, decode_applies), a_scale ignored.
        w, w_scale: the weight, packed uint8 [N, K/2] and its block-scale bytes uint8 [N, K/group],
            K stride 1 in both.
        M, N, K: the problem (M <= 16; K a multiple of group). group: 16 (nvfp4) or 32 (mxfp4).
        scale_e4m3: True for e4m3 block scales (nvfp4), False for E8M0 (mxfp4).
        bias: None or a float tensor [N] (contiguous), read as fp32 and added after alpha.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
        gx, gw: nvfp4's global scales, float32 one-element device tensors (alpha = 1 / (gx gw),
            NaN for a bad one), or None (no alpha).
        config: the tile; None: decode_config's for w's device and the format (nvfp4 when
            scale_e4m3, else mxfp4; W4A16 with a16). BLOCK_M >= M, BLOCK_K a power of
            two >= 4 * group (min_block_k).
        use_asm: the inline-PTX dequantization (True; a GPU only) or plain Triton ops (False); None: PTX on
            a GPU, plain ops under the interpreter.
        fold_scale: nvfp4 W4A16 with the PTX dequantization only: the bf16 planes' 2^126 restore folded into
            the e4m3 scale (2^118) and the epilogue (2^8), one multiply per register less
            (fp4_planes, FOLD_E4M3: products below ~2^-141, activations near 1e-38, underflow
            to 0 in the accumulator, where unfolded they were fp32 subnormals); None: on where it
            applies. Ignored elsewhere.
        planes: None, or the activation already dequantized by its quantizer (W4A4: ``plane_layout``'s
            [M, K_pad] of its dtype, written by store_planes for the same config): act_planes_kernel
            is skipped and a, a_scale are ignored.
        plane_k: with planes, the PLANE_K they were written at; it must be the launched BLOCK_K
            (each BLOCK_K tile of the planes is in that tile's dot order).
    Returns:
        [M, N] tensor of out_dtype on w's device.
    Raises:
        ValueError: M > 16, config.BLOCK_M < M, config.BLOCK_K not a power of two >= 4 * group, or
            with planes: plane_k not the launched BLOCK_K, planes not plane_layout's tensor
            (check_planes: shape, dtype, K stride 1, w's device).
    Follows the NVFP4 recipe / OCP MX 1.0 block scaling as the oracle (formats/) does.
    """
    if M > DECODE_MAX_M:
        raise ValueError(f"M must be <= {DECODE_MAX_M} for the decode kernel, got {M}")
    out = torch.empty((M, N), dtype=out_dtype, device=w.device)
    if M == 0 or N == 0:
        return out
    interp = interpreting()
    cfg = config or decode_config(M, N, K, w.device, "nvfp4" if scale_e4m3 else "mxfp4", a16)  # as tile_config
    if cfg.BLOCK_M < M:
        raise ValueError(f"BLOCK_M must be >= M = {M} (one program holds every row), got BLOCK_M={cfg.BLOCK_M}")
    bk = cfg.BLOCK_K
    if bk < min_block_k(group) or bk & (bk - 1):
        raise ValueError(f"BLOCK_K must be a power of two >= 4 * group = {min_block_k(group)} for the decode "
                         f"kernel's planes, got BLOCK_K={bk}")
    f16 = bool(scale_e4m3 and not a16)  # nvfp4 W4A4: both operands fit fp16 exactly
    dot = tl.float32 if interp else (tl.float16 if f16 else tl.bfloat16)
    asm = (not interp) if use_asm is None else use_asm
    fold = asm and scale_e4m3 and a16 and (fold_scale is None or fold_scale)
    even_k = K % bk == 0
    k_tiles = triton.cdiv(K, bk)
    if planes is None:
        if a16:
            stride_am, stride_ak, stride_asm, a_scale = a.stride(0), a.stride(1), 0, w_scale
        else:
            stride_am, stride_ak, stride_asm = a.stride(0), 1, a_scale.stride(0)
        planes = torch.empty((M, k_tiles * bk), dtype=_TORCH_DTYPE[dot], device=w.device)
        launch(
            act_planes_kernel, (k_tiles,),
            a, a_scale, planes, M, K, stride_am, stride_ak, stride_asm, planes.stride(0),
            GROUP=group, SCALE_E4M3=scale_e4m3, A16=a16, F16_DEQUANTIZE=f16, USE_ASM=asm, DOT_DTYPE=dot, EVEN_K=even_k,
            BLOCK_M=cfg.BLOCK_M, BLOCK_K=bk, num_warps=4, num_stages=1, **pdl_launch(w.device),
        )
    else:  # planes written at another PLANE_K would be dotted in the wrong K order
        if plane_k != bk:
            raise ValueError(f"plane_k must be the launched BLOCK_K = {bk} for the given planes, got {plane_k}")
        check_planes(planes, M, K, bk, (_TORCH_DTYPE[dot],), w.device)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, w.device) if n_split > 1 else out
    has_global = gx is not None
    grid = (triton.cdiv(N, cfg.BLOCK_N), n_split)
    launch(
        fp4_decode_gemm_kernel, grid,
        planes, w, w_scale, gx if has_global else w_scale, gw if has_global else w_scale,
        bias if bias is not None else out, out, ws,
        M, N, K, k_per,
        planes.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        GROUP=group, SCALE_E4M3=scale_e4m3, HAS_GLOBAL=has_global, HAS_BIAS=bias is not None,
        F16_DEQUANTIZE=f16, USE_ASM=asm, DOT_DTYPE=dot,
        ROUND_BF16=interp and out_dtype == torch.bfloat16, EVEN_K=even_k,
        BLOCK_N=cfg.BLOCK_N, BLOCK_M=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, SPLIT_K=n_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, FOLD_E4M3=fold, **pdl_launch(w.device),
    )
    if n_split > 1:
        launch_splitk_reduce(ws, out, bias=bias, alpha_mode=ALPHA_GLOBAL_RECIP if has_global else ALPHA_NONE,
                             s1=gx, s2=gw)
    return out
