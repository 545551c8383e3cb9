"""One validation of quantized operands, shared by every implementation (kernels_triton, kernels_cute,
dispatch): a QuantizedTensor weight or activation, a bf16/fp16 activation, a bias.

Three kinds of check:

* **Metadata** (``check_weight``, ``check_quantized_activation``, ``check_activation``,
  ``check_bias``): dtypes, shapes, layout, devices, roles; no tensor element is read, so they cost
  no device synchronization and run at every kernel entry.
* **Values** (``check_scale_values``): global scales and fp32 scales finite and > 0, no NaN scale
  codes. Reading values synchronizes with the device, so this runs where a weight is created or
  loaded (``kernels_cute.<fmt>.prepare_weight``, a checkpoint loader), not per call.
* **Value findings** (``scan_values``, ``scan_scalar``, ``scan_raw``): every value of a weight that
  no correct quantizer writes (NaN weight codes, NaN / Inf / zero / negative scales, E8M0 0xFF),
  with its positions, as data rather than an exception: ``b12x-dual diff``'s checkpoint stage and
  the vLLM plugin's load checks report them.

What a well-formed QuantizedTensor of shape (rows, K) holds, per format (formats.base.QuantizedTensor):

    format      data                     scale (linear layout)                     global_scale
    fp8_tensor  float8_e4m3fn [rows, K]  float32, one element (0-d or [1])         None
    fp8_channel float8_e4m3fn [rows, K]  float32 [rows] (block_shape (1, K))       None
    fp8_block   float8_e4m3fn [rows, K]  float32 [ceil(rows/br), K/128]            None
    mxfp8       float8_e4m3fn [rows, K]  uint8 E8M0 [rows, K/32]                   None
    nvfp4       uint8 [rows, K/2]        float8_e4m3fn [rows, K/16]                float32, one element
    mxfp4       uint8 [rows, K/2]        uint8 E8M0 [rows, K/32]                   None

(br = 128 for fp8_block weights, 1 for activations.) With ``scale_layout="swizzled_128x4"`` (the
1-byte scales only) the scale is flat with ``formats.layout.swizzled_size(rows, K/block)`` elements.

Every error is a ValueError that names the argument, the value found and what is allowed.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .base import QuantizedTensor
from .layout import swizzled_size
from .oracle import FORMATS, spec

__all__ = [
    "ACT_DTYPES",
    "BIAS_DTYPES",
    "LAYOUTS",
    "check_activation",
    "check_bias",
    "check_linear_input",
    "check_quantized_activation",
    "check_scale_values",
    "check_weight",
    "describe_finding",
    "scan_raw",
    "scan_scalar",
    "scan_values",
    "static_global_scale",
    "static_scale",
]

ACT_DTYPES = (torch.bfloat16, torch.float16)  # unquantized activations the kernels take
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("linear", "swizzled_128x4")

# What the data and scale tensors of each format hold (dtype, and elements of K per data column /
# per scale column).
_DATA = {"e4m3": (torch.float8_e4m3fn, 1), "e2m1": (torch.uint8, 2)}
_SWIZZLABLE = tuple(f for f, m in FORMATS.items() if m.SCALE_DTYPE.itemsize == 1)  # 1-byte block scales


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} on {t.device}"
    return "None" if t is None else type(t).__name__


def _check_qt(q, name: str, fmt: Optional[str], role: str, layouts: Sequence[str]) -> None:
    """The metadata checks common to weights and quantized activations."""
    if not isinstance(q, QuantizedTensor) or q.role != role:
        got = f"a {q.fmt} {q.role}" if isinstance(q, QuantizedTensor) else type(q).__name__
        raise ValueError(f"{name} must be a formats.QuantizedTensor with role '{role}', got {got}")
    if q.fmt not in FORMATS:
        raise ValueError(f"{name}.fmt must be one of {tuple(FORMATS)}, got {q.fmt!r}")
    if fmt is not None and q.fmt != fmt:
        raise ValueError(f"{name} must be a {fmt} {role}, got {q.fmt}")
    if q.scale_layout not in layouts:
        raise ValueError(f"{name}.scale_layout must be one of {tuple(layouts)} here, got {q.scale_layout!r}")
    s = spec(q.fmt)
    shape = q.shape
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise ValueError(f"{name}.shape must be a tuple (rows, K) of two ints, got {shape!r}")
    rows, k = shape
    if rows < 0 or (role == "weight" and rows == 0):
        raise ValueError(f"{name}.shape rows must be {'positive' if role == 'weight' else '>= 0'}, got {shape}")
    if k <= 0 or k % s.k_multiple:
        raise ValueError(f"{name}.shape: {q.fmt} needs K to be a positive multiple of {s.k_multiple}, got {shape}")
    block = s.block(role)
    row_wise = block is not None and block[1] is None  # one scale per row over the whole K (fp8_channel)
    if row_wise:
        block = (block[0], k)

    # ----- data: element codes
    dtype, per_byte = _DATA[s.element]
    if not isinstance(q.data, torch.Tensor) or q.data.dtype != dtype:
        raise ValueError(f"{name}.data must be {str(dtype).removeprefix('torch.')} ({s.element} codes"
                         f"{', two per byte' if per_byte == 2 else ''}), got {_desc(q.data)}")
    want = (rows, k // per_byte)
    if tuple(q.data.shape) != want:
        raise ValueError(f"{name}.data must have shape {want} for a declared shape {shape}, "
                         f"got {tuple(q.data.shape)}")
    if q.block_shape != block:
        raise ValueError(f"{name}.block_shape must be {block} for a {q.fmt} {role}, got {q.block_shape!r}")

    # ----- scale
    mod = FORMATS[q.fmt]
    if not isinstance(q.scale, torch.Tensor) or q.scale.dtype != mod.SCALE_DTYPE:
        raise ValueError(f"{name}.scale must be {mod.SCALE_WHAT}, got {_desc(q.scale)}")
    if row_wise:
        if q.scale_layout != "linear":
            raise ValueError(f"{name}.scale_layout 'swizzled_128x4' is for 1-byte scales "
                             f"({_SWIZZLABLE}), not {q.fmt}")
        if tuple(q.scale.shape) != (rows,):
            raise ValueError(f"{name}.scale must have shape ({rows},) ({q.fmt} {role} of shape {shape}, "
                             f"one scale per row), got {tuple(q.scale.shape)}")
    elif block is None:
        if q.scale.numel() != 1 or q.scale.dim() > 1:
            raise ValueError(f"{name}.scale must hold one per-tensor scale (shape () or (1,)) for "
                             f"{q.fmt}, got shape {tuple(q.scale.shape)} (per-channel scales are "
                             "not this format)")
    else:
        br, bk = block
        linear = (-(-rows // br), k // bk)
        if q.scale_layout == "swizzled_128x4":
            if q.fmt not in _SWIZZLABLE:
                raise ValueError(f"{name}.scale_layout 'swizzled_128x4' is for 1-byte scales "
                                 f"({_SWIZZLABLE}), not {q.fmt}")
            want = (swizzled_size(*linear),)
            if tuple(q.scale.shape) != want:
                raise ValueError(f"{name}.scale must be flat with {want[0]} elements (the 128x4 swizzled "
                                 f"layout of a {linear} scale matrix), got shape {tuple(q.scale.shape)}")
        elif tuple(q.scale.shape) != linear:
            raise ValueError(f"{name}.scale must have shape {linear} ({q.fmt} {role} of shape {shape}, "
                             f"one scale per {br}x{bk} block), got {tuple(q.scale.shape)}")

    # ----- global scale
    if mod.HAS_GLOBAL_SCALE:
        g = q.global_scale
        if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1 or g.dim() > 1:
            raise ValueError(f"{name}.global_scale must be a float32 tensor with one element (shape () "
                             f"or (1,)) for {q.fmt}, got {_desc(g)}")
    elif q.global_scale is not None:
        with_global = [f for f, m in FORMATS.items() if m.HAS_GLOBAL_SCALE]
        raise ValueError(f"{name}.global_scale must be None for {q.fmt} (only {', '.join(with_global)} has one), "
                         f"got {_desc(q.global_scale)}")

    # ----- one device for every tensor, a real one
    for field in ("scale", "global_scale"):
        t = getattr(q, field)
        if t is not None and t.device != q.data.device:
            raise ValueError(f"{name}.{field} must be on {name}.data's device {q.data.device}, got {t.device}")
    if role == "weight" and q.data.is_meta:
        raise ValueError(f"{name} is on the meta device (its tensors hold no values); "
                         "quantize or load a materialized weight (cpu or cuda)")


def check_weight(qweight, fmt: Optional[str] = None, *, name: str = "qweight",
                 layouts: Sequence[str] = LAYOUTS) -> None:
    """Metadata checks of a weight QuantizedTensor [N, K] (no device synchronization).

    Args:
        qweight: the weight.
        fmt: the format it must have (None: any of formats.FORMAT_NAMES).
        name: the argument name used in messages.
        layouts: the scale layouts the caller accepts (the Triton kernels take "linear" only).
    Raises:
        ValueError naming ``name``: not a QuantizedTensor with role "weight"; another format; a scale
        layout outside ``layouts``; a shape that is not (N > 0, K a multiple of the format's block);
        a block shape other than the format's; data of the wrong dtype (e.g. bf16 in place of
        codes) or a shape other than the declared one; a scale of the wrong dtype (e.g. e4m3 or E8M0
        scales stored as float32) or shape (e.g. a per-channel [N] scale in a per-tensor weight, too
        few rows or columns); a missing, extra or misshapen global scale; tensors on several devices,
        or on the meta device (no values: a kernel or the oracle would read nothing).
    """
    _check_qt(qweight, name, fmt, "weight", layouts)


def check_quantized_activation(xq, fmt: str, K: Optional[int] = None, *, name: str = "xq",
                               device=None, layouts: Sequence[str] = LAYOUTS) -> None:
    """Metadata checks of a quantized activation QuantizedTensor [M, K] (no device synchronization).

    Args:
        xq: the activation (``formats.quantize(x, fmt, role="activation")`` or a kernel quantizer's).
        fmt: its format. K: the weight's K it must match (None: not checked).
        device: the device it must be on (None: not checked).
        layouts: the scale layouts the caller accepts.
    Raises:
        ValueError naming ``name``: as check_weight for role "activation", plus a K other than
        ``K`` and a device other than ``device``.
    """
    _check_qt(xq, name, fmt, "activation", layouts)
    if K is not None and xq.k != K:
        raise ValueError(f"{name} has K={xq.k} but qweight has K={K}; they must match")
    if device is not None and xq.device != torch.device(device):
        raise ValueError(f"{name} must be on the weight's device {device}, got {xq.device}")


def check_activation(x, K: Optional[int], fmt: str, *, name: str = "x", device=None,
                     k_multiple: Optional[int] = None) -> None:
    """Metadata checks of an unquantized activation x [..., K] (no device synchronization).

    Args:
        x: the activation. K: the weight's K it must match (None: any K the format allows).
        fmt: the format it will be quantized to (its block gives the K multiple).
        device: the device it must be on (None: not checked).
        k_multiple: a K multiple other than the format's (None: ``formats.spec(fmt).k_multiple``).
    Raises:
        ValueError naming ``name``: not a tensor; not bfloat16/float16; 0-d; K not a positive
        multiple of the format's block; K other than ``K``; on another device.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have shape [..., K], got a 0-d tensor")
    multiple = spec(fmt).k_multiple if k_multiple is None else k_multiple
    kx = x.shape[-1]
    if kx <= 0 or kx % multiple:
        raise ValueError(f"{fmt} needs K ({name}.shape[-1]) to be a positive multiple of {multiple}, got {kx}")
    if K is not None and kx != K:
        raise ValueError(f"{name}.shape[-1] must equal the weight's K={K}, got {kx}")
    if device is not None and x.device != torch.device(device):
        raise ValueError(f"{name} must be on the weight's device {device}, got {x.device}")


def check_linear_input(x, K: int, dtypes: Sequence[torch.dtype], *, name: str = "x") -> None:
    """The argument checks of a whole linear call's activation x [..., K] (``dispatch.linear``,
    ``QuantLinear``, every backend's ``apply``), made before any implementation is asked whether it
    can serve the call, so that a bad argument reads as one (no device synchronization).

    Args:
        x: the activation. K: the weight's K.
        dtypes: the activation dtypes the caller's implementation(s) take (e.g. bfloat16, float16;
            the reference also float32).
    Raises:
        ValueError naming ``name``: a formats.QuantizedTensor (a whole linear call quantizes x
        itself; a quantized activation goes to a backend's ``gemm`` or ``formats.reference_linear``);
        not a tensor; a dtype outside ``dtypes`` (naming it and the allowed ones); a 0-d tensor;
        ``x.shape[-1]`` other than K; a tensor on the meta device.
    """
    if isinstance(x, QuantizedTensor):
        raise ValueError(f"{name} must be an unquantized float tensor [..., K], got a formats.QuantizedTensor "
                         f"({x.fmt} {x.role} of shape {x.shape}); pass a quantized activation to a backend's "
                         "gemm() or to formats.reference_linear")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [..., K], got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of ({names}) here, got dtype {str(x.dtype).removeprefix('torch.')}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have shape [..., K], got a 0-d tensor")
    if x.shape[-1] != K:
        raise ValueError(f"{name}.shape[-1] must equal the weight's K={K}, got shape {tuple(x.shape)}")
    if x.is_meta:
        raise ValueError(f"{name} is on the meta device (it holds no values); pass a materialized tensor")


def check_bias(bias, N: int, device, *, name: str = "bias") -> None:
    """None, or a float32/bf16/fp16 tensor of shape (N,) on ``device`` (never the meta device); else
    ValueError naming ``name``."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{name} must be a tensor of shape ({N},), got {got}")
    if bias.dtype not in BIAS_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {bias.dtype}")
    if device is not None and bias.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {bias.device}")
    if bias.is_meta:
        raise ValueError(f"{name} is on the meta device (it holds no values); pass a materialized bias")


def static_scale(scale, device, *, name: str = "scale") -> torch.Tensor:
    """A static per-tensor FP8 activation scale (formats/fp8_tensor.py: amax / 448) as float32 0-d
    on ``device``.

    A Python number is checked (finite, > 0; ValueError naming ``name`` otherwise). A tensor must
    hold one floating-point element; its value is not read on the host (that would synchronize on
    every call: it is checked where it is made, QuantLinear or a checkpoint loader), and a bad one
    (0, negative, Inf, NaN) is turned into NaN on the device, so the output is NaN, never zeros.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"{name} must be one positive float, got a {scale.dtype} tensor "
                             f"of shape {tuple(scale.shape)}")
        t = scale.to(device=device, dtype=torch.float32).reshape(())
        return torch.where((t > 0) & (t <= torch.finfo(torch.float32).max), t, float("nan"))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be one finite positive number, got {scale!r}")
    return torch.tensor(scale, dtype=torch.float32, device=device)


