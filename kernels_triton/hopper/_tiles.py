"""The sm_90 tile tables of the GEMMs that the Hopper implementation launches from the lessons'
kernels (the e4m3 formats' portable GEMM and mxfp8's pre-pass); the decode and TMA kernels' tiles
live next to them (_fp8_decode, _e4m3_decode, _fp8_prefill).

e4m3 table (``e4m3_config``), by M:
    M <= 16   16 x 64 x 128, 4 stages, one program per tile; split-K only for mxfp8 (``prepass``
              marks it), whose dequantizing arithmetic needs more programs in flight.
    M <= 64   64 x 64, split-K (_twopass.split_k_for): N / 64 programs alone leave most SMs idle.
    M <= 256  64 x 128, one program per tile.
    larger    128 x 128 x 128, 8 warps, 3 stages (a 128 x 256 accumulator spills with fp8_tensor's
              max_num_imprecise_acc); mxfp8 (``prepass``) above PREPASS_MIN_M: dequantize each operand
              once into bf16, then the bf16 GEMM (128 x 256 x 64, 8 warps, 3 stages).
"""

from __future__ import annotations

from typing import Optional

from ._route import TileConfig
from ._twopass import split_k_for

PREPASS_MIN_M = 128  # mxfp8: above this M the pre-pass + bf16 GEMM replaces the fused kernel


def e4m3_config(M: int, N: int, K: int, *, block_k: Optional[int] = None, prepass: bool = False) -> TileConfig:
    """The sm_90 tile of the e4m3 formats' GEMM (module docstring). ``block_k`` forces BLOCK_K
    (fp8_block with fp32 scales: 128); ``prepass`` marks mxfp8 (split-K at M <= 16, the pre-pass
    above PREPASS_MIN_M)."""
    bk = block_k or 128
    if prepass and M > PREPASS_MIN_M:
        return TileConfig(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3, PREPASS=True)
    if M <= 16:
        split = split_k_for(M, N, K, 16, 64, bk) if prepass else 1
        return TileConfig(16, 64, bk, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=split)
    if M <= 64:
        return TileConfig(64, 64, bk, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=split_k_for(M, N, K, 64, 64, bk))
    if M <= 256:
        return TileConfig(64, 128, bk, GROUP_M=8, num_warps=4, num_stages=3)
    return TileConfig(128, 128, bk, GROUP_M=8, num_warps=8, num_stages=3)
