"""What the six lessons share besides the codecs (``_codecs``), top to bottom: the tiles (their
defaults; tuned ones come in as ``tile=`` from kernels_triton.tuning, which no lesson imports),
routes and launch recording, the GEMM path policy, the epilogue, the host checks."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from formats import FORMAT_NAMES, QuantizedTensor, spec
from formats import validate as _validate
from formats.layout import swizzled_size
from formats.moe import MOE_ACTIVATIONS
from formats.validate import check_bias  # noqa: F401  (the lessons' bias check, as it is)

from ._codecs import global_alpha, round_to_bf16_rne


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set and not "0")."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- Tiles ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """One GEMM launch configuration: the tile sizes and the compiler knobs."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"


def interpreter_config(M: int, N: int, K: int, *, block_k: Optional[int] = None, min_block_k: int = 32) -> TileConfig:
    """The tile under the interpreter, where a (program x K step) costs milliseconds of Python at any
    size: as large as the problem up to 256 x 256 x 512 (BLOCK_K >= min_block_k, or ``block_k``)."""
    p2 = triton.next_power_of_2
    bk = block_k or max(min_block_k, min(512, p2(max(K, 1))))
    return TileConfig(min(256, max(16, p2(M))), min(256, max(16, p2(N))), bk, GROUP_M=8, num_warps=4, num_stages=1)


def default_quant_tile(M: int, K: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of a quantizer program: as large as the problem under the interpreter (up
    to 256 x 1024), 32 x 128 on a GPU; BLOCK_K at least one scale ``group``."""
    if interpreting():
        return min(256, triton.next_power_of_2(max(M, 1))), max(group, min(1024, triton.next_power_of_2(K)))
    return 32, max(group, 128)


# -- Routes as data, and launch recording ---------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """The kernels one call launches: ``impl`` ("triton", "hopper", ...), ``kernels`` (the
    @triton.jit names in launch order), ``tile`` (str(TileConfig); "" without a GEMM), ``split_k``
    (1: none; the lessons never split K) and ``why`` (the rule and the values that decided it)."""

    impl: str
    kernels: tuple[str, ...]
    tile: str = ""
    split_k: int = 1
    why: str = ""

    def describe(self) -> str:
        """One line: kernels, tile, split-K and why."""
        tile = f" tile {self.tile}" if self.tile else ""
        split = f" SPLIT_K={self.split_k}" if self.split_k > 1 and "splitk" not in self.tile else ""
        return f"{self.impl}: {' -> '.join(self.kernels)}{tile}{split}: {self.why}"


_state = threading.local()


@contextlib.contextmanager
def record_launches() -> Iterator[list[str]]:
    """Collect the names of the kernels launched inside the block (this thread), in order."""
    prev, _state.log = getattr(_state, "log", None), []
    try:
        yield _state.log
    finally:
        _state.log = prev


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded under the kernel's function name."""
    if getattr(_state, "log", None) is not None:
        _state.log.append(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)))
    return kernel[grid](*args, **kwargs)


# -- The GEMM path: native (tl.dot_scaled on SM12x) or portable -----------------------------------
PATHS = ("native", "portable")
# weight-only (x stays bf16/fp16): W4A16 for the FP4 formats, W8A16 for mxfp8
A16_FORMATS = tuple(f for f in FORMAT_NAMES if spec(f).element == "e2m1" or f == "mxfp8")
TRITON_VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2])


def native_instruction(fmt: str) -> str:
    """The SM12x block-scaled MMA the native kernel of ``fmt`` lowers to (from its spec)."""
    s = spec(fmt)
    if s.element == "e2m1":
        vec = "4X ue4m3" if s.scale.startswith("e4m3") else "2X ue8m0"
        return f"mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::{vec}"
    unit = {"mxfp8": "", "fp8_block": " (unit scales + fp32 promotion per 128-K step; UE8M0 scales as E8M0 bytes)"}
    return "mma.sync m16n8k32 kind::mxf8f6f4.block_scale.scale_vec::1X ue8m0" + unit.get(fmt, " (unit E8M0 scales)")


def a16_name(fmt: str) -> str:
    """The weight-only mode's name: "W4A16" (e2m1 weights) or "W8A16" (e4m3 weights)."""
    return "W4A16" if spec(fmt).element == "e2m1" else "W8A16"


def _check_fmt(fmt: str, a16: bool) -> None:
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    if a16 and fmt not in A16_FORMATS:
        raise ValueError(f"a16=True (weight-only W4A16 / W8A16) exists for {A16_FORMATS}, got {fmt!r}")