def static_global_scale(global_scale, device, *, name: str = "global_scale") -> torch.Tensor:
    """A static NVFP4 global scale g (formats/nvfp4.py) as float32 [1] on ``device``.

    A Python number is checked (finite, > 0; ValueError naming ``name`` otherwise). A tensor must
    hold one floating-point element; its value is not read here (that would synchronize with the
    device): the quantizers turn a bad one into NaN on the device, and callers that make or load one
    check it there (check_scale_values).
    """
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1 or not global_scale.is_floating_point():
            raise ValueError(f"{name} must be one positive float, got a {global_scale.dtype} tensor "
                             f"of shape {tuple(global_scale.shape)}")
        return global_scale.to(device=device, dtype=torch.float32).reshape(1)
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float)) \
            or not math.isfinite(global_scale) or global_scale <= 0:
        raise ValueError(f"{name} must be one finite positive number, got {global_scale!r}")
    return torch.tensor([global_scale], dtype=torch.float32, device=device)


def nan_unless_positive(g: torch.Tensor) -> torch.Tensor:
    """g with every element that is not finite and > 0 replaced by NaN (torch ops on g's device, no
    synchronization): what the nvfp4 quantizers record as a bad static global scale, so that no
    consumer turns it into zeros. float32 tensor in, same shape out."""
    return torch.where(torch.isfinite(g) & (g > 0), g, torch.full_like(g, float("nan")))


