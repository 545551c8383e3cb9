"""Mixture-of-experts on SM120/SM121 through b12x 1.5.1's fused MoE (``b12x.moe.fused_moe``).

One MoE layer's routed experts (formats/moe.py: the spec and ``reference_moe``, the float64 oracle)
in one b12x launch sequence: route, FC1 (W13), activation, FC2 (W2), top-k sum. This module maps our
per-expert ``QuantizedTensor`` lists onto what b12x takes, and says what it cannot take.

**What b12x serves here** (``SERVED``; variant -> b12x recipe, b12x source format):

    nvfp4        -> "nvfp4" (A4: NVFP4 activations, static per-expert global scales), "modelopt_nvfp4"
    nvfp4_w4a16  -> "w4a16" (bf16/fp16 activations),                                  "modelopt_nvfp4"
    mxfp4_w4a16  -> "w4a16",                                                           "fp4_e8m0_k32"

with every activation of formats.MOE_ACTIVATIONS (silu; swigluoai and swigluoai_uninterleave as
b12x's ``swigluoai_uninterleave``, alpha / limit as given, beta 1 = the oracle's ``+ 1``).

**The steps and the b12x function each wraps.**

1. ``prepare_experts`` (load time): our layout -> b12x's arrays (``_b12x_arrays``, pure torch, any
   device), then ``b12x.moe.fused_moe.plan_weights(quant_modes=recipe, source_format=...,
   activation=..., params_dtype=..., num_experts=E, hidden_size=H, intermediate_size=Ip,
   w13_layout=...)`` (b12x's planner: validates the recipe and geometry) and
   ``b12x.moe.fused_moe.prepare_weights(plan=..., w1_fp4=..., w1_blockscale=..., w1_global_scale=...,
   a1_gscale=..., w2_...)`` (b12x's preparation; for W4A16 it repacks our arrays in place into its
   MMA layout, on the GPU, so a CPU preparation of a W4A16 variant stops before this call and holds
   the arrays only).
2. ``fused_moe`` (per call): ``b12x.moe.fused_moe.plan(Caps(max_tokens=M, num_topk=top_k, ...))``
   (one heuristic plan per (M, top_k, SwiGLU parameters), made once and kept, as vLLM's
   ``B12xExperts._plan``), a uint8 scratch of the plan's size, ``b12x.moe.fused_moe.bind(plan,
   scratch=..., a=x, experts=..., topk_weights=fp32, topk_ids=int32, output=...)`` and
   ``b12x.moe.fused_moe.run(binding=...)``. b12x compiles a plan's kernels on its first run.

**The mapping** (per expert e; our QuantizedTensor: codes uint8 [rows, K/2], low nibble = even
element, which b12x reads as is; block scales linear or flat 128x4-swizzled; nvfp4's global scale g,
a multiplier: w = code * s / g):

    W13 rows      silu: [up; gate] (b12x "w13" = up_gate, its kernels' native order: no in-place flip);
                  swigluoai_uninterleave: [gate; up] (b12x forces "w31" = gate_up for it);
                  swigluoai (gpt-oss, gate/up interleaved): rows 0::2 then 1::2 = [gate; up], "w31"
    I padding     nvfp4 variants: each half padded with zero rows to Ip = ceil(I/64)*64 and W2's K to Ip
                  (vLLM's _pad_gated_weights; zero codes and zero scales add exact zeros)
    w1_fp4        uint8 [E, 2Ip, H/2];  w2_fp4 uint8 [E, H, Ip/2]
    block scales  nvfp4: float8_e4m3fn, per expert the 128x4 swizzle of the (padded) [rows, K/16]
                  matrix (formats.swizzle_128x4 = b12x's F8_128x4), shape [E, ceil(rows/128)*128,
                  ceil(K/64)*4]; mxfp4: uint8 E8M0 linear [E, rows, K/32] (b12x's "E8M0 K/32 grid")
    global scale  nvfp4: float32 [E] = 1 / g_e (ModelOpt's weight_scale_2, a dequantization factor);
                  mxfp4: ones [E]
    a1/a2_gscale  nvfp4 A4: the activation global scales g_x of w13_act_opts / w2_act_opts (multipliers,
                  as the oracle's ``global_scale``), [E]; b12x's alphas (1/g_e) / g_x are recomputed
                  in place when they change; W4A16: ones (b12x's unit-scale contract)

tests/kernels_cute/test_moe_cute.py decodes these arrays (in the declared row order, unswizzled as
b12x's own ``unswizzle_block_scale`` does) and checks them equal to ``formats.dequantize`` of every
expert.

**Gaps** (``supports`` answers False naming them): FP8 MoE of any kind (fp8_tensor, fp8_block,
fp8_channel, mxfp8, mxfp8_w8a16: b12x's ``PackedSourceFormat`` has no FP8 source); mxfp4 W4A4 (b12x
has no MXFP4-activation recipe: MXFP4 weights take A16 or A8 = MXFP8 activations, other numerics);
dynamic per-tensor activation scales (nvfp4 A4 needs static ``global_scale`` options: ValueError
otherwise); expert biases (ValueError); an SM other than 12.0 / 12.1.

**Numerics** (what the SM12x test's bound follows): b12x accumulates in fp32, rounds FC1's output
and the activated intermediate to the I/O dtype where its kernels stage them (W4A16), quantizes the
intermediate with its own NVFP4 quantizer (A4: ``e4m3(amax * g / 6)``-style scale arithmetic, which
can land one e4m3 / e2m1 step from the oracle's at a rounding boundary), sums the top_k in fp32 and
rounds once to the I/O dtype. Non-finite: b12x's SwiGLU clamps (fmin/fmax) would turn NaN and Inf
into the limit, and its quantizer's amax can drop a NaN; so the output row of every token whose x
row holds NaN/Inf is set to NaN here (device-side, no synchronization), as the oracle's.

**References.** b12x/moe/fused_moe/{api.py, planning.py, _impl.py (plan_b12x_fp4_moe_weights,
prepare_b12x_fp4_moe_weights, _get_weight_views), weights.py}; b12x/moe/_shared/kernels/reference.py
(moe_reference_nvfp4, moe_reference_w4a16_fp4_e8m0_k32, unswizzle_block_scale, _gated_row_slices);
vLLM 0.33.0 model_executor/layers/fused_moe/b12x.py (B12xExperts) and
quantization/utils/b12x_moe.py (prepare_nvfp4_moe_layer_for_b12x). docs/moe.md, "cute: b12x's fused
MoE".
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

import formats
from formats import QuantizedTensor, swizzle_128x4
from formats.moe import MOE_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT, _check_experts

from . import _common as C

B12X_MOE = "b12x.moe.fused_moe"  # the b12x module every step calls (and whose is_supported() gates it)
FP8_VARIANTS = ("fp8_tensor", "fp8_block", "fp8_channel", "mxfp8", "mxfp8_w8a16")
VARIANTS = tuple(formats.FORMAT_NAMES) + ("nvfp4_w4a16", "mxfp4_w4a16", "mxfp8_w8a16")
# variant -> (b12x recipe, b12x source format, our format, weight-only)
SERVED = {
    "nvfp4": ("nvfp4", "modelopt_nvfp4", "nvfp4", False),
    "nvfp4_w4a16": ("w4a16", "modelopt_nvfp4", "nvfp4", True),
    "mxfp4_w4a16": ("w4a16", "fp4_e8m0_k32", "mxfp4", True),
}
GAPS = {
    **{v: ("b12x 1.5.1's fused MoE has no FP8 weight source (PackedSourceFormat: fp4_e8m0_k32, modelopt_nvfp4, "
           "compressed_tensors, mxfp6_e2m3, iq2_xs, iq2_xxs, q8_0): there is no FP8 MoE in b12x")
        for v in FP8_VARIANTS},
    "mxfp4": ("b12x 1.5.1's fused MoE has no MXFP4-activation recipe: MXFP4 (E8M0 K32) weights run with A16 "
              "(w4a16, the mxfp4_w4a16 variant) or A8 (w4a8_mx: MXFP8 activations, not formats' mxfp4 W4A4 numerics)"),
}
# b12x's nonlinearity for each of our activations (W13's row order for each: _w13_rows)
B12X_ACTIVATION = {"silu": "silu", "swigluoai": "swigluoai_uninterleave",
                   "swigluoai_uninterleave": "swigluoai_uninterleave"}
NVFP4_I_ALIGN = 64  # nvfp4: each W13 half padded to a multiple of 64 rows (vLLM's _pad_gated_weights)
IO_DTYPES = (torch.bfloat16, torch.float16)


def _b12x_import_error() -> Optional[str]:
    try:
        importlib.import_module(B12X_MOE + ".api")
    except Exception as e:  # noqa: BLE001  (any failure means "not usable", with the reason)
        return f"{B12X_MOE} is not importable ({type(e).__name__}: {e}); install it with: {C.INSTALL_HINT}"
    return None


def _fm():
    """The ``b12x.moe.fused_moe`` module (RuntimeError naming the install line if missing)."""
    err = _b12x_import_error()
    if err:
        raise RuntimeError(err)
    return importlib.import_module(B12X_MOE)


def supports(variant: str, activation: str, capability) -> tuple[bool, str]:
    """Can b12x's fused MoE serve this variant and activation on a GPU of ``capability``?

    Args:
        variant: a format or weight-only variant name (VARIANTS: "nvfp4", "mxfp4", "nvfp4_w4a16",
            "mxfp4_w4a16", the FP8 ones).
        activation: one of formats.MOE_ACTIVATIONS.
        capability: (major, minor) of the GPU, or None (no CUDA device).
    Returns:
        (ok, reason), never raising: False naming what b12x lacks (FP8 MoE, an MXFP4-activation
        recipe), an unknown variant or activation, a capability other than (12, 0) / (12, 1), or
        b12x not importable; True naming the b12x recipe and source format otherwise.
    """
    if variant in GAPS:
        return False, f"kernels_cute.moe does not serve {variant!r}: {GAPS[variant]}"
    if variant not in SERVED:
        return False, (f"kernels_cute.moe does not serve {variant!r} (a name outside {VARIANTS}); "
                       f"it serves {tuple(SERVED)}")
    if activation not in MOE_ACTIVATIONS:
        return False, f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}"
    cap = None if capability is None else tuple(capability)
    if cap not in C.SM12X_CAPABILITIES:
        return False, f"kernels_cute.moe needs an SM120/SM121 GPU (capability (12, 0)/(12, 1)), got {cap}"
    err = _b12x_import_error()
    if err:
        return False, err
    recipe, source, _, _ = SERVED[variant]
    return True, (f"{variant} {activation}: b12x's fused MoE, recipe {recipe!r} on source {source!r} "
                  f"with nonlinearity {B12X_ACTIVATION[activation]!r}")


@dataclass(frozen=True)
class MoERoute:
    """The kernels one ``fused_moe`` call launches (kernels_triton's Route, in this package):
    ``impl`` "cute", ``kernels`` in launch order (named as b12x's entry point and the backend its
    planner picks), ``tile`` "" (b12x picks it inside its plan), ``split_k`` 1, ``why``."""

    impl: str
    kernels: tuple[str, ...]
    tile: str = ""
    split_k: int = 1
    why: str = ""

    def describe(self) -> str:
        return f"{self.impl}: {' -> '.join(self.kernels)}: {self.why}"


def route(M: int, E: int, top_k: int, H: int, I: int, *, variant: str, capability=None) -> MoERoute:
    """What ``fused_moe`` launches for x [M, H], E experts (W13 [2I, H], W2 [H, I]) and top_k, without
    a GPU. The backend is b12x's own choice (``_impl.select_tp_moe_backend``: "micro" for a few routed
    rows, else "dynamic"; W4A16: its "w4a16" kernels); named "micro|dynamic" when b12x is not
    importable. ``capability`` is not needed for the choice (kept for symmetry). Pure.

    Raises ValueError: a variant this module does not serve (the reason of ``supports``), or sizes
    with M < 0 or E, top_k, H, I <= 0.
    """
    if variant not in SERVED:
        raise ValueError(f"kernels_cute.moe does not serve {variant!r}: "
                         f"{GAPS.get(variant, f'it serves {tuple(SERVED)}')}")
    if min(M, E, top_k, H, I) < 0 or min(E, top_k, H, I) == 0:
        raise ValueError(f"M must be >= 0 and E, top_k, H, I > 0, got {(M, E, top_k, H, I)}")
    recipe, source, fmt, a16 = SERVED[variant]
    if M == 0:
        return MoERoute("cute", (), why=f"{variant}: no tokens, nothing to launch")
    if recipe == "w4a16":
        backend = "w4a16"
    elif _b12x_import_error():
        backend = "micro|dynamic"
    else:
        from b12x.moe.fused_moe._impl import select_tp_moe_backend

        backend = select_tp_moe_backend(num_tokens=M, num_topk=top_k, quant_mode=recipe)
    ip = _padded_i(I, fmt)
    why = (f"{variant}: b12x's fused MoE (recipe {recipe!r}, source {source!r}) with its {backend!r} backend for "
           f"{M} tokens x top_k {top_k} ({M * top_k} routed rows) over {E} experts, H={H}, I={I}"
           + (f" (padded to {ip})" if ip != I else "")
           + ("; activations bf16/fp16 (weight-only)" if a16 else "; NVFP4 activations with static global scales"))
    return MoERoute("cute", (f"{B12X_MOE}.run[{recipe}:{backend}]",), why=why)


# ---------------------------------------------------------------------------------------------
# Preparation
# ---------------------------------------------------------------------------------------------
@dataclass
class CuteMoEExperts:
    """Experts prepared for b12x's fused MoE (``prepare_experts``).

    Fields: variant, activation (ours), dtype (the I/O dtype b12x planned: bf16 or fp16), E, H, I
    (logical) and ip (I padded), recipe / source_format / w13_layout / nonlinearity (b12x's names),
    ``arrays`` (the tensors handed to b12x, named as its prepare_weights arguments: w1_fp4,
    w1_blockscale, w1_global_scale, w2_fp4, w2_blockscale, w2_global_scale, a1_gscale, a2_gscale; a
    W4A16 preparation on the GPU repacks w1_fp4 / w2_fp4 in place), ``weight_plan`` (b12x's
    MoEWeightPreparationPlan), ``experts`` (b12x's B12XFP4ExpertWeights; None for a W4A16 variant
    prepared on the CPU), and per-call caches (b12x plans and scratch by (M, top_k), the activation
    scales last written).
    """

    variant: str
    activation: str
    dtype: torch.dtype
    num_experts: int
    hidden: int
    intermediate: int
    ip: int
    recipe: str
    source_format: str
    w13_layout: str
    nonlinearity: str
    arrays: dict
    weight_plan: object
    experts: object = None
    _plans: dict = field(default_factory=dict, repr=False)
    _scale_key: object = field(default=None, repr=False)
    _lock: object = field(default_factory=threading.Lock, repr=False)

    @property
    def device(self) -> torch.device:
        return self.arrays["w1_fp4"].device

    @property
    def a16(self) -> bool:
        return SERVED[self.variant][3]


def _padded_i(I: int, fmt: str) -> int:
    return -(-I // NVFP4_I_ALIGN) * NVFP4_I_ALIGN if fmt == "nvfp4" else I


def _w13_rows(activation: str, I: int) -> tuple[torch.Tensor, str]:
    """(row index of W13 for b12x's order: first half, then second half; b12x's w13_layout)."""
    if activation == "silu":  # ours [gate; up] -> b12x's native [up; gate]
        return torch.cat([torch.arange(I, 2 * I), torch.arange(I)]), "w13"
    if activation == "swigluoai":  # interleaved gate/up -> [gate; up]
        return torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)]), "w31"
    return torch.arange(2 * I), "w31"  # swigluoai_uninterleave: already [gate; up]


def _pad_halves(t: torch.Tensor, I: int, ip: int) -> torch.Tensor:
    """[2I, ...] -> [2Ip, ...]: each half followed by zero rows."""
    if ip == I:
        return t
    z = t.new_zeros((ip - I, *t.shape[1:]))
    return torch.cat([t[:I], z, t[I:], z])


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    if t.shape[1] == cols:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], cols - t.shape[1]))], dim=1)


def _swizzled(s: torch.Tensor) -> torch.Tensor:
    """Linear [rows, cols] scales -> the 128x4 swizzle as b12x's per-expert [ceil(rows/128)*128,
    ceil(cols/4)*4] view of the same flat bytes (zero padding)."""
    rows, cols = s.shape
    return swizzle_128x4(s.contiguous()).reshape(-(-rows // 128) * 128, -(-cols // 4) * 4)


# [b12x-layout]
def _expert_arrays(q13: QuantizedTensor, q2: QuantizedTensor, fmt: str, rows: torch.Tensor, I: int, ip: int):
    """One expert's (w13 codes, w13 scales, w2 codes, w2 scales) in b12x's layout (see the docstring)."""
    rows = rows.to(q13.data.device)
    c13 = _pad_halves(q13.data[rows], I, ip)
    s13 = _pad_halves(C.linear_scale(q13)[rows], I, ip)
    c2 = _pad_cols(q2.data, ip // 2)
    s2 = C.linear_scale(q2)
    if fmt == "nvfp4":
        s13, s2 = _swizzled(s13), _swizzled(_pad_cols(s2, ip // 16))
    return c13.contiguous(), s13.contiguous(), c2.contiguous(), s2.contiguous()
# [/b12x-layout]


def _b12x_arrays(w13, w2, variant: str, activation: str) -> tuple[dict, int, int, int, int]:
    """Our per-expert lists -> (the arrays b12x's prepare_weights takes, E, H, I, Ip). Pure torch on
    the weights' device; the weights are checked first (formats.validate, values included)."""
    recipe, source, fmt, a16 = SERVED[variant]
    f13, E, n13, H = _check_experts(w13, "w13")
    f2, E2, H2, I = _check_experts(w2, "w2")
    for name, f in (("w13", f13), ("w2", f2)):
        if f != fmt:
            raise ValueError(f"{name} must hold {fmt} experts for variant {variant!r}, got {f}")
    if E2 != E:
        raise ValueError(f"w13 and w2 must have the same expert count, got {E} and {E2}")
    if H2 != H:
        raise ValueError(f"w2's rows (hidden) must equal w13's K={H}, got w2 of shape {w2[0].shape}")
    if n13 != 2 * I:
        raise ValueError(f"w13 must have 2 * I = {2 * I} rows (gate and up) for w2's I={I}, "
                         f"got w13 of shape {w13[0].shape}")
    for name, w in (("w13", w13), ("w2", w2)):
        for e, q in enumerate(w):
            formats.validate.check_scale_values(q, name=f"{name}[{e}]")
    ip = _padded_i(I, fmt)
    rows, _ = _w13_rows(activation, I)
    parts = [_expert_arrays(w13[e], w2[e], fmt, rows, I, ip) for e in range(E)]
    dev = w13[0].device
    out = {
        "w1_fp4": torch.stack([p[0] for p in parts]),
        "w1_blockscale": torch.stack([p[1] for p in parts]),
        "w2_fp4": torch.stack([p[2] for p in parts]),
        "w2_blockscale": torch.stack([p[3] for p in parts]),
    }
    ones = torch.ones(E, dtype=torch.float32, device=dev)
    if fmt == "nvfp4":  # b12x's (ModelOpt's) global scale is the dequantization factor 1 / g
        for key, w in (("w1_global_scale", w13), ("w2_global_scale", w2)):
            g = torch.stack([q.global_scale.reshape(()).float() for q in w])
            out[key] = torch.div(torch.ones_like(g), g)
    else:
        out["w1_global_scale"], out["w2_global_scale"] = ones, ones.clone()
    out["a1_gscale"], out["a2_gscale"] = ones.clone(), ones.clone()
    return out, E, H, I, ip


def prepare_experts(w13, w2, *, variant: str, activation: str = "silu",
                    dtype: torch.dtype = torch.bfloat16) -> CuteMoEExperts:
    """Per-expert weights -> b12x's prepared experts (``CuteMoEExperts``).

    Args:
        w13: E weight QuantizedTensors [2I, H] (gate rows then up, or interleaved for swigluoai),
            one per expert, of the variant's format (nvfp4 / mxfp4), scales linear or swizzled.
        w2: E weight QuantizedTensors [H, I].
        variant: one of SERVED ("nvfp4", "nvfp4_w4a16", "mxfp4_w4a16").
        activation: one of formats.MOE_ACTIVATIONS.
        dtype: the I/O dtype b12x plans for (bf16 or fp16); fused_moe takes x of this dtype.
    Returns:
        CuteMoEExperts holding the arrays b12x reads (the mapping in the module docstring), b12x's
        weight plan (``plan_weights``) and, on the GPU (and for nvfp4 on any device), b12x's
        ``prepare_weights`` result.
    Raises:
        ValueError naming the argument: a variant or activation ``supports`` refuses for any device
            (its reason), a dtype b12x does not take, experts that are not per-expert weight lists of
            the variant's format, mixed shapes or formats, w13 rows != 2 * w2's I, H mismatch,
            malformed experts or bad scale values (formats.validate), or a geometry b12x's own
            planner rejects (its message).
        RuntimeError: b12x not importable (the install line).
    """
    if variant not in SERVED:
        raise ValueError(f"variant must be one of {tuple(SERVED)} (kernels_cute.moe), got {variant!r}"
                         + (f": {GAPS[variant]}" if variant in GAPS else ""))
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if dtype not in IO_DTYPES:
        raise ValueError(f"dtype must be one of {IO_DTYPES} (b12x's fused MoE I/O), got {dtype}")
    arrays, E, H, I, ip = _b12x_arrays(w13, w2, variant, activation)
    recipe, source, fmt, a16 = SERVED[variant]
    wp, layout, _ = weight_plan(variant, activation, dtype, E, H, I)
    p = CuteMoEExperts(variant, activation, dtype, E, H, I, ip, recipe, source, layout,
                       B12X_ACTIVATION[activation], arrays, wp)
    if arrays["w1_fp4"].device.type == "cuda" or not a16:
        p.experts = _b12x_prepare(p)
    return p


def weight_plan(variant: str, activation: str, dtype: torch.dtype, E: int, H: int, I: int):
    """(b12x's MoEWeightPreparationPlan, its w13_layout, the padded I) for a served variant: what
    ``prepare_experts`` plans (``b12x.moe.fused_moe.plan_weights``, metadata only: no tensor, no
    GPU). ValueError when b12x's planner rejects the geometry (its message)."""
    recipe, source, fmt, _ = SERVED[variant]
    ip = _padded_i(I, fmt)
    _, layout = _w13_rows(activation, 1)
    try:
        wp = _fm().plan_weights(quant_modes=recipe, source_format=source, activation=B12X_ACTIVATION[activation],
                                params_dtype=dtype, num_experts=E, hidden_size=H, intermediate_size=ip,
                                w13_layout=layout)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"b12x's fused MoE planner rejects {variant} {activation} with E={E} H={H} I={I}"
                         f" (padded {ip}): {e}") from e
    return wp, layout, ip


