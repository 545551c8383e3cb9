"""Our CuTe DSL activation quantizers: the ones b12x lacks, bit for bit equal to the formats/ oracle.

**Strategy.** One small CuTe DSL kernel per format (all five), one thread per scale block (per 128-column chunk
for per-tensor FP8), a 1-D grid over (rows x K-blocks). Per-tensor FP8 and NVFP4's dynamic global
scale first reduce the whole-tensor amax with an integer atomic max (``_launch.TensorAmax``). The
element and scale codecs (``_codecs.py``) are bit arithmetic pinned to ``formats/codecs.py``, and
every division the oracle does with ``ieee_div`` is an explicit ``div.rn.f32``:

    fp8_tensor  scale = div_rn(max(amax, 2^-100), 448) (or static); q = e4m3(div_rn(x, scale))
    fp8_block   per 1x128: scale = div_rn(max(amax, 2^-100), 448) [2^ceil(log2) if ue8m0]; q likewise
    mxfp8       per 32: e = ceil_log2(div_rn(max(amax, 2^-100), 448)) (or the floor rule); q = e4m3(x * 2^-e)
    mxfp4       per 32: e = ceil_log2(div_rn(max(amax, 2^-100), 6)) (or the floor rule); q = e2m1(x * 2^-e)
    nvfp4       g = div_rn(2688, max(amax, 2^-100)) (or static); per 16: s = e4m3(div_rn(amax_b, 6) * g);
                q = e2m1(div_rn(x * g, s))

**Capability.** Any GPU CuTe DSL targets: sm_90a (H100/H200), sm_100a, sm_120a (RTX PRO 6000),
sm_121a (GB10). No SM120-only instruction, no fast-math, no approximate division; the compile-only
tests check the PTX of every kernel for sm_120a and sm_121a.

**Shapes and limits.** x bf16/fp16 CUDA [..., K] with any leading dims and strides; K as the format
needs (fp8_tensor any, fp8_block %128, mxfp8 and mxfp4 %32, nvfp4 %16); any M (rows) >= 0, including NVFP4 at M
not a multiple of 128 (b12x's own NVFP4 quantizer needs M % 128 and K % 128). Scales come in the
oracle's linear layout, or (``swizzled=True``, mxfp8/nvfp4/mxfp4) written straight into b12x's 128x4
swizzled layout with zero padding. Finite inputs only (NaN/Inf are not checked).

**Notes.** Readable first, not tuned: each thread walks its block with one element per load. This
module imports only cutlass (CuTe DSL), torch and formats (formats.validate checks the input); it
never imports b12x or kernels_triton, so it runs where b12x cannot (the H200).

**References.** formats/fp8_tensor.py, formats/fp8_block.py, formats/mxfp8.py, formats/mxfp4.py
(+ formats/_mx.py), formats/nvfp4.py are the source of truth for numerics; formats/codecs.py for the
codecs, formats/base.py for ieee_div and AMAX_FLOOR, formats/layout.py for the swizzle. The Triton
quantizers compute the same formulas (tests/kernels_cute/test_cute_quant.py compares both).
"""

from __future__ import annotations

import torch

from formats import QuantizedTensor
from formats.validate import check_activation, static_global_scale, static_scale
from formats.constants import FP8_BLOCK, MX_BLOCK, NVFP4_BLOCK

from . import fp8_block, fp8_tensor, mxfp4, mxfp8, nvfp4

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
K_MULTIPLE = {"fp8_tensor": 1, "fp8_block": FP8_BLOCK, "mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK}
OPTIONS = {
    "fp8_tensor": ("scale",),
    "fp8_block": ("ue8m0",),
    "mxfp8": ("scale_rule", "swizzled"),
    "mxfp4": ("scale_rule", "swizzled"),
    "nvfp4": ("global_scale", "swizzled"),
}

__all__ = ["FORMATS", "quantize_activation_cute", "compile_all"]


def quantize_activation_cute(x: torch.Tensor, fmt: str, *, checked: bool = True, **opts) -> QuantizedTensor:
    """Quantize activations with our CuTe DSL kernels, bit for bit as
    ``formats.quantize(x, fmt, role="activation", ...)`` (and the Triton quantizers).

    Args:
        x: bfloat16/float16 CUDA tensor [..., K], any strides; NaN/Inf follow the non-finite rule (docs/formats.md).
        fmt: "fp8_tensor", "fp8_block", "mxfp8", "mxfp4" or "nvfp4".
        opts: fp8_tensor: ``scale`` (static; None = dynamic); fp8_block: ``ue8m0``; mxfp8 / mxfp4:
            ``scale_rule`` ("ceil" | "floor"), ``swizzled``; nvfp4: ``global_scale`` (static number or
            one-element tensor; None = dynamic), ``swizzled``. ``swizzled=True`` writes the block
            scales in the 128x4 swizzled layout (scale_layout="swizzled_128x4").
        checked: False skips the checks below of fmt, the options and x (a linear_unchecked
            call, whose caller validated them); the kernels are the same.
    Returns:
        formats.QuantizedTensor(role="activation", shape=(M, K)), M = prod(x.shape[:-1]), tensors on
        x's device, with the dtypes and shapes of formats.quantize (swizzled scales flat).
    Raises:
        ValueError: unknown fmt or option, x not a bf16/fp16 CUDA tensor, K not a positive multiple
            of the format's block, a bad static scale.
    """
    if checked:
        _check_args(x, fmt, opts)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)  # a view when the strides allow; the kernels take both strides
    M = x2.shape[0]
    swizzled = bool(opts.get("swizzled", False))
    layout = "swizzled_128x4" if swizzled else "linear"

    if fmt == "fp8_tensor":
        scale = opts.get("scale")
        static = None if scale is None else static_scale(scale, x.device)
        data, s = fp8_tensor.quantize(x2, scale=static)
        return QuantizedTensor(fmt, "activation", data, s, None, None, (M, K))
    if fmt == "fp8_block":
        data, s = fp8_block.quantize(x2, ue8m0=bool(opts.get("ue8m0", False)))
        return QuantizedTensor(fmt, "activation", data, s, None, (1, FP8_BLOCK), (M, K))
    if fmt == "mxfp8":
        data, s = mxfp8.quantize(x2, scale_rule=opts.get("scale_rule", "ceil"), swizzled=swizzled)
        return QuantizedTensor(fmt, "activation", data, s, None, (1, MX_BLOCK), (M, K), layout)
    if fmt == "mxfp4":
        data, s = mxfp4.quantize(x2, scale_rule=opts.get("scale_rule", "ceil"), swizzled=swizzled)
        return QuantizedTensor(fmt, "activation", data, s, None, (1, MX_BLOCK), (M, K), layout)
    gs = opts.get("global_scale")
    g_in = None if gs is None else static_global_scale(gs, x.device)
    data, s, g = nvfp4.quantize(x2, global_scale=g_in, swizzled=swizzled)
    return QuantizedTensor(fmt, "activation", data, s, g, (1, NVFP4_BLOCK), (M, K), layout)