def check_scale_values(qt, *, name: str = "qweight") -> None:
    """The value checks a metadata check cannot do: global scale and fp32 scales finite and > 0,
    e4m3 block scales not NaN (codes 0x7F/0xFF) and not negative, E8M0 bytes not 0xFF (NaN).

    Reads every scale, so it synchronizes with the device: call it where a weight is created or
    loaded, once, after ``check_weight``. Raises ValueError naming the field and the first bad value.
    """
    checks = []
    if qt.global_scale is not None:
        checks.append(("global_scale", qt.global_scale.float(), "finite and > 0"))
    if qt.scale.dtype == torch.float32:
        checks.append(("scale", qt.scale, "finite and > 0"))
    for field, t, allowed in checks:
        bad = ~(torch.isfinite(t) & (t > 0))
        if t.numel() and bool(bad.any()):
            v = t.reshape(-1)[bad.reshape(-1)][0].item()
            raise ValueError(f"{name}.{field} must be {allowed}, got {v if math.isfinite(v) else repr(v)}")
    if qt.scale.dtype == torch.float8_e4m3fn:
        b = qt.scale.view(torch.uint8)
        if b.numel() and bool(((b & 0x7F) == 0x7F).any() | (b >= 0x80).any()):
            raise ValueError(f"{name}.scale (e4m3 block scales) must be non-negative and not NaN; "
                             "found a NaN code (0x7F/0xFF) or a negative scale")
    elif qt.scale.dtype == torch.uint8 and qt.scale.numel() and bool((qt.scale == 0xFF).any()):
        raise ValueError(f"{name}.scale (E8M0 bytes) must not contain 0xFF (NaN)")


