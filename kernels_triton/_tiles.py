"""SM12x tile tables (RTX PRO 6000 / RTX 5090 / RTX 5080: sm_120, DGX Spark GB10: sm_121).

The parts: 101,376 B of shared memory per block, warp-level ``mma.sync`` only (no wgmma/tcgen05),
at most 1536 threads per SM, and 188 / 170 / 84 / 48 SMs. Triton 3.9 keeps num_stages - 1 operand
buffers in shared memory on sm_120, so a tile costs (num_stages - 1) * (BLOCK_M + BLOCK_N) * BLOCK_K
bytes of 8-bit operands (half that for packed e2m1, twice for bf16) plus the scales; every entry
fits even with all num_stages buffers (a Triton version that keeps them all). The compile test
(tests/kernels_triton/test_sm12x_compile.py) checks each entry against Triton's allocation and
ptxas' report (registers, spills) for both arches; docs/results.md has the table.

Kinds (what the operands are; each kind's kernels share a BLOCK_K):
    e4m3      native dot_scaled on e4m3 codes: fp8_tensor, mxfp8, fp8_block with UE8M0 scales
    fp8_block native fp8_block with fp32 scales (BLOCK_K must be 128: one scale per K step)
    e2m1      native dot_scaled on packed e2m1: nvfp4, mxfp4 (BLOCK_K >= 64: triton#11776; 256
              spills past 64 x 64 tiles)
    e2m1_portable  the portable FP4 kernel (_fp4_gemm: W4A16, and W4A4 when forced): operands decoded
              in registers, so a shorter BLOCK_K keeps the fp32 decode tiles inside the register
              file; large M takes the decode pre-pass and a bf16 GEMM

By M (the regimes of _twopass): decode (M <= 16) and small (M <= 64) split K until the grid reaches
two programs per SM (an SM holds several of these small programs); medium runs one program per
tile (8 warps: with 4, a 64 x 128 fp32 accumulator plus the scale handling spills); large
128 x 128 with 8 warps. Measured on no SM12x part yet: the tables are sized, compiled
and resource-checked, not tuned.
"""

from __future__ import annotations

from ._common import TileConfig
from ._twopass import split_k_for

SM12X_SMEM_PER_BLOCK = 101_376  # bytes (99 KiB opt-in per block on SM120/SM121)
SM12X_SM_COUNTS = (188, 170, 84, 48)  # RTX PRO 6000, RTX 5090, RTX 5080, GB10
KINDS = ("e4m3", "fp8_block", "e2m1", "e2m1_portable")
_BLOCK_K = {"e4m3": 128, "fp8_block": 128, "e2m1": 128, "e2m1_portable": 64}
PREPASS_MIN_M = 128  # e2m1_portable: above this M, decode the weight once, then a bf16 GEMM
PROGRAMS_PER_SM = 2

# name -> (M upper bound, tile without split-K); the first row whose bound covers M is taken
_NATIVE_ROWS = (
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", 256, dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
    ("large", None, dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
)
_PORTABLE_FP4_ROWS = (
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", PREPASS_MIN_M, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
    # the bf16 GEMM after the decode pre-pass: 2 * (128 + 128) * 64 * 2 B = 64 KiB
    ("prepass", None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
                           PREPASS=True)),
)


def _rows(kind: str):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "e2m1_portable":
        return _PORTABLE_FP4_ROWS
    return tuple((name, bound, {**t, "BLOCK_K": _BLOCK_K[kind]}) for name, bound, t in _NATIVE_ROWS)


def sm12x_config(kind: str, M: int, N: int, K: int, sm_count: int) -> TileConfig:
    """The SM12x tile for an [M, K] x [N, K]^T GEMM of ``kind`` on a part with ``sm_count`` SMs."""
    for name, bound, t in _rows(kind):
        if bound is None or M <= bound:
            cfg = TileConfig(**t)
            if name in ("decode", "small"):
                split = split_k_for(M, N, K, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K,
                                    target=PROGRAMS_PER_SM * max(1, sm_count))
                cfg = TileConfig(**{**t, "SPLIT_K": split})
            return cfg
    raise AssertionError("unreachable: the last row has no bound")


def sm12x_entries(kind: str) -> dict[str, TileConfig]:
    """Every row of the ``kind`` table by name, without split-K (the compile test adds the split-K
    variant of the rows that can split: ``can_split``)."""
    return {name: TileConfig(**t) for name, _, t in _rows(kind)}


def can_split(row: str) -> bool:
    return row in ("decode", "small")