def caps(wp, recipe: str, nonlinearity: str, device, M: int, top_k: int, alpha: float, limit: float):
    """The ``b12x.moe.fused_moe.Caps`` of an M-token, top_k call (vLLM's B12xExperts._plan fields: one
    exact token count, no b12x router, router weights applied after FC2, frozen); the SwiGLU alpha,
    limit and beta 1 for swigluoai_uninterleave, None otherwise (silu: the oracle has no clamp)."""
    swiglu = nonlinearity == "swigluoai_uninterleave"
    fm = _fm()
    return fm.Caps(max_tokens=M, num_topk=top_k, device=device, weight_plan=wp, core_token_counts=(M,),
                   route_num_experts=0, quant_mode=recipe, apply_router_weight_on_input=False,
                   swiglu_limit=float(limit) if swiglu else None, swiglu_alpha=float(alpha) if swiglu else None,
                   swiglu_beta=1.0 if swiglu else None, frozen=True)


def _b12x_prepare(p: CuteMoEExperts):
    """b12x.moe.fused_moe.prepare_weights on the arrays (tensor form, as vLLM's B12xExperts)."""
    a = p.arrays
    return _fm().prepare_weights(plan=p.weight_plan, params_dtype=p.dtype, **a)


# ---------------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------------
def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _scale_vector(v, E: int, device, name: str) -> torch.Tensor:
    """A static activation global scale (number, 0-d, [1] or [E]) -> float32 [E] on device; values
    checked finite and > 0 (reads them: called only when the tensor changed)."""
    if isinstance(v, torch.Tensor):
        if not v.is_floating_point() or v.numel() not in (1, E):
            raise ValueError(f"{name} must be one positive number or a float tensor of 1 or {E} (one per expert) "
                             f"values, got {_desc(v)}")
        t = v.to(device=device, dtype=torch.float32).reshape(-1).expand(E).contiguous()
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        t = torch.full((E,), float(v), dtype=torch.float32, device=device)
    else:
        raise ValueError(f"{name} must be one positive number or a float tensor of 1 or {E} values, got {v!r}")
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    return t


