"""The mixture-of-experts layer as a spec, and its float64 oracle.

One MoE layer (the routed experts of Qwen3-MoE, gpt-oss, DeepSeek-style models) computes, per token t
with the router's choice of ``top_k`` experts ``topk_ids[t]`` and weights ``topk_weights[t]``:

    h_j   = x[t] . W13[e]^T (+ b13[e])          e = topk_ids[t, j];  W13[e] is [2I, H], h_j is [2I]
    a_j   = act(h_j)                            gate/up halves of h_j -> [I]
    o_j   = a_j . W2[e]^T (+ b2[e])             W2[e] is [H, I], o_j is [H]
    y[t]  = sum_j topk_weights[t, j] * o_j      (weights renormalized to sum 1 first if asked)

Each expert's two GEMMs are exactly the dense layer of ``formats.reference_linear``: its input is
quantized in the weights' format as an activation (unless weight-only, ``a16``), and the
intermediate ``a_j`` is quantized again before W2. Activations (``MOE_ACTIVATIONS``, vLLM's
``MoEActivation`` names):

    silu                    gate = h[:I], up = h[I:]      a = silu(gate) * up
    swigluoai               gate = h[0::2], up = h[1::2]  a = (clamp(up, -L, L) + 1) * g * sigmoid(alpha g),
                                                              g = clamp(gate, max=L)
    swigluoai_uninterleave  gate = h[:I], up = h[I:]      the same as swigluoai

``silu`` is Qwen3-MoE / DeepSeek / Mixtral (transformers ``Qwen3MoeExperts``, vLLM
``SiluAndMul``: W13 holds gate first, then up). ``swigluoai`` is gpt-oss's clamped SwiGLU with
alpha = 1.702, limit L = 7.0 and gate/up interleaved in W13 (transformers
``GptOssExperts._apply_gate``; vLLM ``SwigluOAIAndMul.forward_native``, vllm 0.33.0
model_executor/layers/activation.py lines 475-506, and ``MoEActivation.SWIGLUOAI`` in
fused_moe/activation.py lines 30-36); ``swigluoai_uninterleave`` is the same arithmetic over a
W13 whose gate rows come first (vLLM's ``SWIGLUOAI_UNINTERLEAVE``, what b12x's fused MoE runs).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from .base import FLOAT_DTYPES, QuantizedTensor
from .oracle import FORMATS, OUT_DTYPES, dequantize, quantize
from .validate import check_weight

MOE_ACTIVATIONS = ("silu", "swigluoai", "swigluoai_uninterleave")
SWIGLU_ALPHA = 1.702  # gpt-oss's swiglu_alpha (GptOssConfig; vLLM SwigluOAIAndMul default)
SWIGLU_LIMIT = 7.0  # gpt-oss's swiglu_limit



def moe_activation(h: torch.Tensor, activation: str = "silu", *, swiglu_alpha: float = SWIGLU_ALPHA,
                   swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The gated activation of an expert: [..., 2I] -> [..., I], in h's dtype (float64 here).

    Args:
        h: the W13 GEMM's output (bias added), [..., 2I] float tensor.
        activation: one of MOE_ACTIVATIONS (see the module docstring for the gate/up order of each).
        swiglu_alpha, swiglu_limit: gpt-oss's alpha and limit (swigluoai activations only).
    Returns:
        [..., I] tensor; NaN or Inf in h never becomes finite: silu propagates it, and the
        swigluoai clamps, which would map +-Inf to the limit, give NaN for a non-finite gate or up
        (gpt-oss's code would clamp it; the project's non-finite rule, docs/formats.md, wins).
    Raises:
        ValueError: an unknown activation, or an odd last dimension.
    Source: transformers Qwen3MoeExperts (silu(gate) * up) and GptOssExperts._apply_gate; vLLM
    SiluAndMul / SwigluOAIAndMul.forward_native.
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if h.shape[-1] % 2:
        raise ValueError(f"the W13 output must have an even width [..., 2I], got {h.shape[-1]}")
    i = h.shape[-1] // 2
    # [moe-activation]
    if activation == "swigluoai":
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h[..., :i], h[..., i:]
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    # the clamps would turn +-Inf into the limit: a non-finite gate or up gives NaN instead
    nan = torch.full_like(gate, float("nan"))
    gate = torch.where(torch.isfinite(gate), gate.clamp(max=swiglu_limit), nan)
    up = torch.where(torch.isfinite(up), up.clamp(min=-swiglu_limit, max=swiglu_limit), nan)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
    # [/moe-activation]


def experts_from_stacked(fmt: str, data: torch.Tensor, scale: torch.Tensor,
                         global_scale: Optional[torch.Tensor] = None, *, name: str = "w13") -> list[QuantizedTensor]:
    """Split stacked expert weights (vLLM FusedMoE's layout) into one weight QuantizedTensor per expert.

    Args:
        fmt: the format (formats.FORMAT_NAMES).
        data: [E, N, K] float8_e4m3fn codes (fp8_tensor, fp8_block, mxfp8) or [E, N, K/2] uint8
            packed e2m1 codes (nvfp4, mxfp4), as vLLM's ``w13_weight`` / ``w2_weight``.
        scale: [E] or [E, 1] float32 (fp8_tensor, one scale per expert after vLLM merges the gate
            and up scales); [E, ceil(N/128), K/128] float32 (fp8_block); [E, N, K/32] uint8 E8M0
            (mxfp8, mxfp4); [E, N, K/16] float8_e4m3fn (nvfp4). Linear layout (not swizzled).
        global_scale: nvfp4 only: [E] or [E, 1] float32, each expert's g (a multiplier, as
            vLLM's ``w13_weight_global_scale`` after loading); None otherwise.
        name: the argument name used in messages (each expert is ``name[e]``).
    Returns:
        A list of E QuantizedTensors with role "weight", shape (N, K), sharing storage with the inputs.
    Raises:
        ValueError naming ``name``: an unknown format, data that is not [E, N, ...], a scale or global
        scale whose first dimension is not E, and every per-expert malformation that
        formats.validate.check_weight finds (dtype, shape, block shape, a global scale where the
        format has none).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    if not isinstance(data, torch.Tensor) or data.dim() != 3:
        got = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{name} data must be a 3-D tensor [E, N, K or K/2], got {got}")
    e, n, kd = data.shape
    k = kd * 2 if FORMATS[fmt].SPEC.element == "e2m1" else kd  # two e2m1 codes per byte
    if not isinstance(scale, torch.Tensor) or scale.dim() < 1 or scale.shape[0] != e:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{name} scale must be a tensor whose first dimension is the expert count {e}, got {got}")
    if global_scale is not None and (not isinstance(global_scale, torch.Tensor) or global_scale.numel() != e):
        got = tuple(global_scale.shape) if isinstance(global_scale, torch.Tensor) else type(global_scale).__name__
        raise ValueError(f"{name} global_scale must hold one value per expert ({e}), got {got}")
    block = FORMATS[fmt].SPEC.weight_block
    if block is None and scale.numel() != e:
        raise ValueError(f"{name} scale must hold one per-tensor scale per expert ([{e}] or [{e}, 1]) for {fmt}, "
                         f"got shape {tuple(scale.shape)} (vLLM loads [E, 2], gate and up, and merges them "
                         "into one per expert in process_weights_after_loading)")
    if block is not None:  # a row-scaled format (fp8_channel) writes its K extent as None
        block = tuple(k if b is None else b for b in block)
    out = []
    for i in range(e):
        s = scale[i].reshape(()) if block is None else scale[i]
        g = None if global_scale is None else global_scale.reshape(e)[i]
        q = QuantizedTensor(fmt, "weight", data[i], s, g, block, (n, k))
        check_weight(q, fmt, name=f"{name}[{i}]", layouts=("linear",))
        out.append(q)
    return out


def _check_experts(w, name: str) -> tuple[str, int, int, int]:
    """(fmt, E, rows, K) of a per-expert weight list, after checking each weight's metadata."""
    if isinstance(w, QuantizedTensor) or not isinstance(w, Sequence) or len(w) == 0:
        got = f"one {w.fmt} QuantizedTensor" if isinstance(w, QuantizedTensor) else type(w).__name__
        raise ValueError(f"{name} must be a non-empty sequence of weight QuantizedTensors, one per expert, got {got}"
                         + (" (for vLLM's stacked [E, N, K] tensors use formats.moe.experts_from_stacked)"
                            if isinstance(w, (QuantizedTensor, torch.Tensor)) else ""))
    for e, q in enumerate(w):
        check_weight(q, name=f"{name}[{e}]")
    fmt, shape = w[0].fmt, w[0].shape
    for e, q in enumerate(w):
        if q.fmt != fmt:
            raise ValueError(f"every expert of {name} must have one format: {name}[0] is {fmt}, {name}[{e}] is {q.fmt}")
        if q.shape != shape:
            raise ValueError(f"every expert of {name} must have one shape: {name}[0] is {shape}, {name}[{e}] is {q.shape}")
    return fmt, len(w), shape[0], shape[1]


def _check_bias(b, name: str, e: int, n: int) -> Optional[torch.Tensor]:
    if b is None:
        return None
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != (e, n):
        got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise ValueError(f"{name} must be a tensor of shape ({e}, {n}) (one bias row per expert), got {got}")
    if b.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {b.dtype}")
    return b.to(torch.float64)


def _expert_opts(opts: Optional[Mapping], e: int, n_experts: int, name: str) -> dict:
    """Expert e's activation-quantization options: a value with one entry per expert is indexed."""
    out = {}
    for key, v in (opts or {}).items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() > 1:
            if v.numel() != n_experts:
                raise ValueError(f"{name}[{key!r}] must be one value or one per expert ({n_experts}), "
                                 f"got shape {tuple(v.shape)}")
            v = v.reshape(-1)[e]
        out[key] = v
    return out


def reference_moe(
    x: torch.Tensor,
    w13: Sequence[QuantizedTensor],
    w2: Sequence[QuantizedTensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "silu",
    renormalize: bool = False,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    a16: bool = False,
    w13_act_opts: Optional[Mapping] = None,
    w2_act_opts: Optional[Mapping] = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """One MoE layer's routed experts from the dequantized operands, in float64, rounded once.

    Args:
        x: [M, H] float32/bf16/fp16 hidden states.
        w13: E weight QuantizedTensors [2I, H], one per expert (role "weight", one format and shape),
            gate and up stacked as ``activation`` reads them (module docstring).
        w2: E weight QuantizedTensors [H, I] of the same format.
        topk_ids: [M, top_k] integer tensor, expert indices in [0, E) (no -1: expert parallelism's
            "not on this rank" marker has no meaning for a whole layer).
        topk_weights: [M, top_k] float tensor, the router's weights.
        activation: one of MOE_ACTIVATIONS.
        renormalize: divide each token's weights by their sum first (vLLM's ``renormalize``, Qwen3's
            ``norm_topk_prob``); a sum of 0 gives NaN, never a silent 0.
        w13_bias: optional [E, 2I] float tensor (in W13's row order); w2_bias: optional [E, H].
        a16: weight-only numerics (W4A16 / W8A16 variants: nvfp4_w4a16, mxfp4_w4a16): no activation
            is quantized, the intermediate stays float64.
        w13_act_opts, w2_act_opts: options of the activation quantization before W13 and before W2,
            as formats.quantize takes them (fp8_tensor ``scale``, nvfp4 ``global_scale``, mx
            ``scale_rule``, fp8_block ``ue8m0``); a value may be one tensor element per expert
            ([E]: vLLM's per-expert ``w13_input_scale`` / ``w2_input_global_scale``).
        swiglu_alpha, swiglu_limit: for the swigluoai activations.
        out_dtype: bf16/fp16/fp32/fp64; default x's dtype.
    Returns:
        [M, H] tensor of ``out_dtype``.

    The representation: a per-expert list, because every expert is exactly a dense layer of this
    package (its QuantizedTensor, its checks, its dequantize), and because the per-expert scalars
    that MoE checkpoints carry (fp8_tensor's weight scale, nvfp4's global scale, one per expert
    after vLLM merges the gate and up shards) are each QuantizedTensor's own. vLLM's FusedMoE holds
    the same numbers stacked (``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I] and scales
    [E, ...]); ``experts_from_stacked`` turns those into this list without copying.

    Activation quantization, per expert GEMM, by formats.reference_linear's rules: expert e's input
    is the rows of x routed to it (in token order) and is quantized as one activation tensor; the
    intermediate rows of expert e are quantized again before W2. So a dynamic per-tensor scale
    (fp8_tensor without ``scale``, nvfp4 without ``global_scale``) is the amax over the expert's
    own tokens, as a per-expert nn.Linear under compressed-tensors computes it; vLLM's fused MoE
    takes one scale over the whole batch instead (docs/moe.md). Per-row and per-block scales
    (fp8_block, mxfp8, mxfp4, nvfp4's block scales) do not depend on the grouping.

    Roundings: the GEMMs, the activation, the router weights and the sum are float64. The only
    intermediate rounding is where the format defines one: the intermediate is quantized in the
    format's float32 arithmetic (formats.quantize takes float32; the cast to float32 comes before
    its scale is computed); weight-only paths keep it float64. The output is rounded once, at the end.

    Non-finite values: NaN or Inf in a token's row of x makes that token's output non-finite, and
    with a dynamic per-tensor scale every token routed to the same expert (the scale is NaN: the
    non-finite rule of docs/formats.md); NaN in topk_weights, in a bias or in a weight's codes
    makes the outputs it reaches NaN. Nothing non-finite becomes finite.

    Raises:
        ValueError naming the argument: x not a [M, H] float tensor; w13/w2 not per-expert weight
            lists, of mixed formats or shapes, or malformed (formats.validate.check_weight); an expert
            count that differs between w13 and w2; H or I that disagree between x, w13 and w2 (for
            the gated activations W13 has 2I rows); topk_ids not integer, topk_ids / topk_weights not
            [M, top_k] or of different shapes; an expert id outside [0, E); biases not [E, 2I] / [E, H];
            an unknown activation; an act_opts value with neither one nor E entries; a bad out_dtype.
    Source: vLLM FusedMoE (fused_moe/layer.py: w13 gate-then-up, top-k weighted sum), transformers
    Qwen3MoeExperts / GptOssExperts (per-expert loop), formats.reference_linear (each GEMM).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D [M, H] float32/bfloat16/float16 tensor, got {got}")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    fmt, e13, n13, h13 = _check_experts(w13, "w13")
    fmt2, e2, h2, i2 = _check_experts(w2, "w2")
    if fmt2 != fmt:
        raise ValueError(f"w13 and w2 must have one format, got {fmt} and {fmt2}")
    if e13 != e2:
        raise ValueError(f"w13 and w2 must have the same expert count, got {e13} and {e2}")
    m, h = x.shape
    if h13 != h:
        raise ValueError(f"w13's K (hidden) must equal x.shape[1]={h}, got w13 of shape {w13[0].shape}")
    if h2 != h:
        raise ValueError(f"w2's rows (hidden) must equal x.shape[1]={h}, got w2 of shape {w2[0].shape}")
    if n13 != 2 * i2:
        raise ValueError(f"w13 must have 2 * I = {2 * i2} rows (gate and up) for w2's I={i2}, "
                         f"got w13 of shape {w13[0].shape}")
    n_experts = e13
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex \
            or topk_ids.dtype == torch.bool:
        got = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__
        raise ValueError(f"topk_ids must be an integer tensor [M, top_k], got {got}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [M={m}, top_k >= 1], got {tuple(topk_ids.shape)}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in FLOAT_DTYPES:
        got = topk_weights.dtype if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
        raise ValueError(f"topk_weights must be a float32/bfloat16/float16 tensor [M, top_k], got {got}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= n_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(f"topk_ids must lie in [0, {n_experts}) (the expert count), got {bad}")
    b13 = _check_bias(w13_bias, "w13_bias", n_experts, n13)
    b2 = _check_bias(w2_bias, "w2_bias", n_experts, h)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")

    # [moe-loop]
    w = topk_weights.to(torch.float64)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros(m, h, dtype=torch.float64, device=x.device)
    ids = topk_ids.to(x.device)
    for e in range(n_experts):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)  # token order
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        if a16:
            xe64 = xe.to(torch.float64)
        else:
            xq = quantize(xe, fmt, role="activation", **_expert_opts(w13_act_opts, e, n_experts, "w13_act_opts"))
            xe64 = dequantize(xq, torch.float64)
        he = xe64 @ dequantize(w13[e], torch.float64).T
        if b13 is not None:
            he = he + b13[e]
        ae = moe_activation(he, activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        if not a16:
            aq = quantize(ae.to(torch.float32), fmt, role="activation",
                          **_expert_opts(w2_act_opts, e, n_experts, "w2_act_opts"))
            ae = dequantize(aq, torch.float64)
        oe = ae @ dequantize(w2[e], torch.float64).T
        if b2 is not None:
            oe = oe + b2[e]
        y.index_add_(0, tokens, oe * w[tokens, slots].unsqueeze(1))
    return y.to(out_dtype)
    # [/moe-loop]
