"""Tuned tiles for the lessons' kernels on a GPU, and what a serving warmup needs to know about
them. No lesson imports this module: a caller that wants these tiles (the dispatch library's
triton backend) passes them into a lesson's functions as ``tile=`` and ``quant_tile=``
(``tiles(...)`` builds both); a lesson alone keeps its own simple defaults.

    SM12x tables     ``sm12x_config(kind, M, ...)``, ``sm12x_entries(kind)``: the native kernels and
                     the weight-only portable kernels on SM120/SM121 (RTX PRO 6000, RTX 5090/5080, GB10)
    e4m3 by M        ``e4m3_portable_config(M, block_k)``: the e4m3 lessons' portable GEMM on a GPU
    quantizer tiles  ``quant_config(M, K, interpreting, group)``, ``quant_tile(fmt, M, K)``: one row per
                     program at decode (at every M for fp8_channel's whole-row quantizer)
    warmup           ``int_specialization(n)``, ``specializations(fmt, M, K)``: the M-derived
                     launch values Triton compiles a kernel once per class of
"""

from __future__ import annotations

from typing import Optional

import triton

from formats import spec

from . import fp8_tensor, nvfp4
from ._common import TileConfig, default_quant_tile, interpreting, route_path

# ---------------------------------------------------------------------------------------------
# SM12x tile tables (RTX PRO 6000 / RTX 5090 / RTX 5080: sm_120, DGX Spark GB10: sm_121)
# ---------------------------------------------------------------------------------------------
# The parts: 101,376 B of shared memory per block, warp-level ``mma.sync`` only (no wgmma/tcgen05),
# at most 1536 threads per SM, and 188 / 170 / 84 / 48 SMs. Triton 3.9 keeps num_stages - 1 operand
# buffers in shared memory on sm_120, so a tile costs (num_stages - 1) * (BLOCK_M + BLOCK_N) * BLOCK_K
# bytes of 8-bit operands (half that for packed e2m1, twice for bf16) plus the scales; every entry
# fits even with all num_stages buffers (a Triton version that keeps them all). The compile test
# (tests/kernels_triton/test_sm12x_compile.py) checks each entry against Triton's allocation and
# ptxas' report (registers, spills) for both arches; docs/results.md has the table.
#
# Kinds (what the operands are; each kind's kernels share a BLOCK_K):
#     e4m3           native dot_scaled on e4m3 codes: fp8_tensor, fp8_channel, mxfp8, fp8_block with UE8M0
#                    scales
#     fp8_block      native fp8_block with fp32 scales (BLOCK_K must be 128: one scale per K step)
#     e2m1           native dot_scaled on packed e2m1: nvfp4, mxfp4 (BLOCK_K >= 64: triton#11776; 256
#                    spills past 64 x 64 tiles)
#     e2m1_portable  the portable FP4 kernel (W4A16, and W4A4 when forced): operands dequantized in
#                    registers, so a shorter BLOCK_K keeps the fp32 tiles inside the register file
#     e4m3_portable  mxfp8's portable kernel for W8A16 (the same rows: bf16 x, the weight decoded in
#                    registers; W8A8 forced portable keeps e4m3_portable_config)
#
# By M: decode (M <= 16), small (M <= 64), medium (8 warps: with 4, a 64 x 128 fp32 accumulator plus
# the scale handling spills), large 128 x 128 with 8 warps. One program per output tile (the
# lessons do not split K). Measured on no SM12x part yet: sized, compiled and resource-checked.
SM12X_SMEM_PER_BLOCK = 101_376  # bytes (99 KiB opt-in per block on SM120/SM121)
SM12X_SM_COUNTS = (188, 170, 84, 48)  # RTX PRO 6000, RTX 5090, RTX 5080, GB10
KINDS = ("e4m3", "fp8_block", "e2m1", "e2m1_portable", "e4m3_portable")
_BLOCK_K = {"e4m3": 128, "fp8_block": 128, "e2m1": 128}

