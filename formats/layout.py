"""Block-scale layouts: the linear layout [rows, K/block] and the swizzled 128x4 layout.

The swizzled 128x4 layout is the one cuBLAS (CUBLASLT_MATMUL_MATRIX_SCALE_VEC16/VEC32_UE4M3/UE8M0),
FlashInfer and b12x (``b12x._lib.intrinsics.swizzle_block_scale``, "F8_128x4") read: rows are padded
to a multiple of 128 and columns to a multiple of 4; each 128x4 tile is 512 contiguous bytes, tiles
are ordered row-block-major, and inside a tile row r sits at (r % 32) * 16 + ((r // 32) % 4) * 4.
Byte offset of (r, c):

    (r // 128 * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4

Source: cuBLAS documentation, "1D Block Scaling Factors Layout"; b12x 1.5.1 swizzle_block_scale.
"""

from __future__ import annotations

import torch

from .constants import SWIZZLE_COLS, SWIZZLE_ROWS, SWIZZLE_TILE_BYTES

__all__ = ["swizzled_offset", "swizzled_size", "swizzle_128x4", "unswizzle_128x4"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def swizzled_size(rows: int, cols: int) -> int:
    """Number of scale bytes in the swizzled layout of a [rows, cols] scale matrix (padding included)."""
    return _ceil_div(rows, SWIZZLE_ROWS) * _ceil_div(cols, SWIZZLE_COLS) * SWIZZLE_TILE_BYTES


def swizzled_offset(r, c, cols: int):
    """Byte offset of scale (r, c) in the swizzled 128x4 layout of a matrix with ``cols`` columns.

    Works on Python ints and on integer tensors alike (the formula above).
    """
    tiles_per_row = _ceil_div(cols, SWIZZLE_COLS)
    return ((r // 128) * tiles_per_row + c // 4) * SWIZZLE_TILE_BYTES + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4


def swizzle_128x4(scales: torch.Tensor, pad_value: int = 0) -> torch.Tensor:
    """Linear [rows, cols] block scales -> flat swizzled 128x4 layout.

    Args:
        scales: [rows, cols] tensor of 1-byte scales (uint8 E8M0 bytes or float8_e4m3fn).
        pad_value: byte written into the padding (rows up to a multiple of 128, cols up to 4).
    Returns:
        1-D tensor of ``swizzled_size(rows, cols)`` elements, same dtype as ``scales``.
    Raises:
        ValueError: if scales is not 2-D or its elements are not 1 byte wide.
    """
    if scales.dim() != 2:
        raise ValueError(f"scales must be 2-D [rows, K/block], got shape {tuple(scales.shape)}")
    if scales.element_size() != 1:
        raise ValueError(f"scales must have 1-byte elements (uint8 / float8), got {scales.dtype}")
    rows, cols = scales.shape
    out = torch.full((swizzled_size(rows, cols),), pad_value, dtype=torch.uint8, device=scales.device)
    r = torch.arange(rows, device=scales.device).view(-1, 1)
    c = torch.arange(cols, device=scales.device).view(1, -1)
    out[swizzled_offset(r, c, cols).flatten()] = scales.contiguous().view(torch.uint8).flatten()
    return out.view(scales.dtype)


def unswizzle_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_128x4: flat swizzled bytes -> linear [rows, cols] (padding dropped).

    Raises:
        ValueError: if ``flat`` is not 1-D with exactly ``swizzled_size(rows, cols)`` 1-byte elements.
    """
    need = swizzled_size(rows, cols)
    if flat.dim() != 1 or flat.numel() != need or flat.element_size() != 1:
        raise ValueError(
            f"flat must be a 1-D 1-byte tensor of {need} elements for a [{rows}, {cols}] scale matrix, "
            f"got shape {tuple(flat.shape)} dtype {flat.dtype}"
        )
    r = torch.arange(rows, device=flat.device).view(-1, 1)
    c = torch.arange(cols, device=flat.device).view(1, -1)
    return flat.view(torch.uint8)[swizzled_offset(r, c, cols)].view(flat.dtype)
