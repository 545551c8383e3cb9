"""The element-wise bound on a GEMM's error against the float64 oracle, derived from the arithmetic.

The kernels multiply exactly decoded operands (e4m3/e2m1 codes times powers of two; e4m3 or fp32
scales are exact in fp32 or bf16, and so are the products of two of them), so a kernel's error
against :func:`formats.reference_linear` on the same quantized operands comes from three places:

* its K-term summation: |acc - exact| <= K u_acc sum_k |a_k b_k| (Higham's gamma_K), u_acc = 2^-24
  for an fp32 accumulator. Hopper's fp8 MMA keeps ~13 accumulator mantissa bits (2^-12 per addition)
  within a promotion interval of L products and the kernels add the interval sums in fp32:
  (L 2^-12 + K 2^-24) sum_k |a_k b_k| (``fp8_interval`` = L);
* the epilogue: the scales or nvfp4's alpha (two reciprocals and a product) and the bias, at most 6
  fp32 roundings: 6 2^-24 (|y| + |bias|);
* y and the oracle are each rounded once to the output dtype, so they may sit one spacing apart:
  spacing(v) <= 2^(1-p) |v| for p significand bits (bf16 8, fp16 11, fp32 24), plus one subnormal
  spacing for results that underflow.

A split-K that adds its partial sums with bf16 atomics (``bf16_adds`` = S partials) adds S 2^-8
sum_k |a_k b_k| (each addition rounds the running sum to bf16, relative error 2^-8, and the running
sum is at most the sum of |partials|).

This is the bound the kernel tests assert (tests/conftest.py ``gemm_bound``), ``b12x-dual diff``
reports errors in multiples of, and the numerics watchdog (dispatch.check) compares against.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .base import QuantizedTensor

OUT_P = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
"""Significand bits p (the implicit bit included) of each output dtype the bound covers."""

U32 = 2.0 ** -24
U_FP8_MMA = 2.0 ** -12
U_BF16 = 2.0 ** -8


def describe(out_dtype: torch.dtype, *, fp8_interval: int = 0, bf16_adds: int = 0) -> str:
    """The bound's formula for these parameters, as one line of text (with its source)."""
    p = OUT_P[out_dtype]
    acc = "K 2^-24" if not fp8_interval else f"({fp8_interval} 2^-12 + K 2^-24)"
    if bf16_adds:
        acc = f"({acc} + {bf16_adds} 2^-8)"
    return (f"|y - ref| <= {acc} |x|.|w|^T + 6 2^-24 (|ref| + |bias|) + 2^{1 - p} |ref| + tiny "
            f"({str(out_dtype).replace('torch.', '')} output; formats/bounds.py: fp32 summation"
            + (", fp8 MMA promotion interval" if fp8_interval else "")
            + (", bf16 split-K atomics" if bf16_adds else "") + ", epilogue, one output rounding each)")


def gemm_bound(x: Union[QuantizedTensor, torch.Tensor], qweight: QuantizedTensor, bias: Optional[torch.Tensor],
               out_dtype: torch.dtype, ref: torch.Tensor, *, fp8_interval: int = 0,
               bf16_adds: int = 0) -> torch.Tensor:
    """The bound of the module docstring, element-wise.

    Args:
        x: the activation as the kernel multiplies it: a QuantizedTensor [M, K] (W4A4 / W8A8) or a
            float tensor [..., K] (W4A16).
        qweight: the weight, a QuantizedTensor [N, K].
        bias: None or [N].
        out_dtype: bfloat16, float16 or float32: the dtype y and ref were rounded to.
        ref: the oracle's output [M, N] (any float dtype; its magnitude enters the bound).
        fp8_interval: L > 0 when the products are summed on an fp8 MMA in runs of L (Hopper: 128 for
            fp8_tensor / fp8_block, 32 for mxfp8's decode kernel); 0 for fp32 accumulation.
        bf16_adds: S > 0 when S split-K partials are added with bf16 atomics.
    Returns:
        float64 [M, N] on the CPU.
    Raises:
        ValueError: an out_dtype the bound does not cover, a negative fp8_interval or bf16_adds.
    """
    from .oracle import dequantize

    if out_dtype not in OUT_P:
        raise ValueError(f"out_dtype must be one of {tuple(OUT_P)}, got {out_dtype}")
    if fp8_interval < 0 or bf16_adds < 0:
        raise ValueError(f"fp8_interval and bf16_adds must be >= 0, got {fp8_interval} and {bf16_adds}")
    a = (dequantize(x.to("cpu"), torch.float64) if isinstance(x, QuantizedTensor)
         else x.reshape(-1, x.shape[-1]).double().cpu()).abs()
    b = dequantize(qweight.to("cpu"), torch.float64).abs()
    acc = qweight.k * U32 + min(fp8_interval, qweight.k) * U_FP8_MMA + bf16_adds * U_BF16
    r = ref.reshape(a.shape[0], -1).double().abs().cpu()
    bias_abs = 0.0 if bias is None else bias.double().abs().cpu()[None, :]
    spacing = 2.0 ** (1 - OUT_P[out_dtype])
    tiny = torch.finfo(out_dtype).smallest_normal * spacing
    return acc * (a @ b.T) + 6 * U32 * (r + bias_abs) + spacing * r + tiny


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts (formats.reference_moe): the bound of each step of the Triton lesson
# (kernels_triton/moe.py), and of the whole call
# ---------------------------------------------------------------------------------------------
SILU_LIPSCHITZ = 1.1
"""max |d silu(g) / dg| (1.0998 at g = 2.40)."""
SWIGLU_LIPSCHITZ = 1.25
"""gpt-oss's g sigmoid(alpha g): slope in [-0.23, 1.23] for any alpha; the clamps are 1-Lipschitz."""
U_FP32_TINY = 2.0 ** -126 * 2.0 ** -23
"""One fp32 subnormal spacing (results that underflow)."""


