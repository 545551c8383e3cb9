"""The torch.library custom op every plugin kernel calls, and the per-layer state behind it.

``torch.ops.b12x_dual.linear(x, bias, handle, n)`` is opaque to torch.compile (Dynamo records one
node; the fake implementation gives the output's shape and dtype), so a layer's forward traces
with ``fullgraph=True``. ``handle`` (a Python int, constant in the graph) names a
:class:`LayerState` in a process-wide table: the layer's variant, shape and device, the weight
prepared for every backend its M buckets choose, and the activation options. Each call asks
``registry.choose`` for its M bucket (a dict lookup after the bucket's first call) and applies
that backend; nothing on this path allocates beyond the output and the backend's scratch, or
synchronizes with the host.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import check as _check
from .. import registry
from ..api import tokens
from ..devices import DeviceInfo

log = logging.getLogger("dispatch.vllm_plugin")

OP = "b12x_dual::linear"


# The M buckets a layer is prepared for at load: every bucket registry.m_bucket distinguishes up to
# 2^20 tokens (exact up to 16, then powers of two), so any call finds its backend's weight.
LOAD_M = tuple(range(1, 17)) + tuple(1 << i for i in range(5, 21))


@dataclass
class LayerState:
    """What one vLLM layer runs: set by ``process_weights_after_loading``, read by the op.

    variant: the registry variant ("nvfp4", "mxfp4_w4a16", ...); n, k: the shard's GEMM shape;
    dtype: the activation dtype; device: the DeviceInfo the weight lives on; backends: {backend
    name: (Backend, what its ``prepare`` returned)} for every backend ``registry.choose`` picks for
    an M bucket of :data:`LOAD_M`; act_opts: activation options (static input scale or global
    scale as 0-d float32 tensors); layer: the layer's name (for messages); warmed: token counts
    already run once (warmup, and the CUDA-graph capture check).
    """

    variant: str
    n: int
    k: int
    dtype: torch.dtype
    device: DeviceInfo
    backends: dict
    act_opts: dict
    layer: str
    warmed: set = field(default_factory=set)
    qweight: object = None
    """The layer's weight as a QuantizedTensor, kept for the watchdog (B12X_CHECK on at load)."""

    def choose(self, m: int):
        """The registry's Choice for an m-token call of this layer (B12X_IMPL / use_impl() honoured)."""
        return registry.choose(self.variant, m, self.n, self.k, self.device, dtype=self.dtype)

    def backend_for(self, m: int) -> tuple[object, object]:
        """(Backend, prepared weight) for an m-token call. RuntimeError when the registry now picks
        a backend the layer was not prepared for (the request changed after load)."""
        c = self.choose(m)
        try:
            return self.backends[c.backend.name]
        except KeyError:
            raise RuntimeError(
                f"b12x-dual: layer {self.layer} ({self.variant}, N={self.n}, K={self.k}) was prepared for "
                f"{sorted(self.backends)}, but a {m}-token call now chooses {c.backend.name} ({c.source}="
                f"{c.requested}); B12X_IMPL / use_impl() must not change after the model is loaded") from None

    @property
    def chosen(self):
        """The Choice of a decode call (M = 1): what reports and logs show for the layer."""
        return self.choose(1)

    @property
    def prepared(self):
        """The prepared weight of the decode (M = 1) backend."""
        return self.backend_for(1)[1]

    @property
    def signature(self) -> tuple:
        """Identical signatures share compiled kernels (warmup dedupes on it)."""
        return (tuple(sorted(self.backends)), self.variant, self.n, self.k, self.dtype,
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
    backend, prepared = st.backend_for(m)
    y = backend.apply(x, prepared, bias, **st.act_opts)
    if _check.WATCHDOG is not None and st.qweight is not None:  # B12X_CHECK on (dispatch.check)
        _check.WATCHDOG.after_call(st.layer, backend, x, y, st.qweight, bias, st.act_opts)
    return y


@linear.register_fake
def _linear_fake(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))
# [/op]