def _same_opts(key, opts) -> bool:
    """Were these activation-scale options written last time? The same tensor objects (the key holds
    them, so their ids cannot be reused) at the same version, or equal numbers."""
    if key is None or len(key) != len(opts):
        return False
    for (old, version), v in zip(key, opts):
        if isinstance(v, torch.Tensor):
            if old is not v or version != v._version:
                return False
        elif isinstance(old, torch.Tensor) or old != v:
            return False
    return True


def _set_activation_scales(p: CuteMoEExperts, w13_act_opts: Optional[Mapping], w2_act_opts: Optional[Mapping]) -> None:
    """nvfp4 A4: write the static activation global scales into b12x's a1/a2_gscale and its alphas
    ((1/g_w) / g_x), in place (the tensors b12x's prepared experts hold; no new allocation, so its
    view caches stay valid). Skipped when the same option objects were written last time."""
    opts = []
    for name, o in (("w13_act_opts", w13_act_opts), ("w2_act_opts", w2_act_opts)):
        o = dict(o or {})
        if set(o) - {"global_scale"}:
            raise ValueError(f"{name} takes only 'global_scale' for nvfp4, got {sorted(o)}")
        if o.get("global_scale") is None:
            raise ValueError(f"{name}['global_scale'] is required for nvfp4 through b12x: its fused MoE quantizes "
                             "activations with static per-expert global scales only (no dynamic per-tensor scale)")
        opts.append(o["global_scale"])
    if _same_opts(p._scale_key, opts):
        return
    g1 = _scale_vector(opts[0], p.num_experts, p.device, "w13_act_opts['global_scale']")
    g2 = _scale_vector(opts[1], p.num_experts, p.device, "w2_act_opts['global_scale']")
    ex, a = p.experts, p.arrays
    with torch.no_grad():
        ex.a1_gscale.copy_(g1)
        ex.a2_gscale.copy_(g2)
        ex.w1_alphas.copy_(torch.div(a["w1_global_scale"], g1))
        ex.w2_alphas.copy_(torch.div(a["w2_global_scale"], g2))
    p._scale_key = tuple((v, v._version if isinstance(v, torch.Tensor) else None) for v in opts)