def moe_activation_bound(gate: torch.Tensor, a: torch.Tensor, *, activation: str = "silu",
                         swiglu_alpha: float = 1.702, a16: bool = False) -> torch.Tensor:
    """|act32(h) - act64(h)|: the error of the activation evaluated in fp32 on the implementation's
    own W13 output h (so that W13's error is left out), element-wise.

    act is exp, one division and at most three products: each product and the division round once
    (2^-24 each); exp's own error is at most 2 ulp on a GPU (ex2.approx), and ``tl.exp(-g)`` computes
    exp2(-g log2 e), where rounding the product g log2 e (2^-24 relative) moves the exponent by
    2^-24 |g|, that is exp's result by the same relative amount, times alpha for gpt-oss's
    sigmoid(alpha g). So (32 + 2 max(1, alpha) |g|) 2^-24 |a| covers every term with room (the kernel
    tests' 32 2^-24 |a| plus the exponent term), plus one fp32 subnormal spacing. Weight-only variants
    round the intermediate to bf16 (W2's operand): 2^-8 |a| more.

    Args: gate float64 [..., I] (the gate half of h), a float64 [..., I] (act(h) in float64);
    activation one of formats.MOE_ACTIVATIONS; a16: the intermediate is rounded to bf16.
    Returns: float64 [..., I]."""
    k = 32.0 + 2.0 * max(1.0, swiglu_alpha if activation != "silu" else 1.0) * gate.abs()
    b = k * U32 * a.abs() + U_FP32_TINY
    if a16:
        b = b + U_BF16 * (a.abs() + b)
    return b


def _expert_opts(opts, e: int) -> dict:
    return {k: (v.reshape(-1)[e] if isinstance(v, torch.Tensor) and v.numel() > 1 else v)
            for k, v in (opts or {}).items()}


