"""NVFP4: e2m1 elements packed two per byte, an e4m3 scale per 16 elements, an fp32 global scale.

    g    = 448 * 6 / amax(tensor)               (dynamic; or a calibrated ``global_scale``)
    s    = e4m3((amax_block / 6) * g)           (RNE, saturating; float32 arithmetic, IEEE division)
    code = e2m1((x * g) / s)                    (RNE ties-to-even code, saturating; code 0 if s == 0)
    x   ~= code * s / g
    y    = (sum over 16-blocks of (xq . wq) * s_x * s_w) * alpha,   alpha = 1 / (g_x * g_w)

Weight [N, K] -> data uint8 [N, K/2] (element 2i in the low nibble), scale float8_e4m3fn [N, K/16],
global_scale float32 0-d (a multiplier, as vLLM's ``weight_global_scale``). K must be a multiple
of 16. Source: NVIDIA NVFP4 recipe (TensorRT-LLM / Transformer Engine, "two-level scaling");
vLLM ``scaled_fp4_quant`` / ModelOpt NVFP4 checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import (FormatSpec, QuantizedTensor, block_amax, check_positive_scalar, check_role, expand_blocks,
                   ieee_div, nan_if_nonfinite)
from .codecs import decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, pack_e2m1, unpack_e2m1
from .constants import AMAX_FLOOR, E2M1_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR

ORDER = 4  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.float8_e4m3fn  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "float8_e4m3fn (the e4m3 block scales)"
HAS_GLOBAL_SCALE = True
SPEC = FormatSpec(
    name="nvfp4",
    k_multiple=NVFP4_BLOCK,
    element="e2m1",
    scale="e4m3 + fp32 global",
    weight_block=(1, NVFP4_BLOCK),
    activation_block=(1, NVFP4_BLOCK),
    source="NVIDIA NVFP4 (e2m1 values, e4m3 scale per 16, fp32 global scale)",
)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """g = 448 * 6 / max(amax, AMAX_FLOOR) as a float32 0-d tensor (finite and positive)."""
    return ieee_div(torch.tensor(NVFP4_GLOBAL_NUMERATOR, device=amax.device), amax.to(torch.float32).reshape(()).clamp_min(AMAX_FLOOR))


def quantize(x: torch.Tensor, role: str = "weight", *, global_scale: Optional[float] = None) -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix (K % 16 == 0) to NVFP4.

    Args:
        x: float32 [rows, K].
        role: "weight" or "activation".
        global_scale: static g (e.g. a calibrated ``input_global_scale`` = 2688 / calibrated amax);
            dynamic 2688 / amax(x) if None.
    Returns:
        QuantizedTensor(data=uint8 [rows, K/2], scale=float8_e4m3fn [rows, K/16], global_scale=f32 0-d).
    Raises:
        ValueError: bad role, or a non-positive / non-finite ``global_scale``.
    """
    check_role(role)
    if global_scale is None:
        amax = nan_if_nonfinite(x.abs()).amax() if x.numel() else x.new_zeros(())  # NaN if x has NaN/Inf
        g = global_scale_from_amax(amax)
    else:
        g = check_positive_scalar(global_scale, "global_scale").to(x.device)
    amax_b = block_amax(x, 1, NVFP4_BLOCK)
    # s = e4m3(fl32(fl32(amax_b / 6) * g)), in this order: b12x 1.5.1's reference quantizer
    # (b12x/_lib/intrinsics.py: (global_scale * (block_max / FLOAT4_E2M1_MAX)).to(float8_e4m3fn));
    # another order moves the product by a float32 ulp and, near an e4m3 midpoint, the scale byte.
    scale = encode_e4m3(ieee_div(amax_b, E2M1_MAX) * g)
    s = expand_blocks(decode_e4m3(scale), x.shape[0], 1, NVFP4_BLOCK)
    # a NaN block scale (0x7F: the block, or with dynamic g the tensor, held a NaN/Inf) fails
    # s > 0, so its codes are 0
    scaled = torch.where(s > 0, ieee_div(x * g, s), torch.zeros_like(x))
    data = pack_e2m1(encode_e2m1(scaled))
    return QuantizedTensor(SPEC.name, role, data, scale, g, (1, NVFP4_BLOCK), tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e2m1 value * e4m3 scale) / g, in ``dtype`` [rows, K]."""
    values = decode_e2m1(unpack_e2m1(q.data)).to(dtype)
    s = expand_blocks(decode_e4m3(q.scale).to(dtype), q.rows, 1, NVFP4_BLOCK)
    return values * s / q.global_scale.to(dtype)
