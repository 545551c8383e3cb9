"""Per-channel FP8 (W8A8): e4m3 elements, one float32 scale per weight row (output channel) and
one per activation row (token).

    weight:      sw[n] = max(amax(|W[n, :]|), AMAX_FLOOR) / 448     (static)
    activation:  sx[m] = max(amax(|x[m, :]|), AMAX_FLOOR) / 448     (dynamic, per token), or one
                 static calibrated ``scale`` repeated for every row
    code = e4m3(v / s_row)                                          (RNE, saturating to +-448)
    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n]

The scales are constant along K, so, as for fp8_tensor, they factor out of the K sum: the K loop
multiplies codes and the epilogue applies one scale per output row and one per output column.

Weight [N, K] -> data float8_e4m3fn [N, K], scale float32 [N]. Activations [M, K] -> data
float8_e4m3fn [M, K], scale float32 [M]. No alignment needed on K.
Source: compressed-tensors' FP8_DYNAMIC preset (weights float8 strategy "channel", static; input
activations float8 strategy "token", dynamic), vLLM's kFp8StaticChannelSym / kFp8DynamicTokenSym
keys, torch._scaled_mm's row-wise scaling; e4m3 per OCP MX v1.0 5.3.2.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import FormatSpec, QuantizedTensor, check_positive_scalar, check_role, ieee_div, nan_if_nonfinite
from .codecs import decode_e4m3, encode_e4m3
from .constants import AMAX_FLOOR, E4M3_MAX

ORDER = 6  # position in formats.FORMAT_NAMES (discovered by formats.oracle)
SCALE_DTYPE = torch.float32  # what QuantizedTensor.scale holds (formats/validate.py checks it)
SCALE_WHAT = "float32 (one scale per row)"
HAS_GLOBAL_SCALE = False
ROW = (1, None)  # one scale per row, over the whole of K (a QuantizedTensor records (1, K))
SPEC = FormatSpec(
    name="fp8_channel",
    k_multiple=1,
    element="e4m3",
    scale="fp32 per row",
    weight_block=ROW,
    activation_block=ROW,
    source="compressed-tensors FP8_DYNAMIC (per-channel weights, per-token activations); "
           "e4m3 per OCP MX v1.0 5.3.2",
)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-row scales of a float32 [rows, K] matrix: max(amax of the row, AMAX_FLOOR) / 448
    as float32 [rows] (IEEE division). NaN for a row holding a NaN or Inf (the non-finite rule,
    docs/formats.md); an all-zero row gets the finite positive AMAX_FLOOR / 448."""
    amax = nan_if_nonfinite(x.abs()).amax(dim=1)  # NaN propagates through amax and clamp_min
    return ieee_div(amax.to(torch.float32).clamp_min(AMAX_FLOOR), E4M3_MAX)


def quantize(x: torch.Tensor, role: str = "weight", *, scale: Optional[float] = None) -> QuantizedTensor:
    """Quantize a float32 [rows, K] matrix to per-channel (per-row) FP8.

    Args:
        x: float32 [rows, K] (the caller casts and flattens).
        role: "weight" (one scale per output channel) or "activation" (one per token).
        scale: one static float32 scale for every row (e.g. a calibrated per-tensor ``input_scale``);
            None for the dynamic per-row max(amax, AMAX_FLOOR) / 448.
    Returns:
        QuantizedTensor(data=float8_e4m3fn [rows, K], scale=float32 [rows], block_shape (1, K)).
    Raises:
        ValueError: bad role or a non-positive / non-finite ``scale``.
    Non-finite x (activations only; the oracle refuses them in weights): with the dynamic scales the
    row's scale is NaN and every code of the row 0x7F; with a static scale each NaN/Inf element's
    code is 0x7F.
    """
    check_role(role)
    rows, k = x.shape
    if scale is None:
        s = row_scales(x)
    else:
        s = check_positive_scalar(scale, "scale").to(x.device).reshape(1).repeat(rows)
    # a NaN/Inf element, or every element of a row under a NaN scale, encodes as the NaN code 0x7F
    data = encode_e4m3(ieee_div(nan_if_nonfinite(x), s[:, None]))
    return QuantizedTensor(SPEC.name, role, data, s, None, (1, k), (rows, k))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * the row's scale, in ``dtype`` (float32 or float64) [rows, K]."""
    return decode_e4m3(q.data).to(dtype) * q.scale.to(dtype)[:, None]
