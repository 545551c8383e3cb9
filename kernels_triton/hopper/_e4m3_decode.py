"""Decode-sized MXFP8 GEMM (M <= 16) on bf16 register operands, for sm_90 (no block-scaled MMA).

The other sm_90 mxfp8 decode kernel (``_fp8_decode``, SCALE_K = 32) dots the e4m3 codes directly,
one 32-deep fp8 wgmma per scale block, and multiplies each partial by 2^ew * 2^ex: four waited
MMA results per 128-K step, which Triton's wgmma pipeliner cannot overlap (a dot result that other
ops consume is waited at once). Here, as in the FP4 decode kernel (``_fp4_decode``), the weight is
decoded in registers to bf16 with its block scale applied, and one bf16 dot chain runs per K step:

    acc[n, m] = sum_k  W~[n, k] * X~[m, k]          acc [BLOCK_N, BLOCK_M], BLOCK_M = 16 >= M
    W~ = e4m3(qw) * 2^ew,  X~ = e4m3(qx) * 2^ex      (bf16; the activation decoded by every program)
    y[m, n]   = acc[n, m] + bias[n]

The decoded weight tile is wgmma's A operand and stays in registers; the 16-row activation tile is
the B operand. Split-K partials go through _twopass's ordered reduction (deterministic).

Two sources of X~: the codes and scales (``launch_e4m3_decode``, as ``mxfp8.gemm`` has them), decoded
by every program in the loop and stored to shared memory as the B tile, so the loop waits for all
its wgmmas each step; or (``launch_e4m3_decode_linear``, X_DECODED) the activation quantized and
dequantized once by ``act_decoded_kernel`` into a bf16 [M, K] scratch in the loop's dot order, which
the GEMM loads with a plain pipelined load: no dot operand is stored to shared memory inside the
loop, so Triton's WGMMA pipeliner makes the dot async (``tools/probes/decode_sass.py``: the wait-for-all
becomes ``DEPBAR.LE gsb0, 0x1``) and the next weight decode overlaps the MMAs (as in _fp4_decode).
W8A16 (hopper.mxfp8's weight-only decode, ``launch_e4m3_decode_linear(a16=True)``) takes the second
source with nothing quantized: act_decoded_kernel (A16) only lays the bf16 x out in that order.

Fragment order (``_fp4_decode.fragment_order`` on bytes): both operands' K is permuted so that lane
q of a quad holds BLOCK_K / 4 consecutive bytes of a row (two 16-byte loads at BLOCK_K = 128, and
one whole 32-element scale block: one scale per lane and row), and each 4-byte word decodes to two
bf16x2 registers that are already A-fragment registers (columns 16c + 2q + {0, 1} and
16c + 8 + 2q + {0, 1}). A dot's sum does not depend on the order of K, so the activation (whose
B tile goes through shared memory) takes the same order only to match.

e4m3 -> bf16 by bit placement (``_E4M3_BF16_ASM``, four codes per call): ``prmt`` with the
sign-replicating selector spreads bytes (0, 1) / (2, 3) into 16-bit lanes, sign in bits 15..8;
shifted left by 4 and masked with 0x87F0, the sign lands at bit 15 and the 7 magnitude bits
eeee mmm at bf16 bits 10..4 (the low exponent bits and the top mantissa bits). That is exactly
value * 2^-120 for every code, the subnormals (eeee = 0) included, as for fp32 in
``_codecs.dequantize_e4m3``; ``mul.rn.bf16x2`` by 2^120 restores it. The NaN codes 0x7F / 0xFF would
read as +-480: per word, t = (w & 0x7F7F7F7F) + 0x01010101 has bit 7 of a byte set exactly for a
NaN code, and a second sign-replicating ``prmt`` of t spreads it into a lane of ones that is OR'd
over the placed bits (0xFFFF is a bf16 NaN), so a NaN weight code makes y[:, n] NaN and a NaN
activation code y[m, :].

Block scales: E8M0 -> bf16 by ``_fp4_decode.e8m0_bf16`` (0x00 is 2^-127, 0xFF NaN), multiplied in
bf16 after the 2^120 (the two cannot be folded: 2^(e + 120) leaves bf16's range for e > 7). A code
has 4 significant bits, so code * 2^e is a bf16 number, and the multiply exact, whenever
e is in [-124, 119] (its lowest bit, >= 2^-9 * 2^e, is on bf16's subnormal grid of 2^-133, and
448 * 2^119 < bf16's max), and for e = 120 with |code| <= 240. That covers every scale our
quantizer writes (e in [-108, 120]; at e = 120 the code 256 needs |x| > 248 * 2^120, and its value
2^128 is Inf in the oracle's fp32 dequantize as in this multiply). Scale bytes 0..2 (e < -124) round
the decoded value to bf16's subnormal grid (|error| <= 2^-134), as the lesson kernel's bf16 cast does
on a GPU. A product of two such bf16 numbers has at most 8 significant bits, exact in the fp32
accumulator unless it leaves fp32's range, so the result equals the lesson kernel's
(``mxfp8._gemm_kernel``) up to the order of the fp32 additions.

Under TRITON_INTERPRET=1 the same placement runs as plain Triton integer ops (``e4m3_bf16_bits``),
decoded to fp32 and dotted in fp32 (exact, and the interpreter's bf16 dot is not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._codecs import dequantize_e4m3, dequantize_e8m0
from .._common import launch, interpreting
from ..mxfp8 import mxfp8_quantize_tile as mx_e4m3_quantize
from ._route import BIAS_DTYPES, TileConfig, sm_count
from ._fp4_decode import e8m0_bf16, fragment_order, scale_planes
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import (NO_ALPHA, decode_split, epilogue, launch_splitk_reduce, splitk_plan, splitk_workspace,
                       store_splitk_partial, swapped_tile)

DECODE_MAX_M = 16  # the B operand is padded to 16 rows (the smallest wgmma N that Triton emits)
MX_GROUP = 32  # elements per E8M0 scale
MIN_BLOCK_K = 4 * MX_GROUP  # each of a lane quad's 4 K slots holds whole scale blocks (scale_planes)
TWO_POW_120 = 1.329227995784916e36

# The placement's constants, shared by the PTX below and the plain-op form (e4m3_bf16_bits)
PLACE_SHIFT = 4  # byte bits 6..0 -> bf16 bits 10..4
PLACE_MASK = 0x87F0  # sign (bit 15) and the 7 magnitude bits
NAN_FILL = 0xFFFF  # OR'd over a NaN code's lane: 0xFFFF is a bf16 NaN (exponent 255, mantissa != 0)
BF16_TWO_POW_120 = 0x7B80  # 2^120 as bf16 bits (biased exponent 247)
_SHIFT, _MASK, _FILL = tl.constexpr(PLACE_SHIFT), tl.constexpr(PLACE_MASK), tl.constexpr(NAN_FILL)
_GROUP = tl.constexpr(MX_GROUP)
_TWO_POW_120 = tl.constexpr(TWO_POW_120)

_E4M3_BF16_ASM = tl.constexpr(f"""{{
.reg .b32 t, x, f, c;
mov.b32 c, 0x{BF16_TWO_POW_120:04X}{BF16_TWO_POW_120:04X};
and.b32 t, $2, 0x7F7F7F7F; add.u32 t, t, 0x01010101;
prmt.b32 x, $2, 0, 0x9180; prmt.b32 f, t, 0, 0x9988;
shl.b32 x, x, {PLACE_SHIFT}; and.b32 x, x, 0x{PLACE_MASK:04X}{PLACE_MASK:04X};
or.b32 x, x, f;
mul.rn.bf16x2 $0, x, c;
prmt.b32 x, $2, 0, 0xB3A2; prmt.b32 f, t, 0, 0xBBAA;
shl.b32 x, x, {PLACE_SHIFT}; and.b32 x, x, 0x{PLACE_MASK:04X}{PLACE_MASK:04X};
or.b32 x, x, f;
mul.rn.bf16x2 $1, x, c;
}}""")
# prmt selectors: nibble i picks the byte of output byte i; 8 | j replicates byte j's sign.
# 0x9180 = [b0, sign(b0), b1, sign(b1)], 0xB3A2 the same for b2, b3; 0x9988 / 0xBBAA spread the
# NaN bits of t (bit 7 of each byte) over a whole 16-bit lane.


@triton.jit
def e4m3_bf16_bits(code):
    """e4m3 code (uint8) -> the bf16 bits of value * 2^-120, NaN codes -> a NaN pattern: the
    placement of _E4M3_BF16_ASM in plain Triton ops (uint16; the interpreter and the tests)."""
    c = code.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended, as the sign-replicating prmt
    nan = ((code.to(tl.int32) & 0x7F) + 1) & 0x80  # bit 7 of t
    bits = ((c << _SHIFT) & _MASK) | tl.where(nan != 0, _FILL, 0)
    return bits.to(tl.uint16)


@triton.jit
def scale_bytes(scale_ptr, rows, r_mask, k0, K, stride_sr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The E8M0 bytes [rows, BLOCK_K / 32] of K [k0, k0 + BLOCK_K) (rows int64); masked reads give 0."""
    offs_s = tl.multiple_of(k0 // _GROUP, BLOCK_K // _GROUP) + tl.arange(0, BLOCK_K // _GROUP)
    if EVEN_K:  # a row mask alone lets a row's bytes load as one vector
        return tl.load(scale_ptr + rows[:, None] * stride_sr + offs_s[None, :], mask=r_mask[:, None], other=0)
    return tl.load(scale_ptr + rows[:, None] * stride_sr + offs_s[None, :],
                   mask=r_mask[:, None] & (offs_s[None, :] < K // _GROUP), other=0)


@triton.jit
def e4m3_tile(data_ptr, s, rows, r_mask, k0, K, stride_dr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``rows`` (int64) x K [k0, k0 + BLOCK_K) of an mxfp8 matrix (codes uint8 [rows, K]) times
    their E8M0 block scales ``s`` [BLOCK_R, BLOCK_K / 32] (scale_bytes), in fragment order: bf16
    [BLOCK_R, BLOCK_K] with USE_ASM, else float32 (both exact for the scales of the module
    docstring). Masked reads give 0."""
    offs_k = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)  # k0: a multiple of BLOCK_K (splitk_plan)
    if EVEN_K:
        b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_k[None, :], mask=r_mask[:, None], other=0)
    else:
        b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_k[None, :],
                    mask=r_mask[:, None] & (offs_k[None, :] < K), other=0)
    if USE_ASM:
        v = tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        sv = e8m0_bf16(s)
    else:
        v = e4m3_bf16_bits(b).to(tl.bfloat16, bitcast=True).to(tl.float32) * _TWO_POW_120
        sv = dequantize_e8m0(s)
    # a byte is one element, so the planes' helper sees blocks of 2 * 32 "plane bytes"
    return scale_planes(fragment_order(v, BLOCK_R, BLOCK_K), sv, BLOCK_R, BLOCK_K, 2 * _GROUP)


@triton.jit
def act_decoded_kernel(
    x_ptr, p_ptr, M, K, stride_xm, stride_xk, stride_pm,
    FLOOR_RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl
    A16: tl.constexpr = False,  # W8A16: x itself (bf16), only laid out in the dot order; FLOOR_RULE unused
):
    """p [M, K_pad] (K_pad a multiple of BLOCK_K): x quantized to mxfp8 by mxfp8's rule
    (mx_e4m3_quantize, the codes and scales of mxfp8.quantize_activation) and dequantized,
    code * 2^e, each BLOCK_K tile in fragment order, the order the decode GEMM dots it (zeros past
    K). Exact in bf16 for the scales the rule writes (module docstring); a non-finite block is NaN.
    A16 (W8A16): x itself, bf16, laid out the same way (no quantization; exact). One program per K
    tile, all rows."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    if A16:  # x as it is (fp32 of bf16: exact); NaN and Inf reach the dot as they are
        v = x
    else:
        q, s = mx_e4m3_quantize(x.reshape(BLOCK_M, BLOCK_K // _GROUP, _GROUP), FLOOR_RULE)
        v = (dequantize_e4m3(q) * dequantize_e8m0(s)[:, :, None]).reshape(BLOCK_M, BLOCK_K)  # fp32, exact
    pdl_launch_dependents(USE_PDL)
    v = fragment_order(v, BLOCK_M, BLOCK_K)
    tl.store(p_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + offs_k[None, :], v.to(p_ptr.dtype.element_ty),
             mask=m_mask[:, None])


@triton.jit
def e4m3_decode_gemm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, K_PER, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
    HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl
    X_DECODED: tl.constexpr = False,  # x_ptr: act_decoded_kernel's [M, K_pad] of DOT_DTYPE; sx_ptr unused
):
    """acc [BLOCK_N, BLOCK_M] over this program's K range, then the transposed store (module docstring)."""
    tl.static_assert(BLOCK_K >= 4 * _GROUP, "BLOCK_K must be >= 128 (MIN_BLOCK_K)")
    offs_n, offs_m, n_mask, m_mask, k_lo, k_hi = swapped_tile(N, M, K, K_PER, BLOCK_N, BLOCK_M)
    rows_w = offs_n.to(tl.int64)
    rows_x = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl_wait(USE_PDL)  # the quantized (X_DECODED: dequantized) activation
    if X_DECODED:
        # the activation arrives decoded (act_decoded_kernel), by a plain load the pipeliner copies
        # into its shared-memory ring: with no dot operand stored to shared memory inside the loop
        # the wgmmas can be async, the weight decode of the next step overlapping this step's MMAs
        x_rows = x_ptr + rows_x[:, None] * stride_xm
        for k0 in range(k_lo, k_hi, BLOCK_K):
            sw = scale_bytes(sw_ptr, rows_w, n_mask, k0, K, stride_swn, BLOCK_K, EVEN_K)
            w = e4m3_tile(w_ptr, sw, rows_w, n_mask, k0, K, stride_wn, BLOCK_N, BLOCK_K, USE_ASM, EVEN_K)
            x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
            acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x), acc)
    else:
        # the activation's scale bytes are loaded a step ahead: the pipeliner leaves a load this small
        # (one byte per thread) in the loop, where its latency would stall every step
        sx_next = scale_bytes(sx_ptr, rows_x, m_mask, k_lo, K, stride_sxm, BLOCK_K, EVEN_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            sx = sx_next
            # the next step's, inside this split (tl.where: the interpreter refuses a bare scalar mask)
            more = tl.where(k0 + BLOCK_K < k_hi, True, False)
            sx_next = scale_bytes(sx_ptr, rows_x, m_mask & more, k0 + BLOCK_K, K, stride_sxm, BLOCK_K, EVEN_K)
            sw = scale_bytes(sw_ptr, rows_w, n_mask, k0, K, stride_swn, BLOCK_K, EVEN_K)
            w = e4m3_tile(w_ptr, sw, rows_w, n_mask, k0, K, stride_wn, BLOCK_N, BLOCK_K, USE_ASM, EVEN_K)
            x = e4m3_tile(x_ptr, sx, rows_x, m_mask, k0, K, stride_xm, BLOCK_M, BLOCK_K, USE_ASM, EVEN_K)
            acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc)
    pdl_launch_dependents(USE_PDL)
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        store_splitk_partial(ws_ptr, out, tl.program_id(1), offs_m, offs_n, M, N, mask)
        return
    out = epilogue(out, offs_n, n_mask, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
             mask=mask)


# ---------------------------------------------------------------------------------------------
# Policy and launcher
# ---------------------------------------------------------------------------------------------
def decode_tile(M: int, N: int, K: int, n_sms: int, *, bn: int = 128, stages: int = 3,
                programs_per_sm: int = 2) -> TileConfig:
    """The GPU tile on a device of ``n_sms`` SMs: BLOCK_N weight rows per program (128: the
    activation's decode and the loop's fixed cost over twice the rows of 64), 16 padded activation
    rows, 128-wide K steps, 3 stages; split-K while the grid stays within ``programs_per_sm``
    programs per SM (2: one wave at the 3 CTAs per SM that 160 registers leave, where 4 per SM ran
    1.3 waves) and every split keeps >= 4 K steps (docs/perf_notes.md: split 4 at
    N = K = 8192; the rule was measured only there, on the H200's 132 SMs)."""
    bk = MIN_BLOCK_K
    cfg = TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=stages)
    return decode_split(cfg, N, K, programs_per_sm * n_sms)


def decode_config(M: int, N: int, K: int, device) -> TileConfig:
    """The tile launch_e4m3_decode launches on ``device`` (and mxfp8.tile_config reports): decode_tile
    with the device's SM count; under the interpreter one wide tile (few programs and K steps)."""
    if interpreting():
        p = triton.next_power_of_2
        return TileConfig(BLOCK_M=16, BLOCK_N=min(256, max(16, p(N))), BLOCK_K=min(512, max(MIN_BLOCK_K, p(K))),
                          GROUP_M=1, num_warps=4, num_stages=1)
    return decode_tile(M, N, K, sm_count(device))


def launch_e4m3_decode(x, sx, w, sw, bias, y, *, config: TileConfig | None = None,
                       use_asm: bool | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """y = dequant(x) . dequant(w)^T + bias for M <= 16 rows of mxfp8 operands (OCP MX 1.0: e4m3
    elements, one E8M0 scale per 32 along K), as ``mxfp8._gemm_kernel`` computes it up to the order
    of the fp32 additions (module docstring; any GPU compiles it, the interpreter runs it in fp32).

    Args:
        x: e4m3 codes [M, K], torch.float8_e4m3fn or uint8, M <= 16, K stride 1.
        sx: E8M0 bytes uint8 [M, K/32] (linear layout, K stride 1).
        w, sw: the weight's codes [N, K] and E8M0 bytes [N, K/32], as x and sx.
        bias: None or a contiguous float32 / bf16 / fp16 [N] (kernel_bias's), added in fp32.
        y: the output, bfloat16 / float16 / float32 [M, N], unit column stride; written, returned.
        config: the tile; None: decode_config's for y's device. BLOCK_M >= M, BLOCK_K a power of
            two >= 128 (MIN_BLOCK_K).
        use_asm: the inline-PTX decode (True; a GPU only) or plain Triton ops (False); None: PTX
            on a GPU, plain ops under the interpreter.
        maxnreg: None, or a cap on the registers per thread (ptxas .maxnreg; GPU only), a probe knob.
    Returns:
        y.
    Raises:
        ValueError: naming the argument: x or w not 2-D, not e4m3 codes or not K-contiguous; their K
            differ; sx / sw not uint8 [rows, K/32] K-contiguous; y not bf16 / fp16 / fp32 [M, N] with
            unit column stride; bias not a contiguous float32 / bf16 / fp16 [N]; operands on different devices;
            M > 16, K not a positive multiple of 32, config.BLOCK_M < M, or config.BLOCK_K not a
            power of two >= 128.
    """
    M, N, K = _check_operands(x, sx, w, sw, bias, y, x_codes=True)
    cfg = _checked_config(M, N, K, y, config)
    if M == 0 or N == 0:
        return y
    return _launch_gemm(x.view(torch.uint8), sx, w, sw, bias, y, cfg, use_asm, maxnreg, x_decoded=False)


def launch_e4m3_decode_linear(x, w, sw, bias, y, *, floor_rule: bool = False, config: TileConfig | None = None,
                              use_asm: bool | None = None, a16: bool = False) -> torch.Tensor:
    """y = dequant(q(x)) . dequant(w)^T + bias for M <= 16 rows of a bf16 / fp16 activation x, q the
    mxfp8 activation quantizer (mxfp8.quantize_activation: formats.quantize's codes and scales): the
    decode linear in two launches (plus split-K's reduction). act_decoded_kernel quantizes x and
    writes code * 2^e (bf16 on a GPU, exact; fp32 under the interpreter) into an [M, K rounded up to
    BLOCK_K] scratch in the GEMM's dot order, which the GEMM loads as is (X_DECODED). The dot
    operands are those of launch_e4m3_decode on quantize_activation(x), so the result is too, up
    to the order of the fp32 additions (the same dot: bit for bit under the interpreter).

    a16=True (W8A16, hopper.mxfp8's weight-only decode): x is not quantized; act_decoded_kernel
    only lays the bf16 rows out in the dot order, and y = x . dequant(w)^T + bias (every product
    of a bf16 value and a 4-significant-bit weight is exact in the fp32 accumulator).

    Args:
        x: bfloat16 / float16 [M, K], any strides; M <= 16, K a positive multiple of 32.
        w, sw: the weight's e4m3 codes [N, K] (float8_e4m3fn or uint8) and E8M0 bytes uint8
            [N, K/32], K stride 1 in both.
        bias: None or a contiguous float32 / bf16 / fp16 [N] (kernel_bias's), added in fp32.
        y: the output, bfloat16 / float16 / float32 [M, N], unit column stride; written, returned.
        floor_rule: the activation's scale rule, False for "ceil", True for "floor" (OCP MX 6.3);
            unused with a16.
        config, use_asm: as launch_e4m3_decode (the weight decode).
        a16: W8A16, x used as it is; x must then be bfloat16 (the scratch is bf16 on a GPU, which
            holds fp16's 11 significant bits only approximately).
    Returns:
        y.
    Raises:
        ValueError: as launch_e4m3_decode (x must be bfloat16 / float16 here, bfloat16 with a16;
            no sx), naming the argument.
    """
    M, N, K = _check_operands(x, None, w, sw, bias, y, x_codes=False)
    if a16 and x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 with a16=True (the decode GEMM dots a bf16 copy of it; fp16 x takes "
                         f"hopper.mxfp8's split-K GEMM with exact hi/lo bf16 halves), got {x.dtype}")
    cfg = _checked_config(M, N, K, y, config)
    if M == 0 or N == 0:
        return y
    bk = cfg.BLOCK_K
    k_tiles = triton.cdiv(K, bk)
    xd = torch.empty((M, k_tiles * bk), dtype=torch.float32 if interpreting() else torch.bfloat16, device=y.device)
    launch(act_decoded_kernel, (k_tiles,),
        x, xd, M, K, x.stride(0), x.stride(1), xd.stride(0),
        FLOOR_RULE=floor_rule, BLOCK_M=cfg.BLOCK_M, BLOCK_K=bk, num_warps=4, num_stages=1, A16=a16,
        **pdl_launch(y.device),
    )
    return _launch_gemm(xd, sw, w, sw, bias, y, cfg, use_asm, None, x_decoded=True)  # sx unused


_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def _check_operands(x, sx, w, sw, bias, y, *, x_codes: bool) -> tuple[int, int, int]:
    """(M, N, K) of the launchers' operands, or ValueError naming the first that breaks their
    Args (dtypes, shapes, K strides, one device); x_codes: x is e4m3 codes with E8M0 bytes sx,
    else a bf16 / fp16 activation (sx None)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x and w must be 2-D, got x {tuple(x.shape)} and w {tuple(w.shape)}")
    (M, K), N = x.shape, w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w has K={w.shape[1]} but x has K={K}; they must match")
    if x_codes and (x.dtype not in _CODE_DTYPES or x.stride(1) != 1):
        raise ValueError(f"x must be e4m3 codes (float8_e4m3fn or uint8) with K stride 1, got {x.dtype} "
                         f"with strides {x.stride()}")
    if not x_codes and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    if w.dtype not in _CODE_DTYPES or w.stride(1) != 1:
        raise ValueError(f"w must be e4m3 codes (float8_e4m3fn or uint8) with K stride 1, got {w.dtype} "
                         f"with strides {w.stride()}")
    for name, s, rows in (("sx", sx, M), ("sw", sw, N)):
        if s is None:
            continue
        if s.dtype != torch.uint8 or tuple(s.shape) != (rows, K // MX_GROUP) or (s.numel() and s.stride(1) != 1):
            raise ValueError(f"{name} must be E8M0 bytes uint8 [{rows}, {K // MX_GROUP}] with K stride 1, got "
                             f"{s.dtype} {tuple(s.shape)} strides {s.stride()}")
    if y.dtype not in (torch.bfloat16, torch.float16, torch.float32) or tuple(y.shape) != (M, N) or y.stride(1) != 1:
        raise ValueError(f"y must be bfloat16 / float16 / float32 [{M}, {N}] with unit column stride, got "
                         f"{y.dtype} {tuple(y.shape)} strides {y.stride()}")
    if bias is not None and (bias.dtype not in BIAS_DTYPES or tuple(bias.shape) != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be None or a contiguous float32 / bfloat16 / float16 [{N}], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    devices = {t.device for t in (x, sx, w, sw, bias, y) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"every operand must be on one device, got {sorted(map(str, devices))}")
    return M, N, K


def _checked_config(M: int, N: int, K: int, y, config) -> TileConfig:
    """config (None: decode_config's for y's device), checked against the problem (the launchers' Raises)."""
    if M > DECODE_MAX_M:
        raise ValueError(f"M must be <= {DECODE_MAX_M} for the decode kernel, got {M}")
    if K <= 0 or K % MX_GROUP:
        raise ValueError(f"mxfp8 needs K to be a positive multiple of {MX_GROUP}, got K={K}")
    cfg = config or decode_config(M, N, K, y.device)
    if cfg.BLOCK_M < M:
        raise ValueError(f"BLOCK_M must be >= M = {M} (one program holds every row), got BLOCK_M={cfg.BLOCK_M}")
    bk = cfg.BLOCK_K
    if bk < MIN_BLOCK_K or bk & (bk - 1):
        raise ValueError(f"BLOCK_K must be a power of two >= {MIN_BLOCK_K} (4 scale blocks per lane quad), "
                         f"got BLOCK_K={bk}")
    return cfg


def _launch_gemm(x, sx, w, sw, bias, y, cfg, use_asm, maxnreg, *, x_decoded: bool) -> torch.Tensor:
    """e4m3_decode_gemm_kernel (and split-K's reduction) into y; x: codes uint8, or with x_decoded
    act_decoded_kernel's scratch (sx then unused)."""
    M, N, K = y.shape[0], y.shape[1], w.shape[1]
    bk = cfg.BLOCK_K
    interp = interpreting()
    w = w.view(torch.uint8)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    regs = {} if maxnreg is None or interp else {"maxnreg": maxnreg}
    launch(e4m3_decode_gemm_kernel, (triton.cdiv(N, cfg.BLOCK_N), n_split),
        x, sx, w, sw, bias if bias is not None else y, y, ws,
        M, N, K, k_per, x.stride(0), sx.stride(0), w.stride(0), sw.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, USE_ASM=(not interp) if use_asm is None else use_asm,
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16, ROUND_BF16=interp and y.dtype == torch.bfloat16,
        EVEN_K=K % bk == 0, BLOCK_N=cfg.BLOCK_N, BLOCK_M=cfg.BLOCK_M, BLOCK_K=bk, SPLIT_K=n_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, X_DECODED=x_decoded, **regs, **pdl_launch(y.device),
    )
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias)
    return y
