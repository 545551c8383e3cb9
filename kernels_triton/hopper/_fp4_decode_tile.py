"""The policy of the sm_90 FP4 decode GEMM (``_fp4_decode``): where it applies, its tile on a device
given by its SM count, and the layout of the decoded activation it dots (the planes an activation
quantizer may write for it), with the check that planes handed to it have that layout.

Host code only; ``_fp4_decode`` re-exports every name, so callers import them from there."""

from __future__ import annotations

import torch
import triton

from .._common import interpreting
from ._route import TileConfig, sm_count
from ._twopass import decode_split

DECODE_MAX_M = 16  # the B operand is padded to 16 rows (the smallest wgmma N that Triton emits)
PLANE_DTYPES = {"nvfp4": (torch.float16, torch.float32), "mxfp4": (torch.bfloat16, torch.float32)}


def decode_tile(M: int, N: int, K: int, n_sms: int, fmt: str = "mxfp4", a16: bool = False) -> TileConfig:
    """The GPU tile for format ``fmt`` ("nvfp4" or "mxfp4"; ``a16``: W4A16) on a device of ``n_sms``
    SMs. BLOCK_M is the padded activation side (16), BLOCK_N the weight rows per program (128: the
    loop's fixed cost spread over twice the rows of 64). BLOCK_K 256 for nvfp4 W4A4 with K >= 1024
    (its fp16 decode is the cheapest, so the per-step fixed cost weighs most; 204 registers, two
    programs per SM still fit), 128 for the bf16 planes. Split-K: the largest power of two that keeps
    the grid within two programs per SM and each program >= 4 K steps, then the count splitk_plan
    launches for it (fewer where whole BLOCK_K steps per program cannot fill that many ranges: 7 for
    K = 4224 at 8), so the reported SPLIT_K is the launched one (docs/perf_notes.md has the
    measurements behind the rule and the shapes they cover; elsewhere it is an extrapolation).

    Raises ValueError for a ``fmt`` other than "nvfp4" / "mxfp4"."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4' for the FP4 decode tile, got {fmt!r}")
    bn = 128
    bk = 256 if fmt == "nvfp4" and not a16 and K >= 1024 else 128
    cfg = TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=3)
    return decode_split(cfg, N, K, 2 * n_sms)


def min_block_k(group: int) -> int:
    """The smallest BLOCK_K the planes take: 4 * group (scale_planes: each of a lane quad's 4 slots
    of a plane, BLOCK_K / 8 bytes, must hold whole blocks of ``group`` elements)."""
    return 4 * group


def decode_config(M: int, N: int, K: int, device, fmt: str = "mxfp4", a16: bool = False) -> TileConfig:
    """The tile launch_fp4_decode launches on ``device`` for ``fmt`` ("nvfp4" / "mxfp4", ``a16``:
    W4A16) and tile_config reports: decode_tile with the device's SM count; under the interpreter
    wide tiles (few programs and K steps) with BLOCK_K >= min_block_k of the format's group (16
    nvfp4, 32 mxfp4)."""
    if interpreting():
        p = triton.next_power_of_2
        group = 16 if fmt == "nvfp4" else 32
        return TileConfig(BLOCK_M=16, BLOCK_N=min(256, max(16, p(N))),
                          BLOCK_K=min(512, max(64, min_block_k(group), p(K))), GROUP_M=1, num_warps=4, num_stages=1)
    return decode_tile(M, N, K, sm_count(device), fmt, a16)


def decode_applies(M: int, capability, a16: bool, a_dtype: torch.dtype) -> bool:
    """The decode kernel's domain: M <= 16 on sm_90 (no block-scaled MMA; SM12x has its own native
    path and tables), for W4A4 (nvfp4: fp16 planes; mxfp4: bf16 planes, E8M0 scales exceed fp16)
    and W4A16 with bf16 activations (fp16 ones keep the lesson's exact hi/lo split)."""
    if M < 1 or M > DECODE_MAX_M or capability is None or capability[0] != 9:
        return False
    if a16:
        return a_dtype == torch.bfloat16
    return True


def plane_layout(M: int, N: int, K: int, device, fmt: str, config: TileConfig | None = None) -> tuple[int, int, torch.dtype]:
    """(PLANE_K, K_pad, dtype) of the decoded W4A4 activation that launch_fp4_decode dots for ``fmt``
    ("nvfp4" / "mxfp4") with decode_config's tile: its BLOCK_K, K rounded up to it, and the dot dtype
    (fp16, value * 2^-14, for nvfp4; bf16 for mxfp4; float32 under the interpreter). The planes are
    a K-contiguous [M, K_pad] tensor of that dtype (check_planes); PLANE_K goes with them to the
    quantizer and to launch_fp4_decode (``plane_k``). ``config``: the tile the GEMM will launch (the
    route's), instead of decode_config's for the device.

    Raises ValueError for a ``fmt`` other than "nvfp4" / "mxfp4" (decode_tile; under the interpreter
    too)."""
    if fmt not in PLANE_DTYPES:
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4' for the FP4 decode planes, got {fmt!r}")
    bk = (config or decode_config(M, N, K, device, fmt)).BLOCK_K
    dt = torch.float32 if interpreting() else PLANE_DTYPES[fmt][0]
    return bk, triton.cdiv(K, bk) * bk, dt


def check_quantize_planes(x2, planes, plane_k, min_plane_k: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """The checks of the quantizers that write planes (nvfp4 / mxfp4 ``quantize_planes``): x2 2-D,
    plane_k a power of two >= min_plane_k (the decode GEMM's BLOCK_K), planes as check_planes.

    Raises ValueError naming x2, plane_k or planes, what it is and what is allowed."""
    if x2.dim() != 2:
        raise ValueError(f"x2 must be 2-D [M, K], got shape {tuple(x2.shape)}")
    if not isinstance(plane_k, int) or plane_k < min_plane_k or plane_k & (plane_k - 1):
        raise ValueError(f"plane_k must be a power of two >= {min_plane_k} (the decode GEMM's BLOCK_K), got {plane_k}")
    check_planes(planes, x2.shape[0], x2.shape[1], plane_k, dtypes, x2.device)


def check_planes(planes, M: int, K: int, plane_k: int, dtypes: tuple[torch.dtype, ...], device) -> None:
    """Refuse ``planes`` unless it is plane_layout's tensor for an [M, K] activation at ``plane_k``:
    a 2-D [M, cdiv(K, plane_k) * plane_k] tensor of one of ``dtypes``, K stride 1, rows not
    overlapping, on ``device``. The kernels write and read it by raw offsets up to these bounds, so
    anything else would be written out of bounds or read in the wrong order.

    Raises ValueError naming planes, what it is and what is allowed."""
    k_pad = triton.cdiv(K, plane_k) * plane_k
    allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    want = f"a K-contiguous 2-D {allowed} [{M}, {k_pad}] tensor on {device} (plane_layout at PLANE_K {plane_k})"
    if not isinstance(planes, torch.Tensor):
        raise ValueError(f"planes must be {want}, got {type(planes).__name__}")
    ok = (planes.dim() == 2 and tuple(planes.shape) == (M, k_pad) and planes.dtype in dtypes
          and planes.device == torch.device(device) and (k_pad == 0 or planes.stride(1) == 1)
          and (M <= 1 or planes.stride(0) >= k_pad))
    if not ok:
        raise ValueError(f"planes must be {want}, got {str(planes.dtype).removeprefix('torch.')} "
                         f"{list(planes.shape)} (strides {planes.stride()}) on {planes.device}")
