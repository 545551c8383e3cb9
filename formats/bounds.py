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