def gemm_path(fmt: str, capability: Optional[tuple[int, int]], *, a16: bool = False) -> tuple[str, str]:
    """(path, reason): "native" (tl.dot_scaled) or "portable" (dequantize in registers), the GEMM
    path for ``fmt`` (FORMAT_NAMES; ``a16``: weight-only, A16_FORMATS) on a device of ``capability``
    ((major, minor); None: the interpreter). ValueError for an unknown fmt or a16 without a
    weight-only mode.
    Source: Triton's SM120 block-scaled lowering (triton#7918, #8494; SM121 #10010)."""
    _check_fmt(fmt, a16)
    # [gemm-path]
    if capability is None:
        return "portable", "no CUDA device: the Triton interpreter runs the portable decode-in-registers kernels"
    major, minor = int(capability[0]), int(capability[1])
    arch = f"sm_{major}{minor}"
    if a16:
        elem = spec(fmt).element
        return "portable", (f"{a16_name(fmt)} on {arch}: bf16 x decoded-weight tl.dot. The block-scaled MMA "
                            f"takes FP8xFP8 or FP4xFP4 only; Triton lowers dot_scaled(bf16, {elem}) by upcasting "
                            "the weight to bf16 anyway, which is what this kernel does, exactly")
    if major == 12:
        need = (3, 8) if minor == 1 else (3, 6)
        if TRITON_VERSION < need:
            return "portable", (f"{arch}: Triton {triton.__version__} does not lower dot_scaled natively there "
                                f"(needs {need[0]}.{need[1]}+: triton#8494, #10010)")
        return "native", f"{arch} has block-scaled MMA: tl.dot_scaled -> {native_instruction(fmt)}"
    return "portable", (f"{arch} has no block-scaled MMA that Triton targets here; Triton would emulate "
                        "dot_scaled by upcasting to bf16, which the portable kernel does explicitly and exactly")
    # [/gemm-path]


def route_path(path: Optional[str], fmt: str, capability: Optional[tuple[int, int]], *,
               a16: bool = False) -> tuple[str, str]:
    """(path, why) on a device of ``capability``: ``path`` when forced ("native" | "portable"), else
    gemm_path's; the one place a forced path is checked. ValueError for an unknown fmt or path, a16
    without a weight-only mode, or a native path that cannot be: weight-only; NVFP4 under the interpreter (its
    dot_scaled decodes e4m3 scales as E8M0) or off SM12x with Triton < 3.7 (triton#7549)."""
    if path is None:
        return gemm_path(fmt, capability, a16=a16)
    if path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    _check_fmt(fmt, a16)
    if path == "native":
        if a16:
            raise ValueError(f"{fmt} {a16_name(fmt)} has no native kernel: {gemm_path(fmt, (12, 0), a16=True)[1]}")
        if spec(fmt).scale.startswith("e4m3"):  # nvfp4
            if capability is None:
                raise ValueError(f"{fmt} path='native' cannot run under the Triton interpreter: its dot_scaled "
                                 "decodes e4m3 scales as E8M0 (the result would be wrong)")
            if capability[0] != 12 and TRITON_VERSION < (3, 7):
                raise ValueError(f"{fmt} path='native' does not compile on sm_{capability[0]}{capability[1]} with "
                                 f"Triton {triton.__version__} (triton#7549, fixed in 3.7)")
    return path, f"path={path!r} forced"


def device_capability(device) -> Optional[tuple[int, int]]:
    """The capability of a tensor's device, or None for CPU / the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return tuple(torch.cuda.get_device_capability(device))


# -- The epilogue: acc * alpha + bias -------------------------------------------------------------
@triton.jit
def epilogue(acc, offs_n, n_ok, s1_ptr, s2_ptr, bias_ptr, TENSOR_SCALES: tl.constexpr,
             GLOBAL_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 times alpha, plus bias[offs_n] (any float dtype, added in fp32),
    rounded to bf16 values (RNE) when ROUND_BF16 (the interpreter's fp32 -> bf16 cast truncates).
    alpha is 1, or s1 * s2 with TENSOR_SCALES (fp8_tensor's two scales meet first: acc * s1 alone
    can overflow), or (1 / s1) * (1 / s2) with GLOBAL_SCALES (nvfp4's global scales, read from device
    tensors: no host sync; NaN unless both are finite and > 0, _codecs.global_alpha)."""
    if TENSOR_SCALES:
        acc = acc * (tl.load(s1_ptr) * tl.load(s2_ptr))
    if GLOBAL_SCALES:
        acc = acc * global_alpha(tl.load(s1_ptr), tl.load(s2_ptr))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_to_bf16_rne(acc)
    return acc


# -- Host-side checks shared by the wrappers ------------------------------------------------------
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NATIVE_SCALE_LAYOUTS = ("linear", "swizzled_128x4")


def check_activation(x, k: Optional[int], k_multiple: int, fmt: str, device=None) -> None:
    """formats.validate.check_activation (x bf16/fp16 [..., K], K == k when k, K % k_multiple == 0)."""
    _validate.check_activation(x, k, fmt, device=device, k_multiple=k_multiple)


def check_weight(qweight, fmt: str, path: Optional[str] = None) -> None:
    """formats.validate.check_weight: linear scales, swizzled 128x4 too on a forced native path."""
    _validate.check_weight(qweight, fmt, layouts=NATIVE_SCALE_LAYOUTS if path == "native" else ("linear",))


