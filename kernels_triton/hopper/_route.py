"""What every Hopper route is made of: the lessons' TileConfig and Route with the production
machinery the lessons leave out (split-K, the dequantizing pre-pass, the launch options a route
hands to its launcher), the SM count split-K aims at, the checks each format module's route and
wrappers open with, and two small host helpers of the e4m3 kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from formats.validate import BIAS_DTYPES  # noqa: F401  (the bias dtypes the e4m3 decode launcher takes)

from .. import _common
from .._common import device_capability, interpreting
from . import supported


@dataclass(frozen=True)
class TileConfig(_common.TileConfig):
    """A lesson tile plus split-K and the pre-pass.

    SPLIT_K > 1: SPLIT_K programs share one output tile, each summing K / SPLIT_K of it into an fp32
    workspace that a second kernel adds up in a fixed order (deterministic): for decode-sized M,
    where one program per output tile leaves most SMs idle. PREPASS: the dequantizing formats
    dequantize each operand once into bf16 scratch, then a plain bf16 GEMM runs (large M, where the
    fused kernel would dequantize every weight tile again M / BLOCK_M times)."""

    SPLIT_K: int = 1
    PREPASS: bool = False

    def __str__(self) -> str:
        s = super().__str__()
        if self.SPLIT_K > 1:
            s += f" splitk{self.SPLIT_K}"
        if self.PREPASS:
            s += " prepass+bf16gemm"
        return s


@dataclass(frozen=True)
class Route(_common.Route):
    """A lesson Route plus ``options``: (name, value) pairs the route's launcher reads (the GEMM
    plan and its TileConfig) and the Triton specialization classes of the M-derived ints it passes
    (kernels_triton.tuning.int_specialization), so a warmup can cover every compile."""

    options: tuple[tuple[str, object], ...] = ()


def e4m3_operand(data: torch.Tensor, dot_fp8: bool) -> torch.Tensor:
    """The e4m3 codes as float8_e4m3fn when the GPU dots them directly, as uint8 when the kernel
    dequantizes them first (the interpreter)."""
    return data if dot_fp8 else data.view(torch.uint8)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (split-K targets); 1 on CPU / the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


WEIGHT_ONLY = ("nvfp4", "mxfp4", "mxfp8")  # the formats with an a16=True (W4A16 / W8A16) route here


def check_route(fmt: str, capability, a16: bool, M: int, N: int, K: int) -> None:
    """The checks a route of the e4m3 formats opens with: ValueError for a capability other than
    sm_90 (naming it and why), a16=True for a format without a weight-only mode (WEIGHT_ONLY) or a
    negative size."""
    ok, why = supported(capability)
    if not ok:
        raise ValueError(f"kernels_triton.hopper.{fmt} runs on sm_90 only: {why}")
    if a16 and fmt not in WEIGHT_ONLY:
        raise ValueError(f"a16=True (W4A16 / W8A16) exists for {', '.join(WEIGHT_ONLY)}, got {fmt!r}")
    _common.check_sizes(M, N, K)


def check_sm_count_and_x_dtype(sm_count, x_dtype) -> None:
    """A route's planning inputs: ValueError unless ``sm_count`` is an int >= 1 (the device's SMs,
    the split-K target) and ``x_dtype`` torch.bfloat16 or torch.float16."""
    if not isinstance(sm_count, int) or sm_count < 1:
        raise ValueError(f"sm_count must be an int >= 1, got {sm_count!r}")
    if x_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x_dtype must be torch.bfloat16 or torch.float16, got {x_dtype}")


def check_device(fmt: str, device) -> tuple:
    """The capability of ``device``; ValueError naming it unless it is an sm_90 GPU."""
    cap = device_capability(device)
    ok, why = supported(cap)
    if not ok:
        raise ValueError(f"kernels_triton.hopper.{fmt} runs on sm_90 only, got a tensor on {device}: {why}")
    return cap
