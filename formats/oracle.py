"""The pure-PyTorch oracle: quantize, dequantize and the float64 reference linear layer.

Everything here runs on CPU (and on any torch device) and is independent of the Triton and CuTe
kernels; the tests in tests/formats pin it to the specifications.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType
from typing import Optional, Union

import torch

from .base import FormatSpec, QuantizedTensor, check_float_input, check_k, check_role


_NOT_FORMATS = ("base", "codecs", "constants", "layout", "moe", "oracle", "validate")  # the package's own machinery


def _discover() -> dict[str, ModuleType]:
    """Every module of this package that defines a FormatSpec ``SPEC`` is a format (a new format
    is one new file here), ordered by its ``ORDER``."""
    found = []
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.name.startswith("_") or info.name in _NOT_FORMATS:
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        if isinstance(getattr(mod, "SPEC", None), FormatSpec):
            found.append((getattr(mod, "ORDER", 1000), mod.SPEC.name, mod))
    return {name: mod for _, name, mod in sorted(found, key=lambda t: (t[0], t[1]))}


FORMATS: dict[str, ModuleType] = _discover()
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def format_module(fmt: str) -> ModuleType:
    """The formats.<fmt> module for a format name; ValueError listing the names otherwise."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}") from None


def spec(fmt: str):
    """The FormatSpec of ``fmt``."""
    return format_module(fmt).SPEC


def quantize(x: torch.Tensor, fmt: str, *, role: str = "weight", **opts) -> QuantizedTensor:
    """Quantize ``x`` to format ``fmt`` with the oracle.

    Args:
        x: float32/bf16/fp16. A weight is [N, K]; an activation is [..., K] (leading dims are
            flattened into rows). A weight's values must be finite; an activation's NaN/Inf follow
            the non-finite rule of docs/formats.md (its block's scale, or the tensor's for the
            per-tensor scales, becomes NaN).
        fmt: "fp8_tensor" | "fp8_block" | "mxfp8" | "nvfp4" | "mxfp4" | "fp8_channel".
        role: "weight" or "activation" (matters for fp8_block: 128x128 blocks vs 1x128 groups).
        **opts: format options: fp8_tensor and fp8_channel ``scale`` (static scale); fp8_block ``ue8m0``;
            mxfp8/mxfp4 ``scale_rule`` ("ceil" | "floor"); nvfp4 ``global_scale`` (static g).
    Returns:
        QuantizedTensor with linear-layout scales (see formats.base.QuantizedTensor for dtypes).
    Raises:
        ValueError: unknown fmt/role/option, non-float x, a weight with NaN/Inf or not 2-D,
            or K not a multiple of the format's block (the message names the multiple).
    """
    mod = format_module(fmt)
    check_role(role)
    check_float_input(x, "x", matrix=(role == "weight"), finite=(role == "weight"))
    check_k(mod.SPEC, x.shape[-1])
    try:
        return mod.quantize(x.reshape(-1, x.shape[-1]).to(torch.float32), role, **opts)
    except TypeError as e:  # an option the format does not take
        raise ValueError(f"{fmt}: {e}") from None


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize to a [rows, K] tensor of ``dtype`` (float32 or float64).

    Accepts linear or swizzled_128x4 scales. Raises ValueError for an unknown format or dtype.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if q.scale_layout == "swizzled_128x4":
        from .layout import unswizzle_128x4

        from dataclasses import replace

        kb = q.k // q.block_shape[1]
        q = replace(q, scale=unswizzle_128x4(q.scale, q.rows, kb), scale_layout="linear")
    elif q.scale_layout != "linear":
        raise ValueError(f"q.scale_layout must be 'linear' or 'swizzled_128x4', got {q.scale_layout!r}")
    return format_module(q.fmt).dequantize(q, dtype)


def reference_linear(
    x: Union[torch.Tensor, QuantizedTensor],
    qweight: QuantizedTensor,
    bias: Optional[torch.Tensor] = None,
    *,
    a16: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    **act_opts,
) -> torch.Tensor:
    """y = x . W^T (+ bias) from the dequantized operands, in float64, rounded once to ``out_dtype``.

    Args:
        x: either a float tensor [..., K] (bf16/fp16/fp32), quantized here with the weight's
            format as an activation (with ``act_opts``, e.g. ``scale=input_scale`` for fp8_tensor / fp8_channel or
            ``global_scale=input_global_scale`` for nvfp4) unless ``a16``; or an already quantized
            activation (a QuantizedTensor with role "activation", [M, K]).
        qweight: QuantizedTensor with role "weight", [N, K].
        bias: optional [N] float tensor, added in float64.
        a16: keep the activation unquantized (weight-only W4A16 / W8A16 numerics).
        out_dtype: output dtype; default x's dtype (bf16 for a QuantizedTensor x).
    Returns:
        [..., N] tensor of ``out_dtype``. A NaN/Inf in a row of x makes that row non-finite (NaN
        for the quantized paths), and every row for fp8_tensor's dynamic scale and nvfp4's dynamic
        global scale (docs/formats.md, "Non-finite values").
    Raises:
        ValueError: mismatched K, formats or roles, bad bias shape, bad out_dtype, a weight or bias
            on the meta device.
    Source: the GEMM column of each format's spec (formats.<fmt> docstrings).
    """
    if not isinstance(qweight, QuantizedTensor) or qweight.role != "weight":
        raise ValueError("qweight must be a QuantizedTensor with role 'weight'")
    if qweight.data.is_meta:
        raise ValueError("qweight is on the meta device (its tensors hold no values); pass a materialized weight")
    n, k = qweight.shape
    if isinstance(x, QuantizedTensor):
        if x.role != "activation" or x.fmt != qweight.fmt:
            raise ValueError(f"x must be a {qweight.fmt} activation, got a {x.fmt} {x.role}")
        if x.k != k:
            raise ValueError(f"x has K={x.k} but qweight has K={k}")
        lead, xq = (x.rows,), x
        out_dtype = out_dtype or torch.bfloat16
    else:
        check_float_input(x, "x", matrix=False, finite=False)
        if x.shape[-1] != k:
            raise ValueError(f"x.shape[-1] must equal the weight's K={k}, got {x.shape[-1]}")
        lead = tuple(x.shape[:-1])
        out_dtype = out_dtype or x.dtype
        xq = None if a16 else quantize(x, qweight.fmt, role="activation", **act_opts)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    x64 = x.reshape(-1, k).to(torch.float64) if xq is None else dequantize(xq, torch.float64)
    y = x64 @ dequantize(qweight, torch.float64).T
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias.is_meta:
            raise ValueError("bias is on the meta device (it holds no values); pass a materialized bias")
        y = y + bias.to(torch.float64)
    return y.to(out_dtype).reshape(*lead, n)