# ---------------------------------------------------------------------------------------------
# Value findings: what a checkpoint holds that no correct quantizer writes
# ---------------------------------------------------------------------------------------------
UNSOUND = "unsound"
WARNING = "warning"
SCAN_LIMIT = 8
"""How many positions a finding lists (``count`` has them all)."""

_WHAT = {
    "nan_code": "NaN weight code(s) (e4m3 0x7F/0xFF; e4m3fn has no Inf, so these are its only "
                "non-finite codes): the element reads as NaN, and so does its row's output column for every token",
    "nan_scale": "NaN block scale(s) (e4m3 0x7F/0xFF): every element of the block reads as NaN",
    "e8m0_nan": "E8M0 scale byte(s) 0xFF: the one non-finite E8M0 code (OCP MX v1.0: NaN; E8M0 has no "
                "zero, sign or Inf), so every element of its 32-block reads as NaN",
    "negative_scale": "negative block scale(s) (e4m3 sign bit set): the block's weights change sign",
    "nonfinite_scale": "non-finite scale(s) (NaN or Inf)",
    "nonpositive_scale": "zero or negative scale(s) (a scale is amax / max code, so > 0)",
    "zero_scale": "zero block scale(s) over non-zero codes: the block's weights read as 0 (a quantizer "
                  "writes 0 only for an all-zero block)",
}
"""What each finding kind means (the text reports print)."""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(t.shape if t.dim() else (1,)).contiguous().view(torch.uint8)


