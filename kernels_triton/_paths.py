"""Which GEMM each format runs on a device: the native block-scaled path or the portable one.

native    ``tl.dot_scaled``: on SM120/SM121 Triton lowers it to the block-scaled tensor-core
          instruction (``mma.sync ... block_scale``), which applies the per-block scales inside
          the MMA. Elsewhere Triton emulates it (sm_90: operands upcast to bf16, then wgmma).
portable  decode in registers: every operand tile is decoded to exact bf16 (fp32 under the
          interpreter) with its scales applied, then a plain ``tl.dot`` (or an fp8 ``tl.dot`` of
          the codes for the e4m3 formats). Right on GPUs without block-scaled MMA (Hopper, Ada).

``gemm_path`` is a pure function of the format and the capability, so a dispatcher can report the
choice without a GPU; the kernels call ``resolve_path`` with the operand's device.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from formats import FORMAT_NAMES, QuantizedTensor, spec

from ._common import check_weight, interpreting

PATHS = ("native", "portable")
# W4A16 exists for the formats with e2m1 elements (weight-only FP4); derived, not listed.
A16_FORMATS = tuple(f for f in FORMAT_NAMES if spec(f).element == "e2m1")


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def native_instruction(fmt: str) -> str:
    """The SM12x tensor-core instruction the native kernel of ``fmt`` lowers to (from its spec)."""
    s = spec(fmt)
    if s.element == "e4m3":
        unit = "" if fmt == "mxfp8" else " (unit E8M0 scales, byte 127)"
        if fmt == "fp8_block":
            unit = " (unit scales + fp32 promotion per 128-K step; UE8M0 scales as E8M0 bytes)"
        return f"mma.sync m16n8k32 kind::mxf8f6f4.block_scale.scale_vec::1X ue8m0{unit}"
    if s.scale.startswith("e4m3"):
        return "mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::4X ue4m3"
    return "mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::2X ue8m0"


def _check_fmt(fmt: str, a16: bool) -> None:
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    if a16 and fmt not in A16_FORMATS:
        raise ValueError(f"a16=True (W4A16) exists for {A16_FORMATS}, got {fmt!r}")


def gemm_path(fmt: str, capability: Optional[tuple[int, int]], *, a16: bool = False) -> tuple[str, str]:
    """The GEMM path the Triton kernels take for ``fmt`` on a device, and why.

    Args:
        fmt: one of formats.FORMAT_NAMES.
        capability: CUDA compute capability (major, minor), or None for no CUDA device (the
            Triton interpreter).
        a16: W4A16 (bf16/fp16 activations, FP4 weights; nvfp4 and mxfp4 only).
    Returns:
        (path, reason): path "native" (tl.dot_scaled) or "portable" (decode in registers).
    Raises:
        ValueError: unknown fmt, or a16 for a format without W4A16.
    Source: Triton's SM120 block-scaled lowering (triton#7918 MXFP8, #8494 MXFP4/NVFP4, #10010
    SM121); shared/notes/triton.md.
    """
    _check_fmt(fmt, a16)
    # [gemm-path]
    if capability is None:
        return "portable", ("no CUDA device: the Triton interpreter runs the portable decode-in-registers "
                            "kernels (its dot_scaled decodes e4m3 scales as E8M0)")
    major, minor = int(capability[0]), int(capability[1])
    arch = f"sm_{major}{minor}"
    if a16:
        return "portable", (f"W4A16 on {arch}: bf16 x decoded-weight tl.dot. The block-scaled MMA takes "
                            "FP8xFP8 or FP4xFP4 only; Triton lowers dot_scaled(bf16, e2m1) by upcasting the "
                            "weight to bf16 anyway, which is what this kernel does, exactly")
    if major == 12:
        need = (3, 8) if minor == 1 else (3, 6)
        if _triton_version() < need:
            return "portable", (f"{arch}: Triton {triton.__version__} does not lower dot_scaled natively there "
                                f"(needs {need[0]}.{need[1]}+: triton#8494, #10010)")
        return "native", f"{arch} has block-scaled MMA: tl.dot_scaled -> {native_instruction(fmt)}"
    return "portable", (f"{arch} has no block-scaled MMA that Triton targets here; Triton would emulate "
                        "dot_scaled by upcasting to bf16, which the portable kernel does explicitly and exactly")
    # [/gemm-path]


def device_capability(device) -> Optional[tuple[int, int]]:
    """The capability of a tensor's device, or None for CPU / the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def is_sm90(device) -> bool:
    """Whether ``device`` is a Hopper (sm_90) GPU: False on the CPU and under the interpreter
    (device_capability), where the sm_90 performance kernels never run."""
    cap = device_capability(device)
    return cap is not None and cap[0] == 9


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (split-K targets); 1 on CPU / the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_device() -> torch.device:
    """The device this process's kernels run on when none is given: the current GPU, else the CPU."""
    if torch.cuda.is_available() and not interpreting():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_path(path: Optional[str], fmt: str, device, *, a16: bool = False) -> str:
    """The path a call takes: ``path`` when forced ("native" | "portable"), else gemm_path's choice
    for ``device``. ValueError for an unknown path or a forced native path that would be wrong or
    cannot exist there (W4A16; NVFP4 under the interpreter, whose dot_scaled decodes e4m3 scales as
    E8M0; NVFP4 on a non-SM12x GPU with Triton < 3.7, where it does not compile: triton#7549)."""
    if path is None:
        return gemm_path(fmt, device_capability(device), a16=a16)[0]
    if path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    _check_fmt(fmt, a16)
    if path == "native":
        if a16:
            raise ValueError(f"{fmt} W4A16 has no native kernel: {gemm_path(fmt, (12, 0), a16=True)[1]}")
        if spec(fmt).scale.startswith("e4m3"):  # nvfp4
            cap = device_capability(device)
            if cap is None:
                raise ValueError(f"{fmt} path='native' cannot run under the Triton interpreter: its dot_scaled "
                                 "decodes e4m3 scales as E8M0 (the result would be wrong)")
            if cap[0] != 12 and _triton_version() < (3, 7):
                raise ValueError(f"{fmt} path='native' does not compile on sm_{cap[0]}{cap[1]} with Triton "
                                 f"{triton.__version__} (triton#7549, fixed in 3.7)")
    return path


