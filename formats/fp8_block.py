"""Block FP8 (DeepSeek-V3 / DeepGEMM style): e4m3 elements, float32 scales per block.

    weights:      one scale per 128x128 block  -> scale float32 [ceil(N/128), K/128]
    activations:  one scale per 1x128 group    -> scale float32 [M, K/128]
    scale = amax_block / 448, optionally rounded up to a power of two (UE8M0, ``ue8m0=True``)
    code  = e4m3(x / scale)                   (RNE, saturating)
    y[m, n] = sum over 128-wide K blocks kb of (xq[m, kb] . wq[n, kb]) * sx[m, kb] * sw[n // 128, kb]

K must be a multiple of 128; N need not be (the last weight block row is partial).
Source: DeepSeek-V3 technical report 3.3.2; vLLM "fp8_block_w8a8" (weight_block_size [128, 128]).
"""

from __future__ import annotations

import torch

from .base import FormatSpec, QuantizedTensor, block_amax, check_role, expand_blocks, ieee_div
from .codecs import decode_e4m3, encode_e4m3, pow2_ceil
from .constants import E4M3_MAX, FP8_BLOCK

ORDER = 2  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.float32  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "float32 (the block scales)"
HAS_GLOBAL_SCALE = False
SPEC = FormatSpec(
    name="fp8_block",
    k_multiple=FP8_BLOCK,
    element="e4m3",
    scale="fp32 (optionally UE8M0 powers of two)",
    weight_block=(FP8_BLOCK, FP8_BLOCK),
    activation_block=(1, FP8_BLOCK),
    source="DeepSeek-V3 block FP8 (1x128 activations, 128x128 weights); DeepGEMM UE8M0 option",
)


def quantize(x: torch.Tensor, role: str = "weight", *, ue8m0: bool = False) -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix (K % 128 == 0, checked by the caller) to block FP8.

    Args:
        x: float32 [rows, K].
        role: "weight" (128x128 blocks) or "activation" (1x128 groups).
        ue8m0: round each scale up to a power of two (2^ceil(log2(amax/448))).
    Returns:
        QuantizedTensor(data=float8_e4m3fn [rows, K], scale=float32 [ceil(rows/br), K/128]).
    Raises:
        ValueError: bad role.
    """
    check_role(role)
    br, bk = SPEC.block(role)
    scale = ieee_div(block_amax(x, br, bk), E4M3_MAX)
    if ue8m0:
        scale = torch.where(torch.isnan(scale), scale, pow2_ceil(scale))
    # a group holding a NaN/Inf has a NaN scale (block_amax), so all its codes are 0x7F
    data = encode_e4m3(ieee_div(x, expand_blocks(scale, x.shape[0], br, bk)))
    return QuantizedTensor(SPEC.name, role, data, scale, None, (br, bk), tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * block scale, in ``dtype`` [rows, K]."""
    br, bk = q.block_shape
    s = expand_blocks(q.scale.to(dtype), q.rows, br, bk)
    return decode_e4m3(q.data).to(dtype) * s
