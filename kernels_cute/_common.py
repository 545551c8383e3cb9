"""What the kernels_cute format modules share: the b12x import, the prepared-weight container,
the plan registry (capacity plans per token count) and the fixed query every plan is made from, the
alignment checks, the operand checks (formats.validate), the scale swizzle for b12x, the reload
copy, and the bodies of gemm() and linear() around each format's own b12x call (run_gemm,
run_linear).

Private b12x API. One private field is set here: ``Plan._device`` (a dataclass field of every b12x
``Plan``; b12x's own planners and ``heuristic_plan`` set it, ``blockscaled.plan`` leaves it None).
``get_plan`` sets it to the device the plan is keyed on, so a plan made for cuda:1 is prepared and
run there rather than on whatever device is current when b12x first touches it (b12x reads it in
``detect_device(plan._device ...)``). ``kernels_cute._compile.PRIVATE_API`` lists it, and
tests/kernels_cute/test_compile_sm12x.py fails naming it if a b12x release drops the field. Every
other private symbol is used only by kernels_cute/_compile.py (compile-only checks).

Plans. Every b12x GEMM call here carries an explicit ``plan=``: a
``b12x.gemm.blockscaled.FixedBlockscaledQuery`` with ``max_rows = cap`` (a row *capacity*) and
``expected_m = None``, planned with ``blockscaled.plan``. Such a plan serves any M <= cap (the
runtime check in b12x's ``_FixedExecutionState._check`` is ``M <= max_rows`` when ``expected_m``
is None), which is the same kind of plan b12x builds itself when ``mm`` is called without one
(``heuristic_plan``: power-of-two capacity, ``expected_m=None``). ``kernels_cute.prepare``
declares one plan per token count a server uses and compiles them ahead; at call time the
smallest prepared capacity >= M serves the call. An M no prepared capacity covers gets a
power-of-two capacity plan, compiled on first use by b12x (with b12x's warning) -- except during
CUDA-graph capture, where we raise before b12x would compile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from formats import QuantizedTensor, spec, swizzle_128x4, validate

log = logging.getLogger("kernels_cute")

B12X_VERSION = "1.5.1"  # the version these wrappers were written and checked against
INSTALL_HINT = "pip install 'b12x-dual[cute]'  (b12x==1.5.1)"
OUT_DTYPES = (torch.bfloat16, torch.float16)  # b12x GEMMs write bf16 or fp16 only
SM12X_CAPABILITIES = ((12, 0), (12, 1))
A16_SUFFIXES = {"e2m1": "_w4a16", "e4m3": "_w8a16"}  # weight-only variant names by the weight's element


def a16_variant(fmt: str) -> str:
    """The weight-only (bf16/fp16 activations) variant name of a format: "nvfp4_w4a16" for the e2m1
    formats, "mxfp8_w8a16" for the e4m3 ones (the weight's bits, then the activation's)."""
    return fmt + A16_SUFFIXES[spec(fmt).element]


def split_variant(variant: str) -> tuple[str, bool]:
    """("nvfp4", True) for "nvfp4_w4a16", ("mxfp8", True) for "mxfp8_w8a16"; (variant, False) otherwise."""
    for suffix in A16_SUFFIXES.values():
        if variant.endswith(suffix):
            return variant[: -len(suffix)], True
    return variant, False


# ---------------------------------------------------------------------------------------------
# b12x import
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def b12x_import_error() -> Optional[str]:
    """None when ``b12x.gemm.blockscaled`` imports (it needs triton and nvidia-cutlass-dsl),
    else the reason as one line."""
    try:
        importlib.import_module("b12x.gemm.blockscaled.api")
    except Exception as e:  # noqa: BLE001  (any failure means "not usable", with the reason)
        return f"b12x is not importable ({type(e).__name__}: {e}); install it with: {INSTALL_HINT}"
    return None


def blockscaled():
    """The ``b12x.gemm.blockscaled`` module (RuntimeError naming the install line if missing)."""
    err = b12x_import_error()
    if err:
        raise RuntimeError(err)
    return importlib.import_module("b12x.gemm.blockscaled")


# ---------------------------------------------------------------------------------------------
# Shape support
# ---------------------------------------------------------------------------------------------
def check_alignment(fmt: str, M: int, N: int, K: int, *, k_multiple: int, n_multiple: int) -> tuple[bool, str]:
    """(ok, reason) for b12x's alignment rules of one entry point."""
    if min(M, N, K) < 0 or N == 0 or K == 0:
        return False, f"{fmt}: M, N, K must be non-negative and N, K positive, got M={M} N={N} K={K}"
    if K % k_multiple:
        return False, f"{fmt}: b12x needs K % {k_multiple} == 0, got K={K}"
    if N % n_multiple:
        return False, f"{fmt}: b12x needs N % {n_multiple} == 0, got N={N}"
    return True, f"{fmt}: N={N} K={K} meets b12x's alignment (K%{k_multiple}, N%{n_multiple}) at any M"


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Prepared weights
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CuteWeight:
    """A weight prepared for one b12x entry point (built by ``kernels_cute.<fmt>.prepare_weight``).

    Frozen: nothing is reassigned after prepare; a reload (``prepare_weight(q, into=w)``) copies new
    contents into the same tensors (``copy_into``), so CUDA graphs that captured them stay valid.

    Fields:
        fmt: format name (formats.FORMAT_NAMES).
        shape: (N, K).
        data: element codes as b12x reads them: uint8 [N, K/2] (fp4, low nibble first) or
            float8_e4m3fn [N, K].
        scale: nvfp4/mxfp4: flat 128x4-swizzled scale bytes (float8_e4m3fn / uint8);
            fp8_block: float32 [N/128, K/128]; mxfp8: uint8 E8M0 [N, K/32] (linear; b12x swizzles
            it into ``packed``); fp8_tensor: float32 [1] (the weight scale sw).
        global_scale: nvfp4: float32 [1], the weight's g_w (w ~= code * s / g_w); None otherwise.
        inv_global_scale: nvfp4: float32 [1], 1 / g_w, computed once at prepare (the per-call
            alpha is ``(1 / g_x) * inv_global_scale`` on the device); None otherwise.
        packed: the ``b12x.gemm.blockscaled.pack_weight`` result for fp8_tensor / mxfp8 (W8A8 and
            W8A16) and for nvfp4 with ``a16``, else None.
        a16: True for the weight-only route (nvfp4_w4a16, mxfp8_w8a16: bf16 activations, b12x's A16
            kernels).
    """

    fmt: str
    shape: tuple[int, int]
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor] = None
    inv_global_scale: Optional[torch.Tensor] = None
    packed: object = None
    a16: bool = False

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def variant(self) -> str:
        """The kernels_cute variant name ("nvfp4_w4a16" / "mxfp8_w8a16" for the A16 route, else fmt)."""
        return a16_variant(self.fmt) if self.a16 else self.fmt

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"data": self.data, "scale": self.scale}
        if self.global_scale is not None:
            out["global_scale"] = self.global_scale
        return out


