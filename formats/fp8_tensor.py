"""Per-tensor FP8 (W8A8): e4m3 elements, one float32 scale per tensor.

    scale = amax / 448              (dynamic; or a static calibrated ``scale``)
    code  = e4m3(x / scale)         (RNE, saturating to +-448)
    x    ~= code * scale
    y     = (xq @ wq^T) * (sx * sw)

Weight [N, K] -> data float8_e4m3fn [N, K], scale float32 0-d. Activations likewise [M, K].
No alignment needed on K. Source: vLLM / TensorRT-LLM per-tensor FP8 ("fp8_w8a8" static or dynamic);
OCP MX v1.0 5.3.2 for e4m3.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import FormatSpec, QuantizedTensor, check_positive_scalar, check_role, ieee_div, nan_if_nonfinite
from .codecs import decode_e4m3, encode_e4m3
from .constants import AMAX_FLOOR, E4M3_MAX

ORDER = 1  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.float32  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "float32 (the per-tensor scale)"
HAS_GLOBAL_SCALE = False
SPEC = FormatSpec(
    name="fp8_tensor",
    k_multiple=1,
    element="e4m3",
    scale="fp32",
    weight_block=None,
    activation_block=None,
    source="per-tensor FP8 W8A8 (vLLM fp8_w8a8); e4m3 per OCP MX v1.0 5.3.2",
)


def tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-tensor scale: max(amax, AMAX_FLOOR) / 448 as a float32 0-d tensor (NaN when x
    holds a NaN or Inf: the non-finite rule, docs/formats.md)."""
    amax = nan_if_nonfinite(x.abs()).amax() if x.numel() else x.new_zeros(())
    return ieee_div(amax.to(torch.float32).clamp_min(AMAX_FLOOR), E4M3_MAX)


def quantize(x: torch.Tensor, role: str = "weight", *, scale: Optional[float] = None) -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix to per-tensor FP8.

    Args:
        x: float32 [rows, K] (the caller casts and flattens).
        role: "weight" or "activation".
        scale: static float32 scale (e.g. a calibrated ``input_scale``); dynamic amax/448 if None.
    Returns:
        QuantizedTensor(data=float8_e4m3fn [rows, K], scale=float32 0-d).
    Raises:
        ValueError: bad role or a non-positive / non-finite ``scale``.
    Non-finite x (activations only; the oracle refuses them in weights): with the dynamic scale the
    scale is NaN and every code 0x7F; with a static scale each NaN/Inf element's code is 0x7F.
    """
    check_role(role)
    s = tensor_scale(x) if scale is None else check_positive_scalar(scale, "scale").to(x.device)
    # a NaN/Inf element, or every element under a NaN scale, encodes as the NaN code 0x7F
    data = encode_e4m3(ieee_div(nan_if_nonfinite(x), s))
    return QuantizedTensor(SPEC.name, role, data, s, None, None, tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * scale, in ``dtype`` (float32 or float64) [rows, K]."""
    return decode_e4m3(q.data).to(dtype) * q.scale.to(dtype)
