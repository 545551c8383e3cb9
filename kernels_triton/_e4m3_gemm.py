"""Pieces shared by the three e4m3 formats (fp8_tensor, fp8_block, mxfp8): tile choices, operand
checks, the row flattening of activations, and a small device helper for the GEMM kernels.

Each format module keeps its own kernels (a file is a lesson); only the plumbing lives here.

Device helpers:
    grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M) -> (pid_m, pid_n)
        the "grouped ordering" of Triton's matmul tutorial: GROUP_M row tiles are walked together
        so that consecutive programs reuse the same weight columns from L2.
    mx_e4m3_quantize(x, FLOOR_RULE) -> (codes, E8M0 bytes)
        mxfp8's per-block quantization rule (mxfp8's module docstring), shared by its quantizer and
        the sm_90 decode linear's quantizer that writes the dequantized activation (_e4m3_decode).
(``round_to_bf16_rne``, the interpreter's bf16 rounding fix, and the split-K epilogue live in
_common and _twopass.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_EMAX, E4M3_MAX, E8M0_BIAS

from ._common import TileConfig, abs_or_inf, ceil_log2, check_bias, check_weight, encode_e4m3, exp2_int, floor_log2
from ._common import interpreting as _interpreting
from ._paths import sm_count
from ._tiles import sm12x_config
from ._twopass import split_k_for

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_EMAX = tl.constexpr(E4M3_EMAX)
_E8M0_BIAS = tl.constexpr(E8M0_BIAS)


# ---------------------------------------------------------------------------------------------
# mxfp8's block quantization (formats/mxfp8.py, formats/_mx.py: the oracle)
# ---------------------------------------------------------------------------------------------
@triton.jit
def mx_e4m3_quantize(x, FLOOR_RULE: tl.constexpr):
    """x fp32 [R, G, 32], one 1x32 block per last axis -> (codes uint8 [R, G, 32], E8M0 bytes uint8
    [R, G]): e from the block amax (ceil or floor rule), code = e4m3(x * 2^-e), byte = e + 127; a
    block holding a NaN/Inf gets codes 0x7F and the NaN byte 0xFF (the non-finite rule)."""
    amax = tl.max(abs_or_inf(x), axis=2)  # [R, G]; +Inf marks a NaN/Inf in the block
    bad = amax > 3.4028234663852886e38
    amax = tl.maximum(amax, _AMAX_FLOOR)
    if FLOOR_RULE:
        e = floor_log2(amax) - _E4M3_EMAX
    else:
        e = ceil_log2(tl.math.div_rn(amax, _E4M3_MAX))
    e = tl.minimum(tl.maximum(e, -127), 127)
    # x * 2^-e is exact (a power of two), like the oracle's ldexp; a bad block's codes are all 0x7F
    # (times NaN)
    q = encode_e4m3(x * tl.where(bad, float("nan"), exp2_int(-e))[:, :, None])
    return q, tl.where(bad, 0xFF, e + _E8M0_BIAS).to(tl.uint8)


# ---------------------------------------------------------------------------------------------
# Tile choices
# ---------------------------------------------------------------------------------------------
def gemm_config(M: int, N: int, K: int, interpreting: bool, *, block_k: int | None = None,
                prepass: bool = False) -> TileConfig:
    """Tile sizes for the GEMM kernels (the SM90 table; docs/perf_notes.md has the measurements).

    Under the interpreter each (program x K-iteration) costs ~2-3 ms of Python whatever the tile
    size, so the tiles are as large as the problem (up to 256 x 256, K up to 512 per step). On GPU,
    by M:
      M <= 16   16 x 64 x 128, 4 stages, one program per tile (the e4m3 dot formats, where split-K
                was slower), split-K for mxfp8, whose decode arithmetic needs more programs in flight.
      M <= 64   64 x 64 with split-K: N / 64 programs alone leave most of the 132 SMs idle.
      M <= 256  64 x 128, one program per tile.
      larger    128 x 128 x 128, 8 warps, 3 stages (128 x 256 x 128 is slower for fp8_tensor: its
                128-KB accumulator spills with max_num_imprecise_acc).
                ``prepass`` (mxfp8): decode once into bf16, then a bf16 GEMM (_twopass).
    ``block_k`` forces BLOCK_K (block FP8 needs exactly 128: one scale per K step).
    """
    if interpreting:
        bm = min(256, max(16, triton.next_power_of_2(M)))
        bn = min(256, max(16, triton.next_power_of_2(N)))
        bk = block_k or min(512, max(32, triton.next_power_of_2(K)))
        return TileConfig(bm, bn, bk, GROUP_M=8, num_warps=4, num_stages=1)
    bk = block_k or 128
    if prepass and M > PREPASS_MIN_M:
        return TileConfig(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3, PREPASS=True)
    if M <= 16:
        split = split_k_for(M, N, K, 16, 64, bk) if prepass else 1  # prepass marks mxfp8 (decoding)
        return TileConfig(16, 64, bk, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=split)
    if M <= 64:
        return TileConfig(64, 64, bk, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=split_k_for(M, N, K, 64, 64, bk))
    if M <= 256:
        return TileConfig(64, 128, bk, GROUP_M=8, num_warps=4, num_stages=3)
    return TileConfig(128, 128, bk, GROUP_M=8, num_warps=8, num_stages=3)


PREPASS_MIN_M = 128  # mxfp8: above this M the decode pre-pass + bf16 GEMM beats the fused kernel

def native_config(M: int, N: int, K: int, device, *, kind: str = "e4m3", block_k: int | None = None) -> TileConfig:
    """Tile of a native (tl.dot_scaled) e4m3 GEMM: the SM12x table (_tiles) on a GPU, the
    interpreter's whole-problem tiles otherwise (``block_k`` forces BLOCK_K there)."""
    if _interpreting():
        return gemm_config(M, N, K, True, block_k=block_k)
    return sm12x_config(kind, M, N, K, sm_count(device))


