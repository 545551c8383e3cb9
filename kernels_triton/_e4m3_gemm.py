"""mxfp8's block quantization rule as a device function, and the e4m3 formats' tile choice by
device; the host plumbing they share lives in _common, the codecs in _codecs (re-exported here
under their first names).
"""

from __future__ import annotations

import triton
import triton.language as tl

from formats.constants import AMAX_FLOOR, E4M3_EMAX, E4M3_MAX, E8M0_BIAS

from ._codecs import abs_or_inf, ceil_log2, encode_e4m3, exp2_int, floor_log2, grouped_tile  # noqa: F401
from ._common import (  # noqa: F401  (re-exported under their first names)
    BIAS_DTYPES, OUT_DTYPES, TileConfig, check_gemm_operands, device_capability, e4m3_operand, flatten_rows,
    interpreter_config, quant_config,
)
from ._common import native_config as _native_config
from .hopper._tiles import PREPASS_MIN_M, e4m3_config  # noqa: F401

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


def gemm_config(M: int, N: int, K: int, interpreting: bool, *, block_k: int | None = None,
                prepass: bool = False) -> TileConfig:
    """The e4m3 GEMM tile: the interpreter's whole-problem tile (_common.interpreter_config), else
    the sm_90 table (hopper._tiles.e4m3_config)."""
    if interpreting:
        return interpreter_config(M, N, K, block_k=block_k)
    return e4m3_config(M, N, K, block_k=block_k, prepass=prepass)


def native_config(M: int, N: int, K: int, device, *, kind: str = "e4m3", block_k: int | None = None) -> TileConfig:
    """Tile of a native (tl.dot_scaled) e4m3 GEMM on ``device``: _common.native_config for its capability."""
    return _native_config(M, N, K, device_capability(device), kind=kind, block_k=block_k)
