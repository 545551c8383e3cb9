"""The torch.library custom op every plugin kernel calls, and the per-layer state behind it.

``torch.ops.b12x_dual.linear(x, bias, handle, n)`` is opaque to torch.compile (Dynamo records one
node; the fake implementation gives the output's shape and dtype), so a layer's forward traces
with ``fullgraph=True``. ``handle`` (a Python int, constant in the graph) names a
:class:`LayerState` in a process-wide table: the layer's ``dispatch.bound.BoundLinear``, bound at
load to the layer's variant, shape, device and activation options, with the weight prepared for
the backend of every M bucket, then sealed. Each call takes the bound object's trusted path
(``run``: x and bias were checked at load, by vLLM's dtype and the layer's own bias): the registry's
decision for its M bucket (a dict lookup after the bucket's first call) and that backend's run;
nothing on this path allocates beyond the output and the backend's scratch, or synchronizes with
the host.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch

from ..bound import BoundLinear
from ..contract import M_BUCKETS, tokens
from ..devices import DeviceInfo

log = logging.getLogger("dispatch.vllm_plugin")

OP = "b12x_dual::linear"

LOAD_M = M_BUCKETS
"""The M buckets a layer is prepared for at load (dispatch.contract.M_BUCKETS, the old name)."""


class LayerState(BoundLinear):
    """What one vLLM layer runs: its BoundLinear, bound by ``process_weights_after_loading``
    (``prepare_buckets``, then ``seal``), and ``warmed``, the token counts already run once
    (warmup, and the CUDA-graph capture check).

    Args: ``qweight`` (the layer's QuantizedTensor), ``variant`` (the registry variant, "nvfp4",
    "mxfp4_w4a16", ...), ``name`` (the layer's, for messages), ``device`` (the DeviceInfo the
    weight lives on), ``dtype`` (the activation dtype), ``act_opts`` (static input scale or global
    scale as 0-d float32 tensors). Attributes of the BoundLinear: ``n``, ``k`` (the shard's GEMM
    shape), ``backends`` {backend name: (Backend, prepared weight)}, ``qweight`` (kept for the
    watchdog when B12X_CHECK is on at load, else None).
    """

    def __init__(self, qweight, variant: str, *, name: str, device: DeviceInfo, dtype: torch.dtype,
                 act_opts: Optional[dict] = None):
        super().__init__(qweight, variant, act_opts=act_opts, name=name, device=device, dtype=dtype)
        self.warmed: set[int] = set()

    @property
    def layer(self) -> str:
        return self.name

    def choose(self, m: int):
        """The registry's Choice for an m-token call of this layer (B12X_IMPL / use_impl() honoured)."""
        return self.choice(m)

    def backend_for(self, m: int) -> tuple[object, object]:
        """(Backend, prepared weight) for an m-token call. RuntimeError when the registry now picks
        a backend the layer was not prepared for (the request changed after load)."""
        return self._entry(self.choice(m), m)

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
    if _capturing(x) and tokens(x) not in st.warmed:
        # A first call may compile (CuTe DSL, Triton); that must not happen inside a CUDA graph.
        raise RuntimeError(
            f"b12x-dual: layer {st.layer} ({st.variant}, N={st.n}, K={st.k}) was not warmed up for "
            f"{tokens(x)} tokens before CUDA-graph capture; run dispatch.vllm_plugin.warmup.warmup_model "
            "(vLLM's kernel warmup calls it on SM12x) with the capture sizes")
    return st.run(x, bias)


@linear.register_fake
def _linear_fake(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))
# [/op]
