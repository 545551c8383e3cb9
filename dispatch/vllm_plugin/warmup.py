"""Ahead-of-time warmup: every (layer signature x token count) the server will see, once.

vLLM's kernel warmup (``vllm/model_executor/warmup/b12x_warmup.py``, run on SM12x) collects a
``B12xWarmupUnit`` from every layer whose ``b12x_warmup_provider`` has ``get_b12x_warmup_unit``,
dedupes them by ``key`` and calls ``compile()``; the token counts are 1, every CUDA-graph capture
size, the compile sizes and max_num_batched_tokens. Our kernels answer with :func:`unit`: the key
is the layer's signature (backends, variant, N, K, dtype, activation options), so identical
layers share one compile. :func:`warmup_model` does the same walk for any device (vLLM skips its
own outside SM12x), and records what ran so nothing is compiled twice.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from . import ops

log = logging.getLogger("dispatch.vllm_plugin")

# (signature, token count) pairs already run in this process.
_done: set[tuple] = set()
compiles = 0  # how many (signature, token count) runs warmup did (tests read it)


def token_counts(cuda_graph_sizes: Iterable[int] = (), max_num_batched_tokens: int | None = None) -> tuple[int, ...]:
    """1, the CUDA-graph capture sizes and max_num_batched_tokens, sorted and deduplicated."""
    counts = {1, *cuda_graph_sizes}
    if max_num_batched_tokens:
        counts.add(int(max_num_batched_tokens))
    return tuple(sorted(c for c in counts if c > 0))


def _run(st: ops.LayerState, counts: Iterable[int], device: torch.device) -> int:
    global compiles
    ran = 0
    g = torch.Generator(device="cpu").manual_seed(0)
    for m in counts:
        key = (st.signature, m)
        if key not in _done:
            x = torch.randn(m, st.k, generator=g).to(device=device, dtype=st.dtype)
            backend, prepared = st.backend_for(m)
            backend.apply(x, prepared, None, **st.act_opts)
            _done.add(key)
            compiles += 1
            ran += 1
        st.warmed.add(m)
    return ran


def _device(st: ops.LayerState) -> torch.device:
    """Where the prepared weights live (QuantizedTensor and CuteWeight both have ``.device``)."""
    _, prepared = next(iter(st.backends.values()))
    return torch.device(getattr(prepared, "device", "cpu"))


def unit(layer: torch.nn.Module, counts):
    """vLLM's B12xWarmupUnit for one layer (key = the layer's signature)."""
    from vllm.utils.b12x import B12xWarmupUnit

    st = ops.state(layer.b12x_dual_handle)
    counts = tuple(counts)
    dev = _device(st)

    def compile() -> None:
        _run(st, counts, dev)
        # Layers that share the signature are warm too (the unit ran once for all of them).
        for other in ops._STATES.values():
            if other.signature == st.signature:
                other.warmed.update(counts)

    return B12xWarmupUnit(name=f"b12x-dual {st.variant}", key=("b12x_dual", st.signature, str(dev), counts),
                          compile=compile)


def warmup_model(model: torch.nn.Module, counts: Iterable[int]) -> dict[str, int]:
    """Run every b12x-dual layer signature in ``model`` at each token count once.

    Returns {"b12x-dual <variant>": signatures warmed}. Safe to call again: what already ran is skipped.
    """
    counts = tuple(counts)
    units = {}
    for layer in model.modules():
        if getattr(layer, "b12x_dual_handle", None) is not None:
            u = unit(layer, counts)
            units.setdefault(u.key, u)
    warmed: dict[str, int] = {}
    with torch.inference_mode():
        for u in units.values():
            u.compile()
            warmed[u.name] = warmed.get(u.name, 0) + 1
    log.info("b12x-dual warmup: %s at token counts %s", warmed, counts)
    return warmed