def _first(mask: torch.Tensor, limit: int) -> tuple[int, list[list[int]]]:
    """(how many True, the first ``limit`` indices of True in row-major order, as lists)."""
    n = int(mask.sum())
    if not n:
        return 0, []
    return n, [[int(i) for i in row] for row in mask.nonzero()[:limit].tolist()]


def _finding(tensor: str, kind: str, severity: str, mask: torch.Tensor, limit: int, where) -> Optional[dict]:
    count, idx = _first(mask, limit)
    if not count:
        return None
    return {"tensor": tensor, "kind": kind, "severity": severity, "count": count, "what": _WHAT[kind],
            "positions": [where(*i) for i in idx]}


def _nonzero_codes_per_block(q: QuantizedTensor) -> Optional[torch.Tensor]:
    """bool [scale rows, K-blocks] (linear scale layout): whether the block holds a non-zero code."""
    if q.block_shape is None:
        return None
    br, bk = q.block_shape
    rows, k = q.shape
    b = q.data.detach().view(torch.uint8) if q.data.dtype != torch.uint8 else q.data.detach()
    if spec(q.fmt).element == "e2m1":
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(rows, k)
        nz = (codes & 0x07) != 0  # 0x8 is -0
    else:
        nz = (b & 0x7F) != 0  # 0x80 is -0
    pad = (-rows) % br
    if pad:
        nz = torch.cat([nz, nz.new_zeros(pad, k)])
    return nz.reshape(-1, br, k // bk, bk).any(dim=3).any(dim=1)


def _linear_scale(q: QuantizedTensor) -> torch.Tensor:
    if q.scale_layout == "swizzled_128x4" and q.block_shape is not None:
        from .layout import unswizzle_128x4

        return unswizzle_128x4(q.scale.detach(), -(-q.rows // q.block_shape[0]), q.k // q.block_shape[1])
    return q.scale.detach()


def scan_values(qt: QuantizedTensor, *, name: str = "weight", limit: int = SCAN_LIMIT) -> list[dict]:
    """Every value of a quantized weight that no correct quantizer writes, with where it is.

    The metadata must already be valid (:func:`check_weight`). Reads every code and scale (it
    synchronizes with the device): call it once where a weight is loaded or diffed, not per call.

    Args:
        qt: a weight QuantizedTensor [N, K] of any format, linear or swizzled_128x4 scales.
        name: the prefix of each finding's ``tensor`` ("weight" -> "weight.data", "weight.scale").
        limit: how many positions a finding lists.
    Returns:
        A list of findings, each a dict: ``tensor`` ("<name>.data" / ".scale" / ".global_scale"),
        ``kind`` (a key of :data:`_WHAT`: nan_code, nan_scale, e8m0_nan, negative_scale,
        nonfinite_scale, nonpositive_scale, zero_scale), ``severity`` ("unsound": the layer's output
        is NaN, Inf or sign-flipped where it is used; "warning": a zero block scale over non-zero
        codes, which reads as zeros), ``count``, ``what`` (one sentence) and ``positions`` (the first
        ``limit``): for codes {"row", "column", "kblock"}; for block scales {"row" (the scale row;
        a weight row except for fp8_block, whose scale row r covers weight rows "rows" [128 r,
        128 r + 127]), "kblock", "columns" [first, last]}; for a per-tensor or global scale
        {"value"}. e2m1 codes have no non-finite values (all 16 codes are finite), and an E8M0 byte
        0x00 is 2^-127, not zero: neither is a finding.
    Source: the e4m3 (OCP FP8) and E8M0 (OCP MX v1.0) encodings; formats/codecs.py decodes them.
    """
    out: list[dict] = []
    s = spec(qt.fmt)
    rows, k = qt.shape

    def add(f):
        if f is not None:
            out.append(f)

    if s.element == "e4m3":
        b = qt.data.detach().view(torch.uint8)
        bk = qt.block_shape[1] if qt.block_shape is not None else 128
        add(_finding(f"{name}.data", "nan_code", UNSOUND, (b & 0x7F) == 0x7F, limit,
                     lambda r, c: {"row": r, "column": c, "kblock": c // bk}))
    sc = qt.scale.detach()
    if qt.block_shape is None:  # one per-tensor scale (fp8_tensor)
        v = sc.reshape(-1).float()
        add(_finding(f"{name}.scale", "nonfinite_scale", UNSOUND, ~torch.isfinite(v), limit,
                     lambda i: {"value": float(v[i])}))
        add(_finding(f"{name}.scale", "nonpositive_scale", UNSOUND, torch.isfinite(v) & (v <= 0), limit,
                     lambda i: {"value": float(v[i])}))
    else:
        br, bk = qt.block_shape
        lin = _linear_scale(qt)

        def at(r, kb):
            p = {"row": r, "kblock": kb, "columns": [kb * bk, kb * bk + bk - 1]}
            if br > 1:
                p["rows"] = [r * br, min(r * br + br, rows) - 1]
            return p

        nonzero = _nonzero_codes_per_block(qt)
        if lin.dtype == torch.float8_e4m3fn:
            b = lin.view(torch.uint8)
            nan = (b & 0x7F) == 0x7F
            zero = (b & 0x7F) == 0
            add(_finding(f"{name}.scale", "nan_scale", UNSOUND, nan, limit, at))
            add(_finding(f"{name}.scale", "negative_scale", UNSOUND, (b >= 0x80) & ~nan & ~zero, limit, at))
            add(_finding(f"{name}.scale", "zero_scale", WARNING, zero & nonzero, limit, at))
        elif lin.dtype == torch.uint8:  # E8M0 bytes
            add(_finding(f"{name}.scale", "e8m0_nan", UNSOUND, lin == 0xFF, limit, at))
        else:  # float32 block scales (fp8_block)
            v = lin.float()
            add(_finding(f"{name}.scale", "nonfinite_scale", UNSOUND, ~torch.isfinite(v), limit, at))
            add(_finding(f"{name}.scale", "nonpositive_scale", UNSOUND, torch.isfinite(v) & (v <= 0), limit, at))
    if qt.global_scale is not None:
        out.extend(scan_scalar(qt.global_scale, f"{name}.global_scale"))
    return out


def scan_scalar(t: torch.Tensor, tensor: str) -> list[dict]:
    """Findings of one per-tensor scale (a global scale, a static input scale): non-finite, or
    zero or negative (severity "unsound"); [] when it is finite and > 0. Reads the value."""
    v = t.detach().reshape(-1).float()
    out = []
    for kind, mask in (("nonfinite_scale", ~torch.isfinite(v)), ("nonpositive_scale", torch.isfinite(v) & (v <= 0))):
        f = _finding(tensor, kind, UNSOUND, mask, SCAN_LIMIT, lambda i: {"value": float(v[i])})
        if f is not None:
            out.append(f)
    return out


def scan_raw(t: torch.Tensor, tensor: str, *, limit: int = SCAN_LIMIT) -> list[dict]:
    """Findings of one checkpoint tensor as stored, read by its dtype (for a tensor whose module
    cannot be converted to a QuantizedTensor): float8_e4m3fn holding scales (``tensor`` names a
    scale) NaN / negative codes, or holding weight codes NaN codes; uint8 / float8_e8m0fnu
    holding scales 0xFF (uint8 weight codes are e2m1 and have no non-finite code); a float
    tensor non-finite or <= 0 values. Positions are {"index": [i, j, ...]} in the stored tensor."""
    where = lambda *i: {"index": list(i)}  # noqa: E731
    is_scale = "scale" in tensor.rsplit(".", 1)[-1]
    if t.dtype == torch.float8_e4m3fn:
        b = _bytes_of(t)
        nan = (b & 0x7F) == 0x7F
        fs = [_finding(tensor, "nan_scale" if is_scale else "nan_code", UNSOUND, nan, limit, where)]
        if is_scale:
            fs.append(_finding(tensor, "negative_scale", UNSOUND, (b >= 0x80) & ~nan & ((b & 0x7F) != 0), limit, where))
    elif t.dtype == torch.uint8 or "e8m0" in str(t.dtype):
        if not is_scale:
            return []
        fs = [_finding(tensor, "e8m0_nan", UNSOUND, _bytes_of(t) == 0xFF, limit, where)]
    elif t.is_floating_point():
        v = t.detach().float().reshape(t.shape if t.dim() else (1,))
        fs = [_finding(tensor, "nonfinite_scale", UNSOUND, ~torch.isfinite(v), limit, where)]
        if is_scale:
            fs.append(_finding(tensor, "nonpositive_scale", UNSOUND, torch.isfinite(v) & (v <= 0), limit, where))
    else:
        return []
    return [f for f in fs if f is not None]


def describe_finding(f: dict) -> str:
    """One line for a finding: tensor, count, what it means, the first positions."""
    def pos(p):
        if "value" in p:
            return f"value {p['value']!r}"
        if "index" in p:
            return f"index {tuple(p['index'])}"
        if "column" in p and "kblock" not in p:  # an output position
            return f"output row {p['row']}, column {p['column']}" + (f" (M={p['M']})" if "M" in p else "")
        if "column" in p:
            return f"row {p['row']}, column {p['column']} (K-block {p['kblock']})"
        rows = f"rows {p['rows'][0]}-{p['rows'][1]}" if "rows" in p else f"row {p['row']}"
        return f"{rows}, K-block {p['kblock']} (columns {p['columns'][0]}-{p['columns'][1]})"

    shown = "; ".join(pos(p) for p in f["positions"])
    more = f"; ... ({f['count']} in all)" if f["count"] > len(f["positions"]) else ""
    return f"{f['tensor']}: {f['count']} {f['what']}: at {shown}{more}"