# name -> (M upper bound, tile); the first row whose bound covers M is taken
_NATIVE_ROWS = (
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", 256, dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
    ("large", None, dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
)
_PORTABLE_ROWS = (  # the weight-only kinds (e2m1_portable, e4m3_portable)
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)


def _rows(kind: str):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind.endswith("_portable"):
        return _PORTABLE_ROWS
    return tuple((name, bound, {**t, "BLOCK_K": _BLOCK_K[kind]}) for name, bound, t in _NATIVE_ROWS)


def sm12x_config(kind: str, M: int, N: int = 0, K: int = 0, sm_count: int = 1) -> TileConfig:
    """The SM12x tile for an [M, K] x [N, K]^T GEMM of ``kind`` (KINDS): the first row of the
    ``kind`` table whose M bound covers M (N, K and sm_count do not change the choice: one program
    per output tile). ValueError for an unknown kind."""
    for _, bound, t in _rows(kind):
        if bound is None or M <= bound:
            return TileConfig(**t)
    raise AssertionError("unreachable: the last row has no bound")


def sm12x_entries(kind: str) -> dict[str, TileConfig]:
    """Every row of the ``kind`` table by name (what the compile test builds)."""
    return {name: TileConfig(**t) for name, _, t in _rows(kind)}


# ---------------------------------------------------------------------------------------------
# The e4m3 lessons' portable GEMM on any GPU, and the activation quantizers' tiles
# ---------------------------------------------------------------------------------------------
def e4m3_portable_config(M: int, block_k: int = 128) -> TileConfig:
    """The portable e4m3 GEMM's tile on a GPU (fp8_tensor, fp8_channel, fp8_block; mxfp8 with block_k 64), by M,
    one program per output tile: M <= 16: 16 x 64, 4 stages; M <= 64: 64 x 64; M <= 256: 64 x 128;
    larger: 128 x 128 with 8 warps."""
    if M <= 16:
        return TileConfig(16, 64, block_k, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 64:
        return TileConfig(64, 64, block_k, GROUP_M=8, num_warps=4, num_stages=3)
    if M <= 256:
        return TileConfig(64, 128, block_k, GROUP_M=8, num_warps=4, num_stages=3)
    return TileConfig(128, 128, block_k, GROUP_M=8, num_warps=8, num_stages=3)


QUANT_DECODE_ROW_BLOCK = 1024  # decode (M <= 16) activation quantizer: one row per program, this wide


def quant_config(M: int, K: int, interpreting: bool, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of an activation-quantization program; BLOCK_K is a multiple of ``group``.

    Under the interpreter the lessons' default (_common.default_quant_tile: as large as the
    problem). On GPU, decode (M <= 16) quantizes one row per program, QUANT_DECODE_ROW_BLOCK wide
    (fp8_block takes only BLOCK_M and keeps one 128 group per program): a 32-row tile would leave
    most of each program masked, and the quantizer is latency bound there; larger M takes 32 x 128."""
    if interpreting:
        return min(256, triton.next_power_of_2(max(M, 1))), max(group, min(1024, triton.next_power_of_2(K)))
    if M <= 16:
        return 1, max(group, QUANT_DECODE_ROW_BLOCK)
    return 32, max(group, 128)


def _quant_group(fmt: str) -> int:
    """The BLOCK_K multiple of fmt's quantizer: its scale block (fp8_tensor and fp8_channel, whose scales
    span K: 32)."""
    return 32 if spec(fmt).k_multiple == 1 else spec(fmt).k_multiple


# The quantizers whose grid is rows only: a program owns whole rows and walks K (fp8_channel's
# per-token amax). They take one row per program at every M; a 32-row tile would leave M / 32 programs.
WHOLE_ROW_QUANTIZERS = ("fp8_channel",)


def _gpu_quant_tile(fmt: str, M: int, K: int) -> tuple[int, int]:
    """The quantizer tile on a GPU: quant_config's, or one row per program (WHOLE_ROW_QUANTIZERS)."""
    if fmt in WHOLE_ROW_QUANTIZERS:
        return 1, max(_quant_group(fmt), QUANT_DECODE_ROW_BLOCK)
    return quant_config(M, K, False, _quant_group(fmt))


def quant_tile(fmt: str, M: int, K: int, interpreted: Optional[bool] = None) -> tuple[int, int]:
    """The ``quant_tile=`` of a kernels_triton.<fmt> quantizer call on x [M, K]: the lessons' own tile
    under the interpreter (quant_config), on a GPU the decode row (M <= 16; every M for
    WHOLE_ROW_QUANTIZERS) or 32 x 128. ``interpreted``: whether the kernels run in Triton's
    interpreter (None: as in this process; a warmup planning for a described device passes its own)."""
    interpreted = interpreting() if interpreted is None else interpreted
    return quant_config(M, K, True, _quant_group(fmt)) if interpreted else _gpu_quant_tile(fmt, M, K)


# ---------------------------------------------------------------------------------------------
# The tiles of one lesson call
# ---------------------------------------------------------------------------------------------
def tiles(fmt: str, M: int, N: int, K: int, *, capability: Optional[tuple[int, int]], a16: bool = False,
          path: Optional[str] = None) -> dict:
    """The tuned ``tile`` and ``quant_tile`` of a kernels_triton.<fmt> call on x [M, K] and a
    weight [N, K] on a device of ``capability``, as keyword arguments for its route / linear /
    gemm; {} for capability None (the interpreter, where the lessons' whole-problem tiles are the
    fast ones). The GEMM path is the lesson's own (_common.route_path, ``path`` forced or not).

    Native path: the SM12x table of its kind; portable FP4: the "e2m1_portable" table; mxfp8
    W8A16 on SM12x: the "e4m3_portable" table; other portable e4m3: e4m3_portable_config (mxfp8's
    64-deep K steps: its dequantized tiles live in registers).
    Raises ValueError where route_path does (an unknown fmt or path, a16 without W4A16, ...)."""
    if capability is None:
        return {}
    path = route_path(path, fmt, capability, a16=a16)[0]
    fp4 = spec(fmt).element == "e2m1"
    if path == "native":
        tile = sm12x_config("e2m1" if fp4 else ("fp8_block" if fmt == "fp8_block" else "e4m3"), M)
    elif fp4:
        tile = sm12x_config("e2m1_portable", M)
    elif a16 and capability[0] == 12:
        tile = sm12x_config("e4m3_portable", M)
    else:
        tile = e4m3_portable_config(M, 64 if fmt == "mxfp8" else 128)
    return {"tile": tile, "quant_tile": _gpu_quant_tile(fmt, M, K)}  # a GPU's, not this process's


# ---------------------------------------------------------------------------------------------
# What a serving warmup needs: the Triton specialization classes of M-derived launch values
# ---------------------------------------------------------------------------------------------
def int_specialization(n: int) -> str:
    """How Triton specializes an int kernel argument: "1" (== 1), "16" (divisible by 16) or "" (any
    other value); a kernel compiles once per class."""
    return "1" if n == 1 else ("16" if n % 16 == 0 else "")


def specializations(fmt: str, M: int, K: int, *, a16: bool = False, interpreted: Optional[bool] = None) -> tuple:
    """What a kernels_triton.<fmt> linear at M rows compiles beyond its route (kernels and tile), as
    far as M decides it, with the quantizer tile of ``quant_tile``: that tile, and for the
    dynamic-scale quantizers (nvfp4, fp8_tensor) the class of the amax partial count and nvfp4's
    BLOCK_P; () for W4A16 (no quantizer). ``interpreted``: whether the kernels run in Triton's
    interpreter (None: as in this process; False for a GPU). A warmup that runs one M per distinct
    value compiles every variant a call can need."""
    if a16:
        return ()
    block_m, block_k = quant_tile(fmt, M, K, interpreted)
    if fmt == "nvfp4":
        n = nvfp4.amax_partials(M, block_m, interpreted)
        return (block_m, block_k), int_specialization(n), max(16, triton.next_power_of_2(n))
    if fmt == "fp8_tensor":
        pm, pk = fp8_tensor.amax_grid(M, K, block_m, block_k, interpreted)
        return (block_m, block_k), int_specialization(pm * pk)
    return ((block_m, block_k),)


__all__ = ["KINDS", "QUANT_DECODE_ROW_BLOCK", "SM12X_SMEM_PER_BLOCK", "SM12X_SM_COUNTS", "WHOLE_ROW_QUANTIZERS",
           "default_quant_tile", "e4m3_portable_config", "int_specialization", "quant_config", "quant_tile",
           "sm12x_config", "sm12x_entries", "specializations", "tiles"]
