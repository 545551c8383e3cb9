"""MXFP4: e2m1 elements packed two per byte, one E8M0 scale per 32 elements along K.

    X    = 2^ceil(log2(amax_block / 6))       (see formats._mx for the floor rule)
    code = e2m1(x / X)                          (RNE ties-to-even code, saturating to +-6)
    W4A4:  y = sum over 32-blocks of (xq . wq) * X_x * X_w
    W4A16: activations stay bf16/fp16:  y = x . dequant(W)^T

Weight [N, K] -> data uint8 [N, K/2] (element 2i in the low nibble), scale uint8 E8M0 [N, K/32].
K must be a multiple of 32. Source: OCP MX v1.0 (MXFP4 E2M1, block 32, E8M0 scale).
"""

from __future__ import annotations

import torch

from ._mx import expand_e8m0, mx_scales
from .base import FormatSpec, QuantizedTensor, check_role
from .codecs import decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from .constants import E2M1_EMAX, E2M1_MAX, MX_BLOCK

ORDER = 5  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.uint8  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "uint8 (E8M0 bytes; view a float8_e8m0fnu tensor as uint8)"
HAS_GLOBAL_SCALE = False
SPEC = FormatSpec(
    name="mxfp4",
    k_multiple=MX_BLOCK,
    element="e2m1",
    scale="e8m0",
    weight_block=(1, MX_BLOCK),
    activation_block=(1, MX_BLOCK),
    source="OCP MX v1.0, MXFP4 (E2M1) with E8M0 block scales",
)


def quantize(x: torch.Tensor, role: str = "weight", *, scale_rule: str = "ceil") -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix (K % 32 == 0) to MXFP4.

    Returns QuantizedTensor(data=uint8 [rows, K/2], scale=uint8 E8M0 [rows, K/32]).
    Raises ValueError for a bad role or scale_rule.
    """
    check_role(role)
    scale, scaled = mx_scales(x, E2M1_MAX, E2M1_EMAX, scale_rule)
    # e2m1 has no NaN: a block with the NaN scale 0xFF (it held a NaN/Inf) gets all-zero codes
    data = pack_e2m1(encode_e2m1(torch.nan_to_num(scaled, nan=0.0)))
    return QuantizedTensor(SPEC.name, role, data, scale, None, (1, MX_BLOCK), tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 value * 2^(scale - 127), in ``dtype`` [rows, K]."""
    values = decode_e2m1(unpack_e2m1(q.data)).to(dtype)
    return values * expand_e8m0(q.scale, q.rows, dtype)
