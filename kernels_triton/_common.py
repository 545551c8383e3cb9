"""What the lessons (fp8_tensor, fp8_block, mxfp8, nvfp4, mxfp4) share on the host and in the
epilogue: the tile configuration, routes and launch recording, the GEMM path policy, the SM12x tile
tables, host-side checks, and the epilogue (alpha and bias). The ``@triton.jit`` element codecs
live in ``_codecs``; together these two modules are everything a lesson imports from the package.

Sections, top to bottom:
    TileConfig          one GEMM launch configuration
    Route, launch       routes as data: which kernels a call launches, with which tile, and why;
                        ``launch`` records every kernel launched so tests can compare the two
    gemm_path           native (tl.dot_scaled on SM12x) or portable (dequantize in registers)
    SM12x tiles         the native kernels' tile tables
    tiles               the interpreter's whole-problem tiles and the activation quantizer's tile
    epilogue            acc * alpha + bias, rounded for a bf16 store under the interpreter
    host checks         activation, weight, bias, GEMM operands, out_dtype
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from formats import FORMAT_NAMES, QuantizedTensor, spec
from formats import validate as _validate
from formats.layout import swizzled_size

from . import interpreting  # noqa: F401  (defined next to where the package sets TRITON_INTERPRET)
from ._codecs import round_to_bf16_rne, global_alpha
from ._codecs import (  # noqa: F401  (re-exported for modules that import the codecs from here)
    abs_or_inf, amax_or_nan, ceil_log2, dequantize_e2m1, dequantize_e4m3, dequantize_e4m3_finite,
    dequantize_e8m0, encode_e2m1, encode_e4m3, exp2_int, floor_log2, grouped_tile, nan_if_nonfinite,
    scale_offsets,
)



# ---------------------------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """One GEMM launch configuration: tile sizes and the compiler knobs."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # SPLIT_K > 1: SPLIT_K programs share one output tile, each summing K / SPLIT_K of it into an
    # fp32 workspace that a second kernel adds up in a fixed order (deterministic). For decode-sized
    # M, where one program per output tile leaves most SMs idle.
    SPLIT_K: int = 1
    # PREPASS: the dequantizing formats dequantize each operand once into a bf16 scratch matrix, then a
    # plain bf16 GEMM runs (large M, where the fused kernel would dequantize every weight tile again
    # M / BLOCK_M times).
    PREPASS: bool = False

    def __str__(self) -> str:
        s = f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"
        if self.SPLIT_K > 1:
            s += f" splitk{self.SPLIT_K}"
        if self.PREPASS:
            s += " prepass+bf16gemm"
        return s


#


# ---------------------------------------------------------------------------------------------
# Routes as data, and launch recording
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """The kernels one call launches, in order, and why.

    impl: the implementation ("triton", "hopper").
    kernels: the ``@triton.jit`` function names launched, in launch order (e.g.
        ("_quantize_kernel", "_gemm_kernel")); a kernel launched twice appears twice.
    tile: the GEMM tile as text (``TileConfig.__str__``: "BMxBNxBK wW sS [splitkN]"), or "" when the
        route launches no GEMM with a tile of its own.
    split_k: the split-K factor launched (1: none; > 1: a partial-sum workspace and a reduce kernel).
    why: one sentence saying why this route (the rule and the values that decided it).
    """

    impl: str
    kernels: tuple[str, ...]
    tile: str = ""
    split_k: int = 1
    why: str = ""
    options: tuple[tuple[str, object], ...] = field(default=())

    def describe(self) -> str:
        """One line: kernels, tile, split-K and why."""
        tile = f" tile {self.tile}" if self.tile else ""
        split = f" SPLIT_K={self.split_k}" if self.split_k > 1 and "splitk" not in self.tile else ""
        return f"{self.impl}: {' -> '.join(self.kernels)}{tile}{split}: {self.why}"


_state = threading.local()