def quant_config(M: int, K: int, interpreting: bool, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of an activation-quantization tile; BLOCK_K is a multiple of ``group``.

    On GPU, decode (M <= 16) quantizes one row per program, 1024 wide (fp8_block takes only
    BLOCK_M and keeps one 128 group per program): a 32-row tile would leave most of each program
    masked, and the quantizer is latency bound there (H200, fp8_tensor, K = 8192: 8.0 -> 3.3 us at
    M = 1, 7.0 -> 4.1 at M = 16; docs/perf_notes.md)."""
    if interpreting:
        return min(256, triton.next_power_of_2(max(M, 1))), max(group, min(1024, triton.next_power_of_2(K)))
    if M <= 16:
        return 1, max(group, 1024)
    return 32, max(group, 128)


# ---------------------------------------------------------------------------------------------
# Host-side plumbing
# ---------------------------------------------------------------------------------------------
def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K]; a view when the strides allow it (the kernels take both strides, so a
    strided 2-D x needs no copy), otherwise a copy."""
    return x.reshape(-1, x.shape[-1])


def check_gemm_operands(xq, qweight, bias, out_dtype, fmt: str,
                        layouts: tuple[str, ...] = ("linear",)) -> tuple[int, int, int]:
    """Validate the GEMM operands of format ``fmt``; returns (M, N, K).

    Raises ValueError naming the argument for: a weight that is not a ``fmt`` weight with a scale
    layout of ``layouts``,
    an ``xq`` that is not a ``fmt`` activation, a K mismatch, operands on different devices, an
    out_dtype outside bf16/fp16/fp32, or a bias that is not a float [N] tensor on the same device.
    """
    check_weight(qweight, fmt, layouts)
    if not isinstance(xq, QuantizedTensor) or xq.role != "activation" or xq.fmt != fmt:
        got = f"a {xq.fmt} {xq.role}" if isinstance(xq, QuantizedTensor) else type(xq).__name__
        raise ValueError(f"xq must be a {fmt} activation QuantizedTensor, got {got}")
    if xq.scale_layout != "linear":
        raise ValueError(f"xq.scale_layout must be 'linear', got {xq.scale_layout!r}")
    n, k = qweight.shape
    if xq.k != k:
        raise ValueError(f"xq has K={xq.k} but qweight has K={k}; they must match")
    if xq.device != qweight.device:
        raise ValueError(f"xq must be on the weight's device {qweight.device}, got {xq.device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check_bias(bias, n, qweight.device)
    if bias is not None and bias.dtype not in BIAS_DTYPES:
        raise ValueError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
    return xq.rows, n, k


def e4m3_operand(data: torch.Tensor, dot_fp8: bool) -> torch.Tensor:
    """The e4m3 codes as the kernel should see them: float8_e4m3fn (Triton's float8e4nv pointer)
    when the GPU dots them directly, uint8 when the kernel decodes them with decode_e4m3."""
    return data if dot_fp8 else data.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), walking GROUP_M row tiles per weight column tile."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