def moe_bound(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              activation: str = "silu", renormalize: bool = False, w13_bias=None, w2_bias=None, a16: bool = False,
              w13_act_opts=None, w2_act_opts=None, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
              out_dtype: Optional[torch.dtype] = None, inter: Optional[torch.Tensor] = None,
              bf16_intermediate: bool = False) -> tuple:
    """(the oracle's float64 y [M, H], the element-wise bound on |y_impl - y| [M, H]) for one MoE call, as
    the Triton lesson rounds it, stage by stage for each (token, expert) (tests/kernels_triton/test_moe.py
    asserts the same terms):

    * W13 in fp32: dh = H 2^-24 |x|.|W13|^T + 6 2^-24 (|h| + |b13|) (the dense terms, no output rounding);
      the activation moves that by at most its Lipschitz constants plus its own fp32 evaluation:
          da = L (|up| + du + c) dg + (|act_g| + L dg) du + 32 2^-24 |a|     (c = 1 for SwiGLU's +1)
      (weight-only: + 2^-8 |a|, the bf16 intermediate).
    * The intermediate is quantized by the implementation from its fp32 value, by the oracle from
      float64; where the two round differently the difference is one step of the format's grid. With
      ``inter`` (the implementation's own intermediate, float [M * top_k, I] in slot order) it is taken
      exactly, |dq(inter) - dq(a)|, where all of an expert's inter is within da of the oracle's a (a W13
      step beyond its bound is not allowed to widen the bound); elsewhere, and without ``inter``, it is estimated as the
      larger change of dq when every element moves by da away from zero or toward it.
    * W2 in fp32: I 2^-24 |A|.|W2|^T + 6 2^-24 (|o| + |b2|); the router weight (renormalized in fp32:
      top_k + 1 roundings), its product and the top_k sum in fp32: (2 top_k + 2) 2^-24 sum_j |w_j o_j|.
    * y rounded once to ``out_dtype`` (default x's): 2^-p |y| plus the smallest subnormal spacing.
    * ``bf16_intermediate`` (b12x's fused MoE, the cute backend): W13's output and the activated
      intermediate are each rounded to bf16 before the next step: 2^-8 |h| more in dh and 2^-8 |a|
      more in da.

    Arguments as formats.reference_moe's. Returns float64 tensors on the CPU. Raises what
    formats.reference_moe raises."""
    from .moe import moe_activation, reference_moe
    from .oracle import dequantize, quantize

    out_dtype = out_dtype or x.dtype
    kw = dict(activation=activation, renormalize=renormalize, w13_bias=w13_bias, w2_bias=w2_bias, a16=a16,
              w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    x, ids, wt = x.cpu(), topk_ids.cpu(), topk_weights.cpu()
    w13 = [q.to("cpu") for q in w13]
    w2 = [q.to("cpu") for q in w2]
    ref = reference_moe(x, w13, w2, ids, wt, out_dtype=torch.float64, **kw)
    E, (H, I) = len(w13), w2[0].shape
    M, top_k = ids.shape
    w = wt.double()
    w = w / w.sum(dim=-1, keepdim=True) if renormalize else w
    bound = torch.zeros(M, H, dtype=torch.float64)
    lip = SWIGLU_LIPSCHITZ if activation != "silu" else SILU_LIPSCHITZ
    for e in range(E):
        tokens, js = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        X = xe.double() if a16 else dequantize(quantize(xe, w13[e].fmt, role="activation",
                                                        **_expert_opts(w13_act_opts, e)), torch.float64)
        W13, W2 = dequantize(w13[e], torch.float64), dequantize(w2[e], torch.float64)
        b13 = torch.zeros(2 * I, dtype=torch.float64) if w13_bias is None else w13_bias[e].double().cpu()
        b2 = torch.zeros(H, dtype=torch.float64) if w2_bias is None else w2_bias[e].double().cpu()
        h = X @ W13.T + b13
        dh = H * U32 * (X.abs() @ W13.abs().T) + 6 * U32 * (h.abs() + b13.abs())
        if bf16_intermediate:
            dh = dh + U_BF16 * (h.abs() + dh)
        sel = (slice(0, None, 2), slice(1, None, 2)) if activation == "swigluoai" else (slice(0, I), slice(I, None))
        g, up, dg, du = h[:, sel[0]], h[:, sel[1]], dh[:, sel[0]], dh[:, sel[1]]
        a = moe_activation(h, activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        act_g = torch.nn.functional.silu(g) if activation == "silu" else \
            g.clamp(max=swiglu_limit) * torch.sigmoid(swiglu_alpha * g.clamp(max=swiglu_limit))
        c = 0.0 if activation == "silu" else 1.0
        da = lip * (up.abs() + du + c) * dg + (act_g.abs() + lip * dg) * du + 32 * U32 * a.abs() + U_FP32_TINY
        if bf16_intermediate:
            da = da + U_BF16 * (a.abs() + da)
        if a16:
            da = da + U_BF16 * (a.abs() + da)
            A, dA = a, da
        else:
            def dq(v):
                return dequantize(quantize(v.float(), w2[e].fmt, role="activation", **_expert_opts(w2_act_opts, e)),
                                  torch.float64)
            A = dq(a)
            s = torch.sign(a)
            dA = torch.maximum((dq(a + s * da) - A).abs(), (dq(a - s * da) - A).abs())
            if inter is not None:
                ak = inter.detach().cpu().double()[tokens * top_k + js]
                if bool(((ak - a).abs() <= da).all()):  # a per-tensor scale is the expert's: all rows or none
                    dA = torch.maximum(dA, (dq(ak) - A).abs())
        o = A @ W2.T + b2
        do = dA @ W2.abs().T + I * U32 * ((A.abs() + dA) @ W2.abs().T) + 6 * U32 * (o.abs() + b2.abs())
        we = w[tokens, js].abs().unsqueeze(1)
        bound.index_add_(0, tokens, we * (do + (2 * top_k + 2) * U32 * (o.abs() + do)))
    p = OUT_P[out_dtype]
    tiny = torch.finfo(out_dtype).smallest_normal * 2.0 ** (1 - p)
    return ref, bound + 2.0 ** -p * (ref.abs() + bound) + tiny


def describe_moe(out_dtype: torch.dtype) -> str:
    """The MoE bound of :func:`moe_bound` as one line of text (with its source)."""
    p = OUT_P[out_dtype]
    return (f"|y - ref| <= sum_j |w_j| (dA.|W2|^T + I 2^-24 |A|.|W2|^T + 6 2^-24 |o_j| + (2 top_k + 2) 2^-24 |o_j|)"
            f" + 2^-{p} |ref| + tiny, dA: the intermediate's W13 error (H 2^-24 |x|.|W13|^T through the "
            f"activation's Lipschitz constant, + 32 2^-24 |a|) carried through its quantization "
            f"({str(out_dtype).replace('torch.', '')} output; formats/bounds.py moe_bound: fp32 sums and "
            "epilogues, one output rounding)")
