"""The OCP MX recipe shared by MXFP8 and MXFP4: one E8M0 (power-of-two) scale per 32 elements.

Scale rules (``scale_rule``):
  "ceil"  (default, what we produce): X = 2^ceil(log2(amax / max_elem)). Used by b12x, cuBLAS
          and Transformer Engine; the scaled block never exceeds max_elem except by fp32 rounding of
          amax / max_elem, in which case it saturates.
  "floor" (OCP MX v1.0 section 6.3): X = 2^(floor(log2(amax)) - emax_elem). Up to one binade
          finer, so the largest elements of a block saturate (clip) to max_elem.
Weights quantized elsewhere with either rule are accepted as given: a scale is just a byte.
The exponent is clamped to the E8M0 range [-127, 127]; an all-zero block gets the amax floor's
exponent (a finite positive scale) and zero codes.
"""

from __future__ import annotations

import torch

from .base import block_amax, expand_blocks, ieee_div
from .codecs import ceil_log2, decode_e8m0, encode_e8m0, floor_log2
from .constants import E8M0_BIAS, E8M0_NAN, MX_BLOCK

SCALE_RULES = ("ceil", "floor")


def mx_scale_exponent(x: torch.Tensor, max_elem: float, emax_elem: int, scale_rule: str) -> torch.Tensor:
    """int32 [rows, K/32] scale exponents of a float32 [rows, K] matrix (clamped to [-127, 127])."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    amax = block_amax(x, 1, MX_BLOCK)
    e = ceil_log2(ieee_div(amax, max_elem)) if scale_rule == "ceil" else floor_log2(amax) - emax_elem
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def scaled_blocks(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x / 2^e per block, exactly (a power-of-two scaling; computed in float64, cast once)."""
    e = expand_blocks(exponent, x.shape[0], 1, MX_BLOCK).to(torch.float64)
    return torch.ldexp(x.to(torch.float64), -e).to(torch.float32)


def mx_scales(x: torch.Tensor, max_elem: float, emax_elem: int, scale_rule: str):
    """(E8M0 bytes uint8 [rows, K/32], x scaled into element range float32 [rows, K]).

    A block holding a NaN or Inf (an activation: the non-finite rule, docs/formats.md) gets the
    NaN byte 0xFF and NaN scaled values (each format turns them into its codes).
    """
    e = mx_scale_exponent(x, max_elem, emax_elem, scale_rule)
    bad = torch.isnan(block_amax(x, 1, MX_BLOCK))
    e = torch.where(bad, torch.zeros_like(e), e)
    scale = torch.where(bad, torch.full_like(e, E8M0_NAN, dtype=torch.uint8), encode_e8m0(e))
    scaled = scaled_blocks(x, e)
    return scale, torch.where(expand_blocks(bad, x.shape[0], 1, MX_BLOCK), float("nan"), scaled)


def expand_e8m0(scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """E8M0 bytes [rows, K/32] -> per-element scale values [rows, K] in ``dtype``."""
    return expand_blocks(decode_e8m0(scale).to(dtype), rows, 1, MX_BLOCK)
