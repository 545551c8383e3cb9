"""The torch.library custom op every plugin kernel calls, and the per-layer state behind it.

``torch.ops.b12x_dual.linear(x, bias, handle, n)`` is opaque to torch.compile (Dynamo records one
node; the fake implementation gives the output's shape and dtype), so a layer's forward traces
with ``fullgraph=True``. ``handle`` (a Python int, constant in the graph) names a
:class:`LayerState` in a process-wide table: the backend chosen at load time, the prepared
weight and the activation options. Nothing on this path chooses, allocates beyond the output and
the backend's scratch, or synchronizes with the host.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import check as _check
from ..api import tokens

log = logging.getLogger("dispatch.vllm_plugin")

OP = "b12x_dual::linear"


@dataclass
class LayerState:
    """What one vLLM layer runs: set by ``process_weights_after_loading``, read by the op.

    variant: the registry variant ("nvfp4", "mxfp4_w4a16", ...); n, k: the shard's GEMM shape;
    chosen: the registry.Choice made at load (backend, impl, reason, source); prepared: what
    ``backend.prepare`` returned; act_opts: activation options (static input scale or global
    scale as 0-d float32 tensors); layer: the layer's name (for messages); warmed: token counts
    already run once (warmup, and the CUDA-graph capture check).
    """

    variant: str
    n: int
    k: int
    dtype: torch.dtype
    chosen: object
    prepared: object
    act_opts: dict
    layer: str
    warmed: set = field(default_factory=set)
    qweight: object = None
    """The layer's weight as a QuantizedTensor, kept for the watchdog (B12X_CHECK on at load)."""

    @property
    def signature(self) -> tuple:
        """Identical signatures share compiled kernels (warmup dedupes on it)."""
        return (self.chosen.impl, self.variant, self.n, self.k, self.dtype,
                tuple(sorted((k, v is None) for k, v in self.act_opts.items())))


_STATES: dict[int, LayerState] = {}
_next = itertools.count(1)


def new_handle(state: LayerState) -> int:
    h = next(_next)
    _STATES[h] = state
    return h


def state(handle: int) -> LayerState:
    return _STATES[handle]


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# [op]
@torch.library.custom_op(OP, mutates_args=())
def linear(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int, n: int) -> torch.Tensor:
    """y [..., n] = x [..., K] . W^T (+ bias) for the layer ``handle`` (x bf16/fp16; y x's dtype)."""
    st = _STATES[handle]
    m = tokens(x)
    if _capturing(x) and m not in st.warmed:
        # A first call may compile (CuTe DSL, Triton); that must not happen inside a CUDA graph.
        raise RuntimeError(
            f"b12x-dual: layer {st.layer} ({st.variant}, N={st.n}, K={st.k}) was not warmed up for "
            f"{m} tokens before CUDA-graph capture; run dispatch.vllm_plugin.warmup.warmup_model "
            "(vLLM's kernel warmup calls it on SM12x) with the capture sizes")
    y = st.chosen.backend.apply(x, st.prepared, bias, **st.act_opts)
    if _check.WATCHDOG is not None and st.qweight is not None:  # B12X_CHECK on (dispatch.check)
        _check.WATCHDOG.after_call(st.layer, st.chosen.backend, x, y, st.qweight, bias, st.act_opts)
    return y


@linear.register_fake
def _linear_fake(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))
# [/op]