NATIVE_SCALE_LAYOUTS = ("linear", "swizzled_128x4")


def weight_scale_bytes(qweight: QuantizedTensor, fmt: str, vec_size: int) -> tuple[torch.Tensor, bool]:
    """(scale bytes as uint8, swizzled?) of a weight with 1-byte block scales (nvfp4, mxfp4, mxfp8),
    linear [N, K/vec_size] or flat swizzled 128x4. ValueError for another layout or a swizzled
    buffer of the wrong size."""
    from formats.layout import swizzled_size

    n, k = qweight.shape
    if qweight.scale_layout == "linear":
        return qweight.scale.contiguous().view(torch.uint8), False
    if qweight.scale_layout != "swizzled_128x4":
        raise ValueError(f"qweight.scale_layout must be one of {NATIVE_SCALE_LAYOUTS}, got {qweight.scale_layout!r}")
    need = swizzled_size(n, k // vec_size)
    if qweight.scale.dim() != 1 or qweight.scale.numel() != need:
        raise ValueError(f"{fmt} swizzled_128x4 weight scales must be 1-D with {need} bytes for [{n}, {k}], "
                         f"got shape {tuple(qweight.scale.shape)}")
    return qweight.scale.contiguous().view(torch.uint8), True


def check_native_weight(qweight, fmt: str, path: Optional[str]) -> None:
    """check_weight, except that a forced native path also takes swizzled 128x4 weight scales."""
    check_weight(qweight, fmt, layouts=NATIVE_SCALE_LAYOUTS if path == "native" else ("linear",))
