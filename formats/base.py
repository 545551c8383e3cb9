"""What every format module shares: the QuantizedTensor container, a format's spec, input checks
and the per-block amax reduction."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .constants import AMAX_FLOOR

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROLES = ("weight", "activation")


@dataclass(frozen=True)
class FormatSpec:
    """Static description of a format.

    name: the format's name ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "fp8_channel").
    k_multiple: K (the reduction dimension) must be a multiple of this.
    element: element encoding ("e4m3" or "e2m1").
    scale: scale encoding ("fp32", "ue8m0|fp32", "e8m0", "e4m3").
    weight_block / activation_block: (rows, K) covered by one scale; None = one scale per tensor;
        (1, None) = one scale per row over the whole K (a QuantizedTensor records (1, K)).
    source: the specification it follows.
    """

    name: str
    k_multiple: int
    element: str
    scale: str
    weight_block: Optional[tuple[int, int]]
    activation_block: Optional[tuple[int, int]]
    source: str

    def block(self, role: str) -> Optional[tuple[int, int]]:
        check_role(role)
        return self.weight_block if role == "weight" else self.activation_block


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized [rows, K] matrix: codes, block scales and (NVFP4) a global scale.

    Fields:
        fmt: format name.
        role: "weight" ([N, K]) or "activation" ([M, K]).
        data: element codes. e4m3 formats: torch.float8_e4m3fn [rows, K]; e2m1 formats: uint8
            [rows, K/2], two codes per byte, element 2i in the low nibble.
        scale: fp8_tensor: float32 0-d tensor (dequantized value = code * scale);
            fp8_channel: float32 [rows] (one scale per row: code * scale[row]);
            fp8_block: float32 [ceil(rows/br), K/128] (br = 128 for weights, 1 for activations);
            mxfp8 / mxfp4: uint8 E8M0 bytes [rows, K/32]; nvfp4: float8_e4m3fn [rows, K/16].
            With scale_layout == "swizzled_128x4" the 1-byte scales are flat (see formats.layout).
        global_scale: nvfp4 only: float32 0-d tensor g; value = code * scale / g. None otherwise.
        block_shape: (rows, K) elements covered by one scale; None for per-tensor scaling.
        scale_layout: "linear" or "swizzled_128x4".
        shape: logical (rows, K).
    """

    fmt: str
    role: str
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor]
    block_shape: Optional[tuple[int, int]]
    shape: tuple[int, int]
    scale_layout: str = "linear"

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> "QuantizedTensor":
        """A copy with every tensor moved to ``device``."""
        g = None if self.global_scale is None else self.global_scale.to(device)
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), global_scale=g)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors, by field name (for safetensors)."""
        out = {"data": self.data, "scale": self.scale}
        if self.global_scale is not None:
            out["global_scale"] = self.global_scale
        return out


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def check_float_input(x, name: str, *, matrix: bool, finite: bool = True) -> None:
    """Raise ValueError unless x is a float32/bf16/fp16 tensor (2-D if ``matrix``), with finite
    values if ``finite`` (weights; activations follow the non-finite rule of docs/formats.md)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if matrix and x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension [..., K], got a 0-d tensor")
    if finite and x.numel() and not bool(torch.isfinite(x).all()):
        # A weight with NaN/Inf is refused (a checkpoint bug); activations take the non-finite rule.
        raise ValueError(f"{name} contains NaN or Inf; quantizing a weight needs finite values")


def check_k(spec: FormatSpec, k: int, name: str = "x.shape[-1]") -> None:
    if k <= 0 or k % spec.k_multiple:
        raise ValueError(f"{spec.name} needs K ({name}) to be a positive multiple of {spec.k_multiple}, got {k}")


def check_positive_scalar(v, name: str) -> torch.Tensor:
    """A finite positive scalar as a float32 0-d tensor, else ValueError naming ``name``."""
    t = torch.as_tensor(v, dtype=torch.float32)
    if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"{name} must be one finite positive number, got {v!r}")
    return t.reshape(())


def ieee_div(a: torch.Tensor, b) -> torch.Tensor:
    """a / b, correctly rounded (IEEE) on every device.

    torch evaluates ``tensor / python_number`` on CUDA, and ``number / tensor`` everywhere, as a
    multiplication by a rounded reciprocal, which differs from the true quotient in the last bit
    for a fair share of values. Dividing by a full tensor of the same shape is a true division on
    CPU and CUDA alike, and the kernels (tl.math.div_rn) match it bit for bit.
    """
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype, device=a.device)
    a, b = torch.broadcast_tensors(a, b.to(a.device))
    return torch.div(a.contiguous(), b.contiguous())


def block_amax(x: torch.Tensor, block_rows: int, block_k: int) -> torch.Tensor:
    """max |x| over each (block_rows x block_k) block of a [rows, K] float32 matrix.

    Rows are padded with zeros up to a multiple of block_rows (K must already be a multiple of
    block_k). Returns float32 [ceil(rows/block_rows), K/block_k], clamped below at AMAX_FLOOR;
    NaN for a block holding a NaN or Inf (the non-finite rule, docs/formats.md).
    """
    rows, k = x.shape
    pad = (-rows) % block_rows
    a = nan_if_nonfinite(x.abs())
    if pad:
        a = torch.cat([a, a.new_zeros(pad, k)])
    a = a.view(-1, block_rows, k // block_k, block_k)
    return a.amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)


def nan_if_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN and +-Inf replaced by NaN (so that a max over it, and every scale computed
    from that max, is NaN: the non-finite rule of docs/formats.md)."""
    return torch.where(torch.isfinite(x), x, torch.full_like(x, float("nan")))


def expand_blocks(s: torch.Tensor, rows: int, block_rows: int, block_k: int) -> torch.Tensor:
    """Broadcast per-block values [rb, kb] back to elements [rows, kb*block_k]."""
    return s.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_k, 1)