def check_out_dtype(out_dtype) -> None:
    """ValueError unless out_dtype is one of OUT_DTYPES (bf16, fp16, fp32)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def check_linear(x, qweight, bias, fmt: str, k_multiple: int, path: Optional[str] = None) -> None:
    """A lesson linear's checks: the weight (check_weight), x (its K, on its device), the bias."""
    check_weight(qweight, fmt, path)
    check_activation(x, qweight.k, k_multiple, fmt, device=qweight.device)
    check_bias(bias, qweight.shape[0], qweight.device)


def check_gemm_operands(xq, qweight, bias, out_dtype, fmt: str, path: Optional[str] = None) -> tuple[int, int, int]:
    """(M, N, K) of a ``fmt`` GEMM's operands; ValueError naming the argument for a weight that is
    not a ``fmt`` weight (check_weight), an xq that is not a ``fmt`` activation with linear scales,
    a K or device mismatch, a bad out_dtype or bias."""
    check_weight(qweight, fmt, path)
    if not isinstance(xq, QuantizedTensor) or xq.role != "activation" or xq.fmt != fmt:
        got = f"a {xq.fmt} {xq.role}" if isinstance(xq, QuantizedTensor) else type(xq).__name__
        raise ValueError(f"xq must be a {fmt} activation QuantizedTensor, got {got}")
    if xq.scale_layout != "linear":
        raise ValueError(f"xq.scale_layout must be 'linear', got {xq.scale_layout!r}")
    n, k = qweight.shape
    if xq.k != k:
        raise ValueError(f"xq has K={xq.k} but qweight has K={k}; they must match")
    if xq.device != qweight.device:
        raise ValueError(f"xq must be on the weight's device {qweight.device}, got {xq.device}")
    check_out_dtype(out_dtype)
    check_bias(bias, n, qweight.device)
    return xq.rows, n, k


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_moe_call(x, topk_ids, topk_weights, *, E: int, H: int, I: int, fmt: str, device, activation: str,
                   w13_bias=None, w2_bias=None) -> None:
    """An MoE call's checks against its prepared experts (E experts of W13 [2I, H] and W2 [H, I] in
    ``fmt`` on ``device``), shared by the MoE lesson's fused_moe and the sm_90 MoE's: x bf16/fp16
    [M, H] on the device; topk_ids an integer tensor [M, top_k >= 1] on the device with every value
    in [0, E) (read: a device synchronization); topk_weights a float tensor of topk_ids' shape on the
    device; activation one of formats.MOE_ACTIVATIONS; w13_bias / w2_bias None or float [E, 2I] /
    [E, H] on the device. ValueError naming the argument, the value found and what is allowed."""
    check_activation(x, H, 1, fmt, device=device)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, H], got shape {tuple(x.shape)}")
    ids, wts = topk_ids, topk_weights
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 2 \
            or ids.shape[0] != x.shape[0] or ids.shape[1] < 1 or ids.device != device:
        raise ValueError(f"topk_ids must be an integer tensor [M={x.shape[0]}, top_k >= 1] on {device}, got "
                         f"{_desc(ids)}" + (f" on {ids.device}" if isinstance(ids, torch.Tensor) else ""))
    if not isinstance(wts, torch.Tensor) or not wts.is_floating_point() or wts.shape != ids.shape \
            or wts.device != device:
        raise ValueError(f"topk_weights must be a float tensor of topk_ids' shape {tuple(ids.shape)} on {device}, got "
                         f"{_desc(wts)}" + (f" on {wts.device}" if isinstance(wts, torch.Tensor) else ""))
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < E:
        raise ValueError(f"topk_ids must lie in [0, {E}) (the expert count), got [{int(ids.min())}, {int(ids.max())}]")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    for name, b, n in (("w13_bias", w13_bias, 2 * I), ("w2_bias", w2_bias, H)):
        if b is not None and not (isinstance(b, torch.Tensor) and b.is_floating_point() and b.shape == (E, n)
                                  and b.device == device):
            raise ValueError(f"{name} must be a float tensor ({E}, {n}) on {device}, got {_desc(b)}")


def check_sizes(M: int, N: int, K: int) -> None:
    """ValueError unless M, N and K are >= 0."""
    if min(M, N, K) < 0:
        raise ValueError(f"M, N, K must be >= 0, got {(M, N, K)}")


def kernel_bias(bias):
    """The bias contiguous (the kernels read ``bias_ptr + offs_n``), in its own dtype (widened in fp32)."""
    return None if bias is None else bias.contiguous()


def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K]; a view when the strides allow it (the kernels take both strides)."""
    return x.reshape(-1, x.shape[-1])


def weight_scale_bytes(qweight: QuantizedTensor, fmt: str, vec_size: int) -> tuple[torch.Tensor, bool]:
    """(scale bytes as uint8, swizzled?) of a weight with 1-byte block scales, linear [N, K/vec_size]
    or flat swizzled 128x4; ValueError for another layout or a swizzled buffer of the wrong size."""
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
