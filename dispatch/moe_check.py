"""Numerics checks of one MoE layer call against the float64 oracle: the first wrong expert, then its
first wrong step and block.

Users: ``b12x-dual diff`` (dispatch.apps.diff: every MoE implementation of dispatch.moe's table on
one layer, M and seeded routing), ``b12x-dual diff --replay`` on an MoE replay file, and the
watchdog (``B12X_CHECK``, :func:`after_moe_call` with dispatch.check's Watchdog) on sampled BoundMoE calls
(the call's recorded output checked; on a departure, once per layer, split by expert and step as diff does).

What is compared, for x [M, H] routed by the layer's router (``route_tokens``) to top_k of E experts:

    moe         the call (``backend.apply``) against formats.reference_moe, per (token, 128-column
                tile) of y, in multiples of formats.bounds.moe_bound (derived stage by stage there);
    experts     on a departure, each expert e alone, in expert order: the call on the tokens routed
                to e with topk_ids restricted to e (one expert per token, router weight 1), against
                the oracle of that expert (moe_bound of the restricted call). The first that departs
                is the first wrong expert;
    steps       in that expert, where the implementation exposes its intermediate values
                (MoEBackend.stages: the Triton lesson), each step in forward order against the
                oracle applied to the implementation's own input of that step, so that each step is
                judged alone:
                  w13_input  the W13 input quantized, byte for byte against formats.quantize
                             (codes per row and scale block, block scales, the per-tensor value);
                  w13_gemm   W13's output h (alpha, bias; no activation) against
                             formats.reference_linear on the implementation's quantized input,
                             per (row, 128-column tile of 2I), formats.bounds.gemm_bound (fp32 output);
                  act_fn     the activation (silu / swigluoai) of the implementation's own h against
                             formats.moe_activation in float64, formats.bounds.moe_activation_bound;
                  w2_input   the intermediate quantized, byte for byte against formats.quantize of
                             the implementation's own intermediate;
                  w2_gemm    W2's output against formats.reference_linear on the implementation's
                             quantized intermediate, gemm_bound (fp32 output);
                where it does not (cute: b12x's fused kernel, hopper: the sm_90 MoE keep them on
                chip), the stage is "expert" (the expert's output as a whole);
    combine     where no expert departs alone but the call does: y against the router-weighted sum
                of the experts' own restricted outputs (the weighting, the top_k sum, the rounding).

The prepared experts are also compared byte for byte with the layer's (MoEBackend.prepared_experts),
and the first differing expert, tensor, row and K-block is named beside the finding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

import formats
from formats import QuantizedTensor
from formats.bounds import describe_moe, gemm_bound, moe_activation_bound, moe_bound
from formats.moe import MOE_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT, moe_activation

from .check import TILE_N, _warning_lines, bias_stats, error_grid, grid_summary, quant_diff

log = logging.getLogger("dispatch.check")  # the watchdog's messages, under the dense watchdog's logger

BF16_INTERMEDIATE = ("cute",)
"""Implementations that round W13's output and the intermediate to bf16 (b12x's fused MoE): their
bound carries those roundings (formats.bounds.moe_bound's ``bf16_intermediate``)."""
STEPS = ("w13_input", "w13_gemm", "act_fn", "w2_input", "w2_gemm")
"""The steps of one expert, in forward order."""
STEP_TEXT = {"w13_input": "activation quantization of the W13 input", "w13_gemm": "the W13 GEMM",
             "act_fn": "the activation", "w2_input": "quantization of the W2 input (the intermediate)",
             "w2_gemm": "the W2 GEMM", "expert": "the expert's output (no finer split: the implementation "
             "exposes no intermediate values)", "combine": "the router-weighted combine of the experts' outputs",
             "moe": "the MoE call's output", "unlocated": "the expert's output, though each step it exposes "
             "is within its bound (the departure is outside the steps it exposes)"}


@dataclass
class MoELayer:
    """One MoE layer as diff and the watchdog read it: the experts (E weight QuantizedTensors each:
    W13 [2I, H] gate then up rows (``activation`` says), W2 [H, I]), the router weight float [E, H]
    (None for a replayed call, whose routing is recorded), top_k, renormalize (Qwen3's
    ``norm_topk_prob``), activation (formats.MOE_ACTIVATIONS), the two GEMMs' activation options
    (values may hold one per expert) and biases [E, 2I] / [E, H] or None."""

    name: str
    variant: str
    w13: list
    w2: list
    router: Optional[torch.Tensor] = None
    top_k: int = 2
    renormalize: bool = False
    activation: str = "silu"
    w13_act_opts: dict = field(default_factory=dict)
    w2_act_opts: dict = field(default_factory=dict)
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    @property
    def hidden(self) -> int:
        return self.w13[0].k

    @property
    def intermediate(self) -> int:
        return self.w2[0].k

    def to(self, device) -> "MoELayer":
        mv = lambda o: {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in o.items()}  # noqa: E731
        opt = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, w13=[q.to(device) for q in self.w13], w2=[q.to(device) for q in self.w2],
                       router=opt(self.router), w13_act_opts=mv(self.w13_act_opts), w2_act_opts=mv(self.w2_act_opts),
                       w13_bias=opt(self.w13_bias), w2_bias=opt(self.w2_bias))