def _check_args(x: torch.Tensor, fmt: str, opts: dict) -> None:
    """quantize_activation_cute's argument checks (ValueError naming the argument)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    unknown = sorted(set(opts) - set(OPTIONS[fmt]))
    if unknown:
        raise ValueError(f"{fmt} takes options {OPTIONS[fmt]}, got unknown {unknown}")
    if fmt in ("mxfp8", "mxfp4") and opts.get("scale_rule", "ceil") not in mxfp4.SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {mxfp4.SCALE_RULES}, got {opts['scale_rule']!r}")
    check_activation(x, None, fmt, k_multiple=K_MULTIPLE[fmt])
    if x.device.type != "cuda":
        raise ValueError(f"the CuTe DSL quantizers need a CUDA tensor, got x on {x.device}")


def compile_all(arch: str, *, keep_ptx: bool = False) -> dict:
    """Compile every quantizer variant for ``arch`` (no GPU needed). Returns {name: compiled}.

    Variants: each kernel class with each of its knobs, for bf16 input; fp16 for the dynamic/default
    variant of each format (the input dtype only changes the load and its conversion).
    """
    import cutlass

    from . import _launch as L

    bf16, f16 = cutlass.BFloat16, cutlass.Float16
    out = {}
    for name, dt in (("amax_bf16", bf16), ("amax_fp16", f16)):
        out[name] = L.compiled(L.TensorAmax, (dt,), arch, lambda dt=dt: L.amax_example_args(dt), keep_ptx=keep_ptx)
    for dt, tag in ((bf16, "bf16"), (f16, "fp16")):
        out[f"fp8_tensor_dynamic_{tag}"] = fp8_tensor.compile_for(arch, dt, dynamic=True, keep_ptx=keep_ptx)
        out[f"fp8_block_{tag}"] = fp8_block.compile_for(arch, dt, ue8m0=False, keep_ptx=keep_ptx)
        out[f"mxfp8_ceil_{tag}"] = mxfp8.compile_for(arch, dt, scale_rule="ceil", keep_ptx=keep_ptx)
        out[f"mxfp4_ceil_{tag}"] = mxfp4.compile_for(arch, dt, scale_rule="ceil", keep_ptx=keep_ptx)
        out[f"nvfp4_dynamic_{tag}"] = nvfp4.compile_for(arch, dt, dynamic=True, keep_ptx=keep_ptx)
    out["fp8_tensor_static_bf16"] = fp8_tensor.compile_for(arch, bf16, dynamic=False, keep_ptx=keep_ptx)
    out["fp8_block_ue8m0_bf16"] = fp8_block.compile_for(arch, bf16, ue8m0=True, keep_ptx=keep_ptx)
    out["mxfp8_floor_bf16"] = mxfp8.compile_for(arch, bf16, scale_rule="floor", keep_ptx=keep_ptx)
    out["mxfp8_ceil_swizzled_bf16"] = mxfp8.compile_for(arch, bf16, scale_rule="ceil", swizzled=True, keep_ptx=keep_ptx)
    out["mxfp4_floor_bf16"] = mxfp4.compile_for(arch, bf16, scale_rule="floor", keep_ptx=keep_ptx)
    out["mxfp4_ceil_swizzled_bf16"] = mxfp4.compile_for(arch, bf16, scale_rule="ceil", swizzled=True, keep_ptx=keep_ptx)
    out["nvfp4_static_bf16"] = nvfp4.compile_for(arch, bf16, dynamic=False, keep_ptx=keep_ptx)
    out["nvfp4_dynamic_swizzled_bf16"] = nvfp4.compile_for(arch, bf16, dynamic=True, swizzled=True, keep_ptx=keep_ptx)
    return out