def check_qweight(qweight, fmt: str) -> None:
    """The weight checks of prepare_weight: formats.validate.check_weight (metadata: dtypes, shapes,
    layout, devices) and check_scale_values (global and fp32 scales finite and > 0; this reads the
    scales, so it synchronizes once, at prepare, never per call)."""
    validate.check_weight(qweight, fmt)
    validate.check_scale_values(qweight)


def linear_scale(q: QuantizedTensor) -> torch.Tensor:
    """q's 1-byte block scales as a linear [rows, K/block] matrix (unswizzled if needed)."""
    if q.scale_layout == "linear":
        return q.scale
    from formats import unswizzle_128x4

    return unswizzle_128x4(q.scale, q.rows, q.k // q.block_shape[1])


def swizzled_scale(q: QuantizedTensor) -> torch.Tensor:
    """q's 1-byte block scales as b12x reads them: flat 128x4-swizzled storage (zero padding);
    swizzled here when q holds the linear layout (formats.quantize, the Triton quantizers)."""
    if q.scale_layout == "swizzled_128x4":
        return q.scale.contiguous()
    return swizzle_128x4(q.scale)


def copy_into(into: CuteWeight, new: CuteWeight) -> CuteWeight:
    """Weight reload with an unchanged layout: copy ``new``'s tensors into ``into``'s storage (so
    addresses captured in CUDA graphs stay valid) and return ``into``. ValueError when the
    layout differs (then prepare a fresh weight and re-capture)."""
    if (not isinstance(into, CuteWeight) or into.fmt != new.fmt or into.shape != new.shape
            or into.a16 != new.a16):
        raise ValueError(f"into= must be a prepared {new.variant} weight of shape {new.shape}, got "
                         f"{getattr(into, 'variant', type(into).__name__)} {getattr(into, 'shape', '')}")
    old_leaves, new_leaves = _tensor_leaves(into), _tensor_leaves(new)
    pairs = list(zip(old_leaves, new_leaves))
    if len(old_leaves) != len(new_leaves) or any(
            a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in pairs):
        raise ValueError(f"into= has a different storage layout than the reloaded {new.fmt} weight; "
                         "prepare a new weight instead (and re-capture any CUDA graph)")
    with torch.no_grad():
        for dst, src in pairs:
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
    return into


def _tensor_leaves(obj) -> list[torch.Tensor]:
    """Every tensor reachable through dataclass fields / dicts, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out += _tensor_leaves(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for key in sorted(obj):
            out += _tensor_leaves(obj[key])
    return out


# ---------------------------------------------------------------------------------------------
# Plan registry
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanKey:
    """What a b12x plan is specialized on: format, row capacity, N, K, output dtype, device."""

    fmt: str
    cap: int
    n: int
    k: int
    out_dtype: str
    device: str


_lock = threading.Lock()
_plans: dict[PlanKey, object] = {}  # every plan made (prepared or not), by key
_prepared_caps: dict[tuple, list[int]] = {}  # (fmt, n, k, out_dtype, device) -> sorted prepared caps


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in OUT_DTYPES:
        raise ValueError(f"b12x writes bfloat16 or float16 only, got {dtype}")
    return str(dtype).removeprefix("torch.")


def get_plan(key: PlanKey, make_query: Callable[[int, int, int, str], object]):
    """The b12x Plan for ``key`` (made once, bound to the device, kept for the process)."""
    with _lock:
        p = _plans.get(key)
        if p is None:
            bs = blockscaled()
            p = dataclasses.replace(bs.plan(make_query(key.cap, key.n, key.k, key.out_dtype)),
                                    _device=torch.device(key.device))
            _plans[key] = p
        return p


def mark_prepared(key: PlanKey) -> None:
    with _lock:
        caps = _prepared_caps.setdefault((key.fmt, key.n, key.k, key.out_dtype, key.device), [])
        if key.cap not in caps:
            caps.append(key.cap)
            caps.sort()


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def plan_for_call(fmt: str, M: int, N: int, K: int, out_dtype: torch.dtype, device: torch.device,
                  make_query, cap_for: Callable[[int, int], int]):
    """(plan, cap) serving an M-row call: the smallest prepared capacity >= M, else a fresh
    power-of-two capacity plan (compiled by b12x on first use; RuntimeError under graph capture)."""
    dev = str(torch.device(device))
    name = dtype_name(out_dtype)
    caps = _prepared_caps.get((fmt, N, K, name, dev), ())
    cap = next((c for c in caps if c >= M), None)
    if cap is None:
        cap = cap_for(next_pow2(M), K)
        key = PlanKey(fmt, cap, N, K, name, dev)
        if key not in _plans and capturing():
            raise RuntimeError(
                f"kernels_cute.{fmt}: no prepared plan covers M={M} (N={N}, K={K}, {name}); a shape "
                "used under CUDA graph capture must be prepared first with kernels_cute.prepare(...)")
    return get_plan(PlanKey(fmt, cap, N, K, name, dev), make_query), cap


def same_cap(cap: int, K: int) -> int:
    """``cap_for`` of an entry point with no minimum row capacity: plan the ``cap`` rows asked for."""
    return cap


def fixed_query(cap: int, N: int, K: int, out_dtype: str, *, recipe: str, call_kind: str, input_dtype: str,
                **fields):
    """The ``b12x.gemm.blockscaled.FixedBlockscaledQuery`` of an M <= cap call, as every format here
    declares it: row capacity ``max_rows=cap``, ``expected_m=None``, K unpadded
    (``padded_in_features=K``). ``fields``: the entry point's own ones (alpha_mode,
    source_scale_form)."""
    return blockscaled().FixedBlockscaledQuery(
        recipe=recipe, call_kind=call_kind, max_rows=cap, in_features=K, padded_in_features=K,
        out_features=N, input_dtype=input_dtype, output_dtype=out_dtype, expected_m=None, **fields)


def run_gemm(fmt: str, xq, prepared: CuteWeight, bias: Optional[torch.Tensor], out_dtype,
             make_query, cap_for: Callable[[int, int], int],
             mm: Callable[[object, torch.dtype], torch.Tensor], *, checked: bool = True) -> torch.Tensor:
    """What every format's gemm() does around its b12x call, in this order: check xq (check_xq),
    out_dtype (default bf16) and bias; M == 0 gives an empty [0, N] without touching b12x; else the
    plan serving M rows (plan_for_call), ``y = mm(plan, out_dtype)`` (the format's b12x GEMM,
    [M, N] of out_dtype), and y + bias (add_bias). ``checked=False`` skips the checks (a
    linear_unchecked call: its caller validated them). ValueError from the checks, RuntimeError
    from plan_for_call under graph capture."""
    N, K = prepared.shape
    if checked:
        check_xq(xq, prepared, fmt)
        out_dtype = check_out_dtype(out_dtype)
        validate.check_bias(bias, N, prepared.device)
    elif out_dtype is None:
        out_dtype = torch.bfloat16
    M = xq.rows
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=prepared.device)
    plan, _ = plan_for_call(fmt, M, N, K, out_dtype, prepared.device, make_query, cap_for)
    return add_bias(mm(plan, out_dtype), bias)


def run_linear(fmt: str, x: torch.Tensor, prepared: CuteWeight, bias: Optional[torch.Tensor],
               rows: Callable[[torch.Tensor], torch.Tensor], *, checked: bool = True) -> torch.Tensor:
    """What every format's linear() does around its route: x [..., K] checked and flattened to
    [M, K] (flatten_activation), bias checked; M == 0 gives an empty [..., N] of x's dtype; else
    ``rows(x2)`` ([M, N], bias included) reshaped to [..., N]. ``checked=False`` (linear_unchecked)
    flattens without the checks. ValueError from the checks."""
    N, K = prepared.shape
    if checked:
        x2 = flatten_activation(x, K, fmt, prepared.device)
        validate.check_bias(bias, N, prepared.device)
    else:
        x2 = x.reshape(-1, K)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], N))
    return rows(x2).reshape(*x.shape[:-1], N)


def flatten_activation(x: torch.Tensor, K: int, fmt: str, device=None) -> torch.Tensor:
    """x [..., K] bf16/fp16 as [M, K] (formats.validate.check_activation first: dtype, K, device)."""
    validate.check_activation(x, K, fmt, device=device)
    return x.reshape(-1, K)


def quantize_cute(x: torch.Tensor, fmt: str, *, checked: bool = True, **opts) -> QuantizedTensor:
    """kernels_cute.quant.quantize_activation_cute (imported on first use: it needs CuTe DSL, which
    preparing a weight does not); ``checked=False`` skips its argument checks (linear_unchecked)."""
    from .quant import quantize_activation_cute

    return quantize_activation_cute(x, fmt, checked=checked, **opts)


def check_out_dtype(out_dtype) -> torch.dtype:
    """out_dtype (default bf16) if b12x can write it, else ValueError."""
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES} (what b12x writes), got {out_dtype}")
    return out_dtype


def check_xq(xq, prepared: CuteWeight, fmt: str) -> None:
    """gemm()'s activation checks (metadata only): a ``fmt`` activation with the weight's K, on its device."""
    validate.check_quantized_activation(xq, fmt, prepared.k, device=prepared.device)


def add_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y + bias, summed in fp32 and rounded once more to y's dtype (b12x never fuses a bias into
    the serialized GEMMs; the Triton kernels add it in fp32 before their single rounding, so this
    can differ from them by one ulp of the output dtype). ``bias`` was checked by run_gemm /
    run_linear, its only callers' entry points."""
    if bias is None:
        return y
    return (y.float() + bias.float()).to(y.dtype)