def launched(name: str) -> None:
    """Record that kernel ``name`` was launched (a no-op unless record_launches() is active)."""
    log: Optional[list] = getattr(_state, "log", None)
    if log is not None:
        log.append(name)


@contextlib.contextmanager
def record_launches() -> Iterator[list[str]]:
    """Collect the names of the kernels launched inside the block (this thread), in order."""
    prev = getattr(_state, "log", None)
    log: list[str] = []
    _state.log = log
    try:
        yield log
    finally:
        _state.log = prev


def int_specialization(n: int) -> str:
    """How Triton specializes an int kernel argument: "1" (== 1), "16" (divisible by 16) or "" (any
    other value); a kernel compiles once per class. Routes report the class of the M-derived ints a
    launch passes (e.g. the amax partial count), so a warmup can cover every compile a token count
    can cause."""
    return "1" if n == 1 else ("16" if n % 16 == 0 else "")


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded under the kernel's function name."""
    launched(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)))
    return kernel[grid](*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The GEMM path: native (tl.dot_scaled on SM12x) or portable
# ---------------------------------------------------------------------------------------------
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
        (path, reason): path "native" (tl.dot_scaled) or "portable" (dequantize in registers).
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


THIS_DEVICE = "this device"  # a capability argument's default where it means this process's device


def device_capability(device) -> Optional[tuple[int, int]]:
    """The capability of a tensor's device, or None for CPU / the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return tuple(torch.cuda.get_device_capability(device))




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


def route_path(path: Optional[str], fmt: str, capability: Optional[tuple[int, int]], *,
               a16: bool = False) -> tuple[str, str]:
    """(path, why) a call takes on a device of ``capability`` (None: the interpreter): ``path`` when
    forced ("native" | "portable"), else gemm_path's choice. A pure function (routes use it).

    Raises:
        ValueError: an unknown fmt or path, or a forced native path that would be wrong or cannot
            exist there (W4A16; NVFP4 under the interpreter, whose dot_scaled reads e4m3 scales as
            E8M0; NVFP4 on a non-SM12x GPU with Triton < 3.7, where it does not compile: triton#7549).
    """
    if path is None:
        return gemm_path(fmt, capability, a16=a16)
    if path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    _check_fmt(fmt, a16)
    if path == "native":
        if a16:
            raise ValueError(f"{fmt} W4A16 has no native kernel: {gemm_path(fmt, (12, 0), a16=True)[1]}")
        if spec(fmt).scale.startswith("e4m3"):  # nvfp4
            if capability is None:
                raise ValueError(f"{fmt} path='native' cannot run under the Triton interpreter: its dot_scaled "
                                 "decodes e4m3 scales as E8M0 (the result would be wrong)")
            if capability[0] != 12 and _triton_version() < (3, 7):
                raise ValueError(f"{fmt} path='native' does not compile on sm_{capability[0]}{capability[1]} with "
                                 f"Triton {triton.__version__} (triton#7549, fixed in 3.7)")
    return path, f"path={path!r} forced"


def resolve_path(path: Optional[str], fmt: str, device, *, a16: bool = False) -> str:
    """route_path's path for ``device`` (its capability; None on the CPU and under the interpreter)."""
    return route_path(path, fmt, device_capability(device), a16=a16)[0]


NATIVE_SCALE_LAYOUTS = ("linear", "swizzled_128x4")


def weight_scale_bytes(qweight: QuantizedTensor, fmt: str, vec_size: int) -> tuple[torch.Tensor, bool]:
    """(scale bytes as uint8, swizzled?) of a weight with 1-byte block scales (nvfp4, mxfp4, mxfp8),
    linear [N, K/vec_size] or flat swizzled 128x4. ValueError for another layout or a swizzled
    buffer of the wrong size."""
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


# ---------------------------------------------------------------------------------------------
# SM12x tile tables (RTX PRO 6000 / RTX 5090 / RTX 5080: sm_120, DGX Spark GB10: sm_121)
# ---------------------------------------------------------------------------------------------
# The parts: 101,376 B of shared memory per block, warp-level ``mma.sync`` only (no wgmma/tcgen05),
# at most 1536 threads per SM, and 188 / 170 / 84 / 48 SMs. Triton 3.9 keeps num_stages - 1 operand
# buffers in shared memory on sm_120, so a tile costs (num_stages - 1) * (BLOCK_M + BLOCK_N) * BLOCK_K
# bytes of 8-bit operands (half that for packed e2m1, twice for bf16) plus the scales; every entry
# fits even with all num_stages buffers (a Triton version that keeps them all). The compile test
# (tests/kernels_triton/test_sm12x_compile.py) checks each entry against Triton's allocation and
# ptxas' report (registers, spills) for both arches; docs/results.md has the table.
#
# Kinds (what the operands are; each kind's kernels share a BLOCK_K):
#     e4m3           native dot_scaled on e4m3 codes: fp8_tensor, mxfp8, fp8_block with UE8M0 scales
#     fp8_block      native fp8_block with fp32 scales (BLOCK_K must be 128: one scale per K step)
#     e2m1           native dot_scaled on packed e2m1: nvfp4, mxfp4 (BLOCK_K >= 64: triton#11776; 256
#                    spills past 64 x 64 tiles)
#     e2m1_portable  the portable FP4 kernel (W4A16, and W4A4 when forced): operands dequantized in
#                    registers, so a shorter BLOCK_K keeps the fp32 tiles inside the register file;
#                    large M takes the dequantizing pre-pass and a bf16 GEMM
#
# By M: decode (M <= 16), small (M <= 64), medium one program per tile (8 warps: with 4, a 64 x 128
# fp32 accumulator plus the scale handling spills), large 128 x 128 with 8 warps. One program per
# output tile (the lessons do not split K). Measured on no SM12x part yet: the tables are sized,
# compiled and resource-checked, not tuned.
SM12X_SMEM_PER_BLOCK = 101_376  # bytes (99 KiB opt-in per block on SM120/SM121)
SM12X_SM_COUNTS = (188, 170, 84, 48)  # RTX PRO 6000, RTX 5090, RTX 5080, GB10
KINDS = ("e4m3", "fp8_block", "e2m1", "e2m1_portable")
_BLOCK_K = {"e4m3": 128, "fp8_block": 128, "e2m1": 128, "e2m1_portable": 64}
PREPASS_MIN_M = 128  # e2m1_portable: above this M, dequantize the weight once, then a bf16 GEMM

# name -> (M upper bound, tile); the first row whose bound covers M is taken
_NATIVE_ROWS = (
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", 256, dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
    ("large", None, dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
)
_PORTABLE_FP4_ROWS = (
    ("decode", 16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    ("small", 64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    ("medium", PREPASS_MIN_M, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
    # the bf16 GEMM after the dequantizing pre-pass: 2 * (128 + 128) * 64 * 2 B = 64 KiB
    ("prepass", None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
                           PREPASS=True)),
)


def _rows(kind: str):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "e2m1_portable":
        return _PORTABLE_FP4_ROWS
    return tuple((name, bound, {**t, "BLOCK_K": _BLOCK_K[kind]}) for name, bound, t in _NATIVE_ROWS)


def sm12x_config(kind: str, M: int, N: int, K: int, sm_count: int = 1) -> TileConfig:
    """The SM12x tile for an [M, K] x [N, K]^T GEMM of ``kind``: the first row of the ``kind``
    table whose M bound covers M. ``N``, ``K`` and ``sm_count`` do not change the choice (one program
    per output tile). ValueError for an unknown kind."""
    for name, bound, t in _rows(kind):
        if bound is None or M <= bound:
            return TileConfig(**t)
    raise AssertionError("unreachable: the last row has no bound")


def sm12x_entries(kind: str) -> dict[str, TileConfig]:
    """Every row of the ``kind`` table by name (what the compile test builds)."""
    return {name: TileConfig(**t) for name, _, t in _rows(kind)}


# ---------------------------------------------------------------------------------------------
# Interpreter tiles and the activation quantizer's tile
# ---------------------------------------------------------------------------------------------
def interpreter_config(M: int, N: int, K: int, *, block_k: Optional[int] = None) -> TileConfig:
    """The GEMM tile under the interpreter, where each (program x K step) costs milliseconds of
    Python whatever the tile size: as large as the problem, up to 256 x 256 and K 512 per step.
    ``block_k`` forces BLOCK_K (fp8_block with fp32 scales needs exactly 128: one scale per K step)."""
    bm = min(256, max(16, triton.next_power_of_2(M)))
    bn = min(256, max(16, triton.next_power_of_2(N)))
    bk = block_k or min(512, max(32, triton.next_power_of_2(K)))
    return TileConfig(bm, bn, bk, GROUP_M=8, num_warps=4, num_stages=1)


def native_config(M: int, N: int, K: int, capability: Optional[tuple[int, int]] = None, *, kind: str = "e4m3",
                  block_k: Optional[int] = None) -> TileConfig:
    """Tile of a native (tl.dot_scaled) GEMM: the SM12x table of ``kind`` on a GPU (``capability``
    not None), the interpreter's whole-problem tile otherwise (``block_k`` forces BLOCK_K there)."""
    if capability is None:
        return interpreter_config(M, N, K, block_k=block_k)
    return sm12x_config(kind, M, N, K)


def e4m3_portable_config(M: int, N: int, K: int, capability: Optional[tuple[int, int]], *,
                          block_k: Optional[int] = None) -> TileConfig:
    """The portable e4m3 GEMM's tile (fp8_tensor, fp8_block, mxfp8 lessons): the interpreter's
    whole-problem tile when ``capability`` is None; on a GPU, by M (one program per output tile):
    M <= 16: 16 x 64, 4 stages; M <= 64: 64 x 64; M <= 256: 64 x 128; larger: 128 x 128 with 8 warps;
    BLOCK_K ``block_k`` or 128 (fp8_block needs 128: one scale per K step)."""
    if capability is None:
        return interpreter_config(M, N, K, block_k=block_k)
    bk = block_k or 128
    if M <= 16:
        return TileConfig(16, 64, bk, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 64:
        return TileConfig(64, 64, bk, GROUP_M=8, num_warps=4, num_stages=3)
    if M <= 256:
        return TileConfig(64, 128, bk, GROUP_M=8, num_warps=4, num_stages=3)
    return TileConfig(128, 128, bk, GROUP_M=8, num_warps=8, num_stages=3)


QUANT_DECODE_ROW_BLOCK = 1024  # decode (M <= 16) activation quantizer: one row per program, this wide


def quant_config(M: int, K: int, interpreting: bool, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of an activation-quantization tile; BLOCK_K is a multiple of ``group``.

    Under the interpreter one tile covers up to 256 rows and 1024 columns. On GPU, decode
    (M <= 16) quantizes one row per program, QUANT_DECODE_ROW_BLOCK wide (fp8_block takes only
    BLOCK_M and keeps one 128 group per program): a 32-row tile would leave most of each program
    masked, and the quantizer is latency bound there; larger M takes 32 x 128 tiles."""
    if interpreting:
        return min(256, triton.next_power_of_2(max(M, 1))), max(group, min(1024, triton.next_power_of_2(K)))
    if M <= 16:
        return 1, max(group, QUANT_DECODE_ROW_BLOCK)
    return 32, max(group, 128)


# ---------------------------------------------------------------------------------------------
# The epilogue: acc * alpha + bias
# ---------------------------------------------------------------------------------------------
# ALPHA_MODE (constexpr): what multiplies the fp32 accumulator before the bias
ALPHA_NONE = 0          # 1: every scale was applied in the K loop
ALPHA_SCALES = 1        # s1 * s2: fp8_tensor's two per-tensor scales (they meet first: acc * s1
                        # alone can overflow where the result does not)
ALPHA_GLOBAL_RECIP = 2  # (1 / s1) * (1 / s2): nvfp4's global scales, read from device tensors (no
                        # host sync); NaN unless both are finite and > 0 (_codecs.global_alpha)
NO_ALPHA = tl.constexpr(ALPHA_NONE)  # for kernels that call epilogue() with every scale already applied
_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)
_ALPHA_GLOBAL_RECIP = tl.constexpr(ALPHA_GLOBAL_RECIP)


@triton.jit
def epilogue(acc, offs_n, n_ok, s1_ptr, s2_ptr, bias_ptr,
             ALPHA_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 * alpha (ALPHA_MODE) + bias[offs_n] (any float dtype, added in
    fp32), rounded to bf16 values (RNE) when ROUND_BF16 (the interpreter's fp32 -> bf16 cast truncates)."""
    if ALPHA_MODE == _ALPHA_SCALES:
        acc = acc * (tl.load(s1_ptr) * tl.load(s2_ptr))
    if ALPHA_MODE == _ALPHA_GLOBAL_RECIP:
        acc = acc * global_alpha(tl.load(s1_ptr), tl.load(s2_ptr))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_to_bf16_rne(acc)
    return acc


# ---------------------------------------------------------------------------------------------
# Host-side checks shared by the wrappers
# ---------------------------------------------------------------------------------------------
ACT_DTYPES = _validate.ACT_DTYPES


def check_activation(x, k: int, k_multiple: int, fmt: str, device=None) -> None:
    """formats.validate.check_activation (x bf16/fp16 [..., K], K == k when k, K % k_multiple == 0)."""
    _validate.check_activation(x, k, fmt, device=device, k_multiple=k_multiple)


def check_weight(qweight, fmt: str, layouts: tuple[str, ...] = ("linear",)) -> None:
    """formats.validate.check_weight; linear-layout scales unless ``layouts`` says more (the native
    SM12x path also reads swizzled 128x4 ones)."""
    _validate.check_weight(qweight, fmt, layouts=layouts)


def kernel_bias(bias):
    """The bias as every launcher takes it, made once in the wrapper: contiguous (the kernels read
    ``bias_ptr + offs_n``, so a strided view such as a column of a matrix would read the wrong
    elements), in its own float dtype (float32, bf16 or fp16: check_bias), which the epilogue widens
    to fp32 in registers, exactly."""
    return None if bias is None else bias.contiguous()


def check_bias(bias, n: int, device) -> None:
    """formats.validate.check_bias: None, or a float [n] tensor on ``device``."""
    _validate.check_bias(bias, n, device)


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K]; a view when the strides allow it (the kernels take both strides, so a
    strided 2-D x needs no copy), otherwise a copy."""
    return x.reshape(-1, x.shape[-1])


def check_gemm_operands(xq, qweight, bias, out_dtype, fmt: str,
                        layouts: tuple[str, ...] = ("linear",)) -> tuple[int, int, int]:
    """Validate the GEMM operands of format ``fmt``; returns (M, N, K).

    Raises ValueError naming the argument for: a weight that is not a ``fmt`` weight with a scale
    layout of ``layouts``, an ``xq`` that is not a ``fmt`` activation, a K mismatch, operands on
    different devices, an out_dtype outside bf16/fp16/fp32, or a bias that is not a float32/bf16/fp16
    [N] tensor on the same device.
    """
    check_weight(qweight, fmt, layouts)
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


def check_out_dtype(out_dtype) -> None:
    """ValueError unless out_dtype is one of OUT_DTYPES (bf16, fp16, fp32)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def e4m3_operand(data: torch.Tensor, dot_fp8: bool) -> torch.Tensor:
    """The e4m3 codes as a kernel should see them: float8_e4m3fn (Triton's float8e4nv pointer) when
    the GPU dots them directly, uint8 when the kernel dequantizes them with dequantize_e4m3."""
    return data if dot_fp8 else data.view(torch.uint8)