def route_tokens(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of Qwen3-MoE / Mixtral (transformers ``Qwen3MoeSparseMoeBlock``, vLLM's
    ``fused_topk``): logits = x . router^T in float32, softmax over the E experts in float32, the
    top_k largest. Returns (topk_ids int32 [M, top_k], topk_weights float32 [M, top_k]) before any
    renormalization (the implementation and the oracle renormalize when the layer asks).
    Raises ValueError for a router that is not [E, H] of x's H or a top_k outside [1, E]."""
    if router.dim() != 2 or router.shape[1] != x.shape[-1]:
        raise ValueError(f"router must be [E, H={x.shape[-1]}], got {tuple(router.shape)}")
    if not 1 <= top_k <= router.shape[0]:
        raise ValueError(f"top_k must be in [1, {router.shape[0]}] (the expert count), got {top_k}")
    logits = x.reshape(-1, x.shape[-1]).float() @ router.float().to(x.device).T
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return ids.to(torch.int32), w


def _opts_e(opts: dict, e: int) -> dict:
    return {k: (v.reshape(-1)[e] if isinstance(v, torch.Tensor) and v.numel() > 1 else v)
            for k, v in (opts or {}).items()}


def _call_kw(layer: MoELayer, renormalize: bool) -> dict:
    return dict(activation=layer.activation, renormalize=renormalize, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
                w13_act_opts=layer.w13_act_opts or None, w2_act_opts=layer.w2_act_opts or None)


def _stage(name: str, y, ref, bound) -> dict[str, Any]:
    grid = error_grid(y, ref, bound)
    return {"stage": name, "grid": grid, **grid_summary(grid), "bias": bias_stats(y, ref, bound)}


def _impl_q(ref: QuantizedTensor, codes: torch.Tensor, scales: torch.Tensor, t: torch.Tensor) -> QuantizedTensor:
    """The lesson's quantized rows (codes, block scales, the expert's per-tensor value t) in the layout
    of the oracle's QuantizedTensor ``ref`` (same rows)."""
    codes, scales, t = codes.cpu(), scales.cpu(), t.cpu()
    data = codes.view(ref.data.dtype).reshape(ref.data.shape)
    if ref.block_shape is None:  # fp8_tensor: the per-tensor scale is t
        scale = t.reshape(ref.scale.shape).to(ref.scale.dtype)
    elif ref.scale.element_size() == 1:
        scale = scales.view(torch.uint8)[:, :ref.scale.shape[-1]].contiguous().view(ref.scale.dtype)
    else:
        scale = scales.to(ref.scale.dtype).reshape(ref.scale.shape)
    gs = None if ref.global_scale is None else t.reshape(ref.global_scale.shape).to(ref.global_scale.dtype)
    return replace(ref, data=data, scale=scale, global_scale=gs)


def _first_weight(backend, prepared, layer: MoELayer) -> Optional[dict]:
    """The first expert whose prepared W13 or W2 differs from the layer's, with the block."""
    try:
        got = backend.prepared_experts(prepared, layer.w13, layer.w2)
    except Exception:  # noqa: BLE001  (informative only)
        return None
    if got is None:
        return None
    for e in range(layer.num_experts):
        for tensor, qs, ws in (("w13", got[0], layer.w13), ("w2", got[1], layer.w2)):
            try:
                d = quant_diff(qs[e].to("cpu"), ws[e].to("cpu"))
            except ValueError:
                return None
            if not d["equal"]:
                return {"expert": e, "tensor": tensor, **d["first"]}
    return None


def _quant_first(impl_q: QuantizedTensor, ref_q: QuantizedTensor, tokens: torch.Tensor) -> tuple[dict, Optional[dict]]:
    d = quant_diff(impl_q, ref_q)
    if d["equal"]:
        return d, None
    f = d["first"]
    return d, {"row": int(tokens[f["row"]]), "kblock": f["kblock"], "what": f["what"], "columns": f["columns"]}


def _grid_first(st: dict, tokens: torch.Tensor) -> Optional[dict]:
    if st["first"] is None:
        return None
    r, t = st["first"]["row"], st["first"]["tile"]
    return {"row": int(tokens[r]), "tile": t, "ratio": float(st["grid"][r, t])}


def expert_steps(backend, prepared, layer: MoELayer, e: int, x_e: torch.Tensor, tokens: torch.Tensor,
                 device_kind: str) -> tuple[list[dict], Optional[dict], Optional[torch.Tensor]]:
    """Expert ``e``'s steps (:data:`STEPS`) on its own tokens ``x_e`` [n, H] (rows of x ``tokens``), each
    judged on the implementation's own input of that step. Returns ([step results], the first departing
    step {"step", "row" (a token of x), "tile" | "kblock", ...} or None, the implementation's
    intermediate [n, I] or None); ([], None, None) where the backend exposes no stages."""
    n = x_e.shape[0]
    ids = torch.full((n, 1), e, dtype=torch.int32, device=x_e.device)
    ones = torch.ones((n, 1), dtype=torch.float32, device=x_e.device)
    with torch.no_grad():
        st = backend.stages(x_e, prepared, ids, ones, **_call_kw(layer, False),
                            swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT)
    if st is None:
        return [], None, None
    a16 = backend.a16
    fmt = layer.w13[0].fmt
    w13, w2 = layer.w13[e].to("cpu"), layer.w2[e].to("cpu")
    b13 = None if layer.w13_bias is None else layer.w13_bias[e].cpu()
    b2 = None if layer.w2_bias is None else layer.w2_bias[e].cpu()
    xc = x_e.cpu()
    out, first = [], None

    def note(step, res, f):
        nonlocal first
        out.append({"step": step, **res})
        if f is not None and first is None:
            first = {"step": step, **f}

    # W13's input
    if a16:
        xin = xc
    else:
        ref_q = formats.quantize(xc, fmt, role="activation", **_opts_e(layer.w13_act_opts, e))
        xin = _impl_q(ref_q, st.x_q[0], st.x_q[1], st.x_q[2][e])
        d, f = _quant_first(xin, ref_q, tokens)
        note("w13_input", {"quant": d}, f)
    # W13's GEMM on the implementation's own quantized input
    h = st.h.cpu()
    ref_h = formats.reference_linear(xin, w13, b13, a16=a16, out_dtype=torch.float32)
    s = _stage("w13_gemm", h, ref_h, gemm_bound(xin, w13, b13, torch.float32, ref_h))
    note("w13_gemm", s, _grid_first(s, tokens))
    # the activation of the implementation's own h
    a = st.a.cpu()
    h64 = h.double()
    a64 = moe_activation(h64, layer.activation, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT)
    i = h.shape[1] // 2
    gate = h64[:, 0::2] if layer.activation == "swigluoai" else h64[:, :i]
    s = _stage("act_fn", a, a64, moe_activation_bound(gate, a64, activation=layer.activation, a16=a16))
    note("act_fn", s, _grid_first(s, tokens))
    # W2's input: the implementation's own intermediate, quantized
    if a16:
        ain = a.float()
    else:
        ref_a = formats.quantize(a.float(), fmt, role="activation", **_opts_e(layer.w2_act_opts, e))
        ain = _impl_q(ref_a, st.a_q[0], st.a_q[1], st.a_q[2][e])
        d, f = _quant_first(ain, ref_a, tokens)
        note("w2_input", {"quant": d}, f)
    ref_o = formats.reference_linear(ain, w2, b2, a16=a16, out_dtype=torch.float32)
    s = _stage("w2_gemm", st.o.cpu(), ref_o, gemm_bound(ain, w2, b2, torch.float32, ref_o))
    note("w2_gemm", s, _grid_first(s, tokens))
    return out, first, a


def compare_moe(backend, layer: MoELayer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                renormalize: Optional[bool] = None, device_kind: Optional[str] = None, prepared=None,
                y: Optional[torch.Tensor] = None, split: bool = True) -> dict[str, Any]:
    """Run one MoE backend (dispatch.moe.MoEBackend) on a call and find where it departs.

    Args:
        backend: a dispatch.moe MoEBackend of the layer's variant.
        layer: the MoELayer (its experts, activation, options).
        x: [M, H] bf16/fp16; topk_ids int [M, top_k]; topk_weights float [M, top_k] (before renormalization).
        renormalize: default the layer's.
        device_kind: "cpu" or "cuda" (informative; the MoE bound is the same on both).
        prepared: what backend.prepare returned (default: prepared here).
        y: the call's recorded output (the watchdog, a replay): checked instead of running apply.
        split: on a departure, run each expert alone and its steps (diff); False: the call only.
    Returns:
        {"impl", "variant", "M", "E", "top_k", "H", "I", "out_dtype", "bound": text, "moe": {"stage",
        "grid" [M, ceil(H/128)], "worst", "n_bad", "first", "bias"}, "experts": [{"expert", "tokens",
        "worst", "n_bad", "ok", "steps": [...]}] (in expert order, up to the first that departs),
        "combine": stage or None, "weight": the first prepared expert tensor that differs from the
        layer's or None, "stages_exposed": bool, "first": {"stage", "expert", "row", "tile" | "kblock",
        ...} or None, "ok", "error": text when the backend raised}.
    """
    renorm = layer.renormalize if renormalize is None else renormalize
    x2 = x.reshape(-1, x.shape[-1])
    M, top_k = topk_ids.shape
    kw = _call_kw(layer, renorm)
    res: dict[str, Any] = {"impl": backend.impl, "variant": backend.variant, "M": M, "E": layer.num_experts,
                           "top_k": top_k, "H": layer.hidden, "I": layer.intermediate,
                           "out_dtype": str(x2.dtype).replace("torch.", ""), "bound": describe_moe(x2.dtype),
                           "moe": None, "experts": [], "combine": None, "weight": None, "stages_exposed": False,
                           "first": None, "ok": False, "error": None, "kind": "moe"}
    try:
        if prepared is None:
            prepared = backend.prepare(layer.w13, layer.w2, activation=layer.activation)
        res["weight"] = _first_weight(backend, prepared, layer)
        with torch.no_grad():
            if y is None:
                y = backend.apply(x2, prepared, topk_ids, topk_weights, **kw)
            st = backend.stages(x2, prepared, topk_ids, topk_weights, **kw) if split else None
        res["stages_exposed"] = st is not None
        ref, bound = moe_bound(x2, layer.w13, layer.w2, topk_ids, topk_weights, a16=backend.a16,
                               inter=None if st is None else st.a, out_dtype=y.dtype,
                               bf16_intermediate=backend.impl in BF16_INTERMEDIATE, **kw)
        res["moe"] = _stage("moe", y.reshape(M, -1), ref, bound)
        if res["moe"]["first"] is None:
            res["ok"] = True
            return res
        f = res["moe"]["first"]
        moe_first = {"stage": "moe", "row": f["row"], "tile": f["tile"],
                     "ratio": float(res["moe"]["grid"][f["row"], f["tile"]])}
        if not split:
            res["first"] = moe_first
            return res
        res["first"] = _split(backend, prepared, layer, x2, topk_ids, topk_weights, y, renorm, res,
                              device_kind or x2.device.type) or moe_first
    except Exception as e:  # noqa: BLE001  (a backend that raises on a call it claimed fails it, with the reason)
        res["error"] = f"{type(e).__name__}: {e}"
        res["first"] = {"stage": "error", "detail": res["error"]}
    res["ok"] = res["error"] is None and res["first"] is None
    return res


def _split(backend, prepared, layer, x2, topk_ids, topk_weights, y, renorm, res, device_kind) -> Optional[dict]:
    """Each expert alone, in order; the first that departs, then its first step; else the combine."""
    ids_cpu = topk_ids.cpu()
    outs = {}  # expert -> (tokens, slots j, its own output [n, H] float64, its bound, the oracle's)
    for e in range(layer.num_experts):
        tokens, js = torch.nonzero(ids_cpu == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        x_e = x2[tokens.to(x2.device)]
        n = tokens.numel()
        ids_e = torch.full((n, 1), e, dtype=torch.int32, device=x2.device)
        ones = torch.ones((n, 1), dtype=torch.float32, device=x2.device)
        kw = _call_kw(layer, False)
        with torch.no_grad():
            y_e = backend.apply(x_e, prepared, ids_e, ones, **kw)
            steps, step_first, inter = expert_steps(backend, prepared, layer, e, x_e, tokens, device_kind)
        ref_e, bound_e = moe_bound(x_e, layer.w13, layer.w2, ids_e, ones, a16=backend.a16, inter=inter,
                                   out_dtype=y_e.dtype, bf16_intermediate=backend.impl in BF16_INTERMEDIATE, **kw)
        s = _stage("expert", y_e, ref_e, bound_e)
        ok = s["first"] is None
        res["experts"].append({"expert": e, "tokens": tokens.tolist(), "worst": s["worst"], "n_bad": s["n_bad"],
                               "ok": ok, "steps": steps})
        if not ok:
            if step_first is not None:
                return {"stage": step_first.pop("step"), "expert": e, **step_first}
            g = _grid_first(s, tokens)
            return {"stage": "unlocated" if steps else "expert", "expert": e, **g}
        outs[e] = (tokens, js, y_e.double().cpu(), bound_e, ref_e)
    # no expert departs alone: the combine (router weights, renormalization, the top_k sum, the rounding)
    w = topk_weights.double().cpu()
    w = w / w.sum(dim=-1, keepdim=True) if renorm else w
    M, H = y.reshape(y.shape[0], -1).shape
    comb = torch.zeros(M, H, dtype=torch.float64)
    slack = torch.zeros(M, H, dtype=torch.float64)
    for e, (tokens, js, o, b, r) in outs.items():
        we = w[tokens, js].unsqueeze(1)
        comb.index_add_(0, tokens, we * o)
        # the call's own output of this (token, expert) is within b of the oracle r; this run's o is |o - r| from it
        slack.index_add_(0, tokens, we.abs() * (b + (o - r).abs() + (2 * w.shape[1] + 2) * 2.0 ** -24 * o.abs()))
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[y.dtype]
    bound = slack + 2.0 ** (1 - p) * comb.abs() + torch.finfo(y.dtype).smallest_normal * 2.0 ** (1 - p)
    s = _stage("combine", y.reshape(M, H), comb, bound)
    res["combine"] = s
    if s["first"] is not None:
        r, t = s["first"]["row"], s["first"]["tile"]
        return {"stage": "combine", "row": r, "tile": t, "ratio": float(s["grid"][r, t])}
    return None


def describe_first(first: Optional[dict]) -> str:
    """One line for an MoE call's first departure."""
    if first is None:
        return "none"
    if first["stage"] == "error":
        return f"raised {first['detail']}"
    where = f"expert {first['expert']}: " if "expert" in first else ""
    text = STEP_TEXT.get(first["stage"], first["stage"])
    if "kblock" in first:
        cols = first.get("columns")
        cols = f" (columns {cols[0]}-{cols[1]})" if cols else ""
        what = {"codes": "codes", "scale": "a block scale", "global_scale": "the global scale",
                "tensor_scale": "the per-tensor scale"}.get(first.get("what"), first.get("what"))
        return f"{where}{text} departs first: {what} of token {first['row']}, K-block {first['kblock']}{cols}"
    c0 = first["tile"] * TILE_N
    return (f"{where}{text} departs first: token {first['row']}, column tile {first['tile']} "
            f"(columns {c0}-{c0 + TILE_N - 1}), {first['ratio']:.3g}x the bound")


def weight_note(w: Optional[dict]) -> str:
    """The first prepared expert tensor that differs from the layer's, as a clause (or "")."""
    if not w:
        return ""
    what = {"codes": "a code", "scale": "a block scale", "global_scale": "the global scale",
            "tensor_scale": "the per-tensor scale"}.get(w["what"], w["what"])
    return (f"; {what} of the implementation's prepared expert {w['expert']} {w['tensor'].upper()} differs from "
            f"the layer's at row {w['row']}, K-block {w['kblock']}")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """A compare_moe result without its tensors (JSON-able)."""
    out = {k: v for k, v in res.items() if k not in ("moe", "combine", "experts")}
    for name in ("moe", "combine"):
        st = res.get(name)
        out[name] = None if st is None else {k: v for k, v in st.items() if k != "grid"}
    out["experts"] = [{k: v for k, v in ex.items() if k != "steps"} for ex in res.get("experts", [])]
    return out


def after_moe_call(wd, layer: str, backend, bound, x: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, renormalize: bool, y: torch.Tensor) -> Optional[dict]:
    """The watchdog's check of an MoE call (dispatch.moe.BoundMoE) that returned ``y``, if ``wd`` (a
    dispatch.check.Watchdog: the sampling rule and state of B12X_CHECK, per layer name) samples it:
    y against formats.reference_moe on the call's own routing, per (token, 128-column tile), in
    multiples of formats.bounds.moe_bound (:func:`compare_moe` on the recorded output: the call is
    not rerun). A call within the bound is counted in ``wd.clean``. On a departure (once per layer:
    a diverged layer is not sampled again) the call is split as diff splits it: each expert rerun
    alone on its own tokens, in expert order, then the first departing expert's steps where the
    implementation exposes them (else the combine), so that the report names the first wrong expert
    and step ("first"; "moe" keeps the whole call's check). Returns that report (logged once per
    layer as a WARNING naming the layer, the expert and the step, and written as an MoE replay file
    that ``b12x-dual diff --replay`` reruns), else None. A check that itself fails is logged once
    (ERROR), never raised; a split that fails leaves the whole call's finding; a malformed
    B12X_CHECK raises."""
    if hasattr(wd, "err"):  # dispatch.check._Invalid: a malformed B12X_CHECK
        raise wd.err
    if wd._capturing(x) or not wd.sample(layer):
        return None
    lay = MoELayer(layer, bound.variant, bound.w13, bound.w2, None, topk_ids.shape[1], renormalize, bound.activation,
                   dict(bound.w13_act_opts), dict(bound.w2_act_opts), bound.w13_bias, bound.w2_bias)
    prepared = bound.backends.get(backend.name)
    try:
        with torch.no_grad():
            res = compare_moe(backend, lay, x, topk_ids, topk_weights, y=y, split=False, prepared=prepared)
        if res["error"]:
            raise RuntimeError(res["error"])
    except Exception as e:  # noqa: BLE001  (the check must not take the server down; it says why, once)
        wd.give_up(layer, backend, e, "MoE layer")
        return None
    if res["ok"]:
        wd.passed(layer)
        return None
    wd.departed(layer)
    from . import replay
    from .devices import device_of

    # which expert, which step: each expert rerun alone (once per layer, as this layer is not sampled again)
    x2 = x.reshape(-1, x.shape[-1])
    try:
        first = _split(backend, prepared, lay, x2, topk_ids, topk_weights, y, renormalize, res, x2.device.type)
        if first is not None:
            res["first"] = first
    except Exception as e:  # noqa: BLE001  (the whole call's finding stands; say why it is not finer)
        res["split_error"] = f"{type(e).__name__}: {e}"
    M = x.shape[0]
    try:
        res["route"] = backend.route(bound.problem(M, topk_ids.shape[1], x.dtype), device_of(x)).describe()
    except Exception as e:  # noqa: BLE001  (a route that cannot be described must not hide the report)
        res["route"] = f"(route unavailable: {type(e).__name__}: {e})"
    res["layer"] = layer
    path = None
    try:
        path = replay.write_moe(wd.directory, layer=lay, impl=backend.impl, x=x, topk_ids=topk_ids,
                                topk_weights=topk_weights, y=y, route=res["route"], report=summarize(res))
    except Exception as e:  # noqa: BLE001  (a full disk must not take the server down; say so)
        log.error("b12x-dual watchdog: could not write the replay file for %s to %s: %s", layer, wd.directory, e)
    res["replay"] = None if path is None else str(path)
    with wd._lock:
        wd.diverged[layer] = res
    finding = describe_first(res["first"]) + weight_note(res["weight"]) + f" (E={res['E']}, top_k={res['top_k']})"
    if "split_error" in res:
        finding += f"; the split by expert failed ({res['split_error']}): the replay reruns it"
    log.warning("%s", _warning_lines(res, backend, finding))
    return res


__all__ = ["MoELayer", "STEPS", "after_moe_call", "compare_moe", "describe_first", "expert_steps", "route_tokens",
           "summarize", "weight_note"]
