"""kernels_triton: the readable Triton implementation of all six formats.

Each format module (fp8_tensor, fp8_channel, fp8_block, mxfp8, nvfp4, mxfp4) has an
activation-quantization kernel, a GEMM kernel and host wrappers with the same names:

    quantize_activation(x, **opts) -> formats.QuantizedTensor   (bit-exact with the oracle)
    gemm(xq, qweight, bias=None, out_dtype=torch.bfloat16) -> Tensor [M, N]
    linear(x, qweight, bias=None, **opts) -> Tensor [..., N]    (quantize + gemm)
    linear_unchecked(x, qweight, bias=None, **opts)             (linear without its argument checks)

Two GEMM paths per format (``path=None | "native" | "portable"`` on gemm and linear): native is
tl.dot_scaled, the block-scaled tensor-core MMA on SM120/SM121; portable decodes operand tiles in
registers and runs a plain tl.dot (Hopper, Ada, the interpreter). ``gemm_path(fmt, capability,
a16=...) -> (path, reason)`` is the policy, a pure function the dispatcher can report.

Mixture-of-experts: ``kernels_triton.moe`` (also ``kernels_triton.fused_moe``) is the MoE lesson,
one MoE layer's routed experts in every format over the lessons' public tile helpers:
``prepare_experts(w13, w2) -> MoEWeights``, ``fused_moe(x, prepared, topk_ids, topk_weights, ...)``,
``fused_moe_unchecked``, ``fused_moe_stages`` (the same call with each step's result kept, for a
debugger), ``route(M, E, top_k, H, I, *, fmt, ...)``, ``align_block_size``.

Routes as data: ``route(M, N, K, *, capability, ...)`` of a format module returns the ``Route``
(kernels by name, tile, split-K, why) that its ``linear`` launches; ``record_launches()`` lists
what a block of code actually launched. The lessons share two modules: ``_codecs`` (the
``@triton.jit`` element codecs) and ``_common`` (tiles, routes, path policy, epilogue, host
checks). Tuned tiles (the SM12x tables) are ``kernels_triton.tuning``, passed into a lesson as
``tile=`` / ``quant_tile=``; the Hopper production kernels are the subpackage ``kernels_triton.hopper``.

With no CUDA device and TRITON_INTERPRET unset, importing this package sets TRITON_INTERPRET=1, so
the kernels run on CPU tensors in Triton's interpreter. Triton reads the variable when it is first
imported, so this package must be imported before anything else imports triton (transformers
does); otherwise it warns, and the variable has to be set in the environment instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton" in sys.modules:
        # Triton reads the variable when it is first imported (e.g. by transformers), so setting
        # it now is too late: the kernels would fail inside Triton instead of being interpreted.
        warnings.warn(
            "kernels_triton: no CUDA device and TRITON_INTERPRET is unset, but triton was already "
            "imported; the Triton kernels will not run. Import kernels_triton (or dispatch) before "
            "anything that imports triton, or set TRITON_INTERPRET=1 in the environment.",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"


from formats import FORMAT_NAMES  # noqa: E402

# after TRITON_INTERPRET is settled: _common imports triton
from ._common import PATHS, Route, gemm_path, interpreting, record_launches  # noqa: E402,F401


def module(fmt: str):
    """The kernels_triton.<fmt> module; ValueError naming the formats for an unknown one."""
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    return importlib.import_module(f"{__name__}.{fmt}")


def quantize_activation(x: torch.Tensor, fmt: str, **opts):
    """Quantize activations x [..., K] (bf16/fp16) with the Triton kernel of ``fmt``; see the module."""
    return module(fmt).quantize_activation(x, **opts)


def gemm(xq, qweight, bias=None, out_dtype=torch.bfloat16, **opts):
    """GEMM alone on quantized operands (xq activation [M, K], qweight [N, K]; ``path=``, and
    fp8_block's ``ue8m0=``); see the module."""
    return module(qweight.fmt).gemm(xq, qweight, bias, out_dtype=out_dtype, **opts)


def linear(x: torch.Tensor, qweight, bias=None, **opts):
    """y = x . W^T (+ bias) with the Triton kernels of qweight's format; see the module."""
    return module(qweight.fmt).linear(x, qweight, bias, **opts)


def fused_moe(x: torch.Tensor, prepared, topk_ids: torch.Tensor, topk_weights: torch.Tensor, **opts):
    """One MoE layer's routed experts with the Triton MoE lesson (prepared: moe.prepare_experts(w13,
    w2)); the options and errors of kernels_triton.moe.fused_moe."""
    from . import moe

    return moe.fused_moe(x, prepared, topk_ids, topk_weights, **opts)


def __getattr__(name: str):
    # The MoE lesson imports every format lesson, so it loads on first use (``kernels_triton.moe``),
    # never with the package: the vLLM plugin's register() must stay cheap.
    if name == "moe":
        return importlib.import_module(f"{__name__}.moe")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