def _plan(p: CuteMoEExperts, M: int, top_k: int, alpha: float, limit: float):
    """(b12x scratch plan, scratch) for M tokens x top_k, made once per key (vLLM's _plan)."""
    swiglu = p.nonlinearity == "swigluoai_uninterleave"
    key = (M, top_k, float(alpha) if swiglu else None, float(limit) if swiglu else None)
    with p._lock:
        hit = p._plans.get(key)
        if hit is not None:
            return hit
        if C.capturing():
            raise RuntimeError(f"kernels_cute.moe: no b12x plan for M={M}, top_k={top_k} yet; run this shape once "
                               "before CUDA graph capture")
        plan = _fm().plan(caps(p.weight_plan, p.recipe, p.nonlinearity, p.device, M, top_k, alpha, limit))
        specs = plan.scratch_specs()
        scratch = torch.empty((int(specs[0].shape[0]),), dtype=torch.uint8, device=p.device)
        p._plans[key] = (plan, scratch)
        return plan, scratch


def fused_moe(x: torch.Tensor, prepared: CuteMoEExperts, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              renormalize: bool = False, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, w13_act_opts: Optional[Mapping] = None,
              w2_act_opts: Optional[Mapping] = None, swiglu_alpha: float = SWIGLU_ALPHA,
              swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """y [M, H] of x's dtype: the routed experts of one MoE layer through b12x's fused MoE, the
    numbers of ``formats.reference_moe(x, w13, w2, topk_ids, topk_weights, activation=...,
    a16=<weight-only variant>, ...)`` within the bound of docs/moe.md.

    Args:
        x: [M, H] of prepared.dtype (bf16 or fp16), CUDA, on the experts' device.
        prepared: ``prepare_experts(...)`` (the activation was fixed there).
        topk_ids: integer [M, top_k] in [0, E) (read to check it: one device synchronization).
        topk_weights: float [M, top_k]; divided by each row's sum first with ``renormalize``.
        w13_bias, w2_bias: must be None (b12x's fused MoE has no expert bias).
        w13_act_opts, w2_act_opts: nvfp4: {"global_scale": g} (a number, or a float tensor of 1 or E
            values), required (static scales only); weight-only variants: must be empty.
        swiglu_alpha, swiglu_limit: the swigluoai activations' (ignored for silu, as the oracle).
    Returns:
        [M, H] tensor of x's dtype; a token whose x row holds NaN/Inf gets a NaN row.
    Raises:
        ValueError naming the argument: prepared not a CuteMoEExperts; x not [M, H] of the prepared
            dtype on its device; topk_ids / topk_weights malformed or out of range; a bias; act opts
            missing (nvfp4) or present (weight-only) or malformed; non-finite or non-positive scales.
        RuntimeError: experts prepared on the CPU (b12x runs on an SM12x GPU only); a new shape under
            CUDA-graph capture; b12x not importable.
    Source: b12x.moe.fused_moe (plan / bind / run), as vLLM's B12xExperts.apply calls it.
    """
    if not isinstance(prepared, CuteMoEExperts):
        raise ValueError(f"prepared must be a CuteMoEExperts (kernels_cute.moe.prepare_experts), "
                         f"got {type(prepared).__name__}")
    p = prepared
    E, H = p.num_experts, p.hidden
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != H or x.dtype != p.dtype:
        raise ValueError(f"x must be a 2-D [M, H={H}] {p.dtype} tensor (the dtype the experts were prepared for), "
                         f"got {_desc(x)}")
    if x.device != p.device:
        raise ValueError(f"x must be on the experts' device {p.device}, got {x.device}")
    ids, wts = topk_ids, topk_weights
    if (not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex
            or ids.dtype == torch.bool or ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] < 1):
        raise ValueError(f"topk_ids must be an integer tensor [M={x.shape[0]}, top_k >= 1], got {_desc(ids)}")
    if not isinstance(wts, torch.Tensor) or not wts.is_floating_point() or wts.shape != ids.shape:
        raise ValueError(f"topk_weights must be a float tensor of topk_ids' shape {tuple(ids.shape)}, got {_desc(wts)}")
    for name, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if b is not None:
            raise ValueError(f"{name} must be None: b12x's fused MoE has no expert bias (vLLM's B12xExperts refuses "
                             f"biased experts too), got {_desc(b)}")
    if p.a16:
        for name, o in (("w13_act_opts", w13_act_opts), ("w2_act_opts", w2_act_opts)):
            if o:
                raise ValueError(f"{name} must be empty for {p.variant} (weight-only: activations stay "
                                 f"{p.dtype}), got {dict(o)}")
    if ids.device != x.device or wts.device != x.device:
        raise ValueError(f"topk_ids and topk_weights must be on x's device {x.device}, "
                         f"got {ids.device} and {wts.device}")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < E:
        raise ValueError(f"topk_ids must lie in [0, {E}) (the expert count), got [{int(ids.min())}, {int(ids.max())}]")
    if p.experts is None or x.device.type != "cuda":
        raise RuntimeError(f"kernels_cute.moe runs on an SM120/SM121 GPU; these experts are on {p.device}: "
                           "prepare them from CUDA weights")
    M, top_k = ids.shape
    if M == 0:
        return x.new_empty((0, H))
    if not p.a16:
        _set_activation_scales(p, w13_act_opts, w2_act_opts)
    w = wts.float()
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    plan, scratch = _plan(p, M, top_k, swiglu_alpha, swiglu_limit)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    fm = _fm()
    binding = fm.bind(plan, scratch=scratch, a=x.contiguous(), experts=p.experts, topk_weights=w.contiguous(),
                      topk_ids=ids.to(torch.int32).contiguous(), output=out, input_scales_static=True,
                      unit_scale_contract=p.recipe == "w4a16")
    fm.run(binding=binding)
    finite = torch.isfinite(x).all(dim=1, keepdim=True)  # b12x's clamps / amax would make them finite
    return torch.where(finite, out, torch.full_like(out, float("nan")))
