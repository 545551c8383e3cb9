"""MXFP8: e4m3 elements, one E8M0 scale per 32 consecutive elements along K.

    X    = 2^ceil(log2(amax_block / 448))     (see formats._mx for the floor rule)
    code = e4m3(x / X)                          (RNE, saturating)
    y[m, n] = sum over 32-blocks of (xq . wq) * X_x * X_w   (exact: the scales are powers of two)

Weight [N, K] -> data float8_e4m3fn [N, K], scale uint8 E8M0 [N, K/32]; activations the same.
K must be a multiple of 32. Source: OCP MX v1.0 (MXFP8 E4M3, block 32, E8M0 scale).
"""

from __future__ import annotations

import torch

from ._mx import expand_e8m0, mx_scales
from .base import FormatSpec, QuantizedTensor, check_role
from .codecs import decode_e4m3, encode_e4m3
from .constants import E4M3_EMAX, E4M3_MAX, MX_BLOCK

ORDER = 3  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.uint8  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "uint8 (E8M0 bytes; view a float8_e8m0fnu tensor as uint8)"
HAS_GLOBAL_SCALE = False
SPEC = FormatSpec(
    name="mxfp8",
    k_multiple=MX_BLOCK,
    element="e4m3",
    scale="e8m0",
    weight_block=(1, MX_BLOCK),
    activation_block=(1, MX_BLOCK),
    source="OCP MX v1.0, MXFP8 (E4M3) with E8M0 block scales",
)


def quantize(x: torch.Tensor, role: str = "weight", *, scale_rule: str = "ceil") -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix (K % 32 == 0) to MXFP8.

    Returns QuantizedTensor(data=float8_e4m3fn [rows, K], scale=uint8 E8M0 [rows, K/32]).
    Raises ValueError for a bad role or scale_rule.
    """
    check_role(role)
    scale, scaled = mx_scales(x, E4M3_MAX, E4M3_EMAX, scale_rule)
    return QuantizedTensor(SPEC.name, role, encode_e4m3(scaled), scale, None, (1, MX_BLOCK), tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * 2^(scale - 127), in ``dtype`` [rows, K]."""
    return decode_e4m3(q.data).to(dtype) * expand_e8m0(q.scale, q.rows, dtype)
