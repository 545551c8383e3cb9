"""Ahead-of-time warmup: every (layer signature x token count) the server will see, once.

vLLM's kernel warmup (``vllm/model_executor/warmup/b12x_warmup.py``, run on SM12x) collects a
``B12xWarmupUnit`` from every layer whose ``b12x_warmup_provider`` has ``get_b12x_warmup_unit``,
dedupes them by ``key`` and calls ``compile()``; the token counts are 1, every CUDA-graph capture
size, the compile sizes and max_num_batched_tokens. Our kernels answer with :func:`unit`: the key
is the layer's signature (backends, variant, N, K, dtype, activation options), so identical
layers share one compile. :func:`warmup_model` does the same walk for any device (vLLM skips its
own outside SM12x), and records what ran so nothing is compiled twice.

Those token counts alone would leave prompts of other lengths to compile while serving: a tile,
a route or a b12x plan depends on M, and Triton compiles a kernel once per integer
specialization of M (M == 1, M % 16 == 0, other). So each layer is also run at
:func:`buckets`: one M for every distinct :func:`route_key` over 1..max(counts). After warmup,
a call of any M up to the largest count (max_num_batched_tokens) finds every kernel compiled.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, NamedTuple, Optional

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


class RouteKey(NamedTuple):
    """What a triton / hopper call compiles, as far as M decides it (:func:`route_key`): one M per
    distinct value is one warmup run."""

    kernels: tuple[str, ...]  # the @triton.jit names the route launches, in order
    tile: str  # the GEMM's TileConfig as text ("" without a GEMM)
    split_k: int  # K splits (1: none)
    options: tuple  # the route's launch options and the classes of the M-derived ints it passes
    quant_tile: Optional[tuple[int, int]]  # the activation quantizer's (BLOCK_M, BLOCK_K); None: W4A16
    m_class: str  # Triton's specialization of M: "1", "16" (divisible by 16) or "" (other)


def _specialization(m: int) -> str:
    """How Triton specializes an int argument (triton.runtime.jit: == 1, divisible by 16, other)."""
    return "1" if m == 1 else ("16" if m % 16 == 0 else "")


def route_key(impl: str, variant: str, m: int, n: int, k: int, device=None,
              dtype: torch.dtype = torch.bfloat16) -> tuple:
    """What an ``impl`` call of ``variant`` at M tokens (N, K, x ``dtype``) compiles on ``device`` (a
    DeviceInfo; None: this process's device), as far as M decides it; a pure function of its
    arguments (a described GPU gets that GPU's key on any machine: the CPU alone runs Triton's
    interpreter).

    triton / hopper: a :class:`RouteKey` (kernels, tile, split-K, options, quantizer tile, M's class):
    the backend's route on ``device`` (the kernels it launches, their tile and split-K); ``options``:
    the route's own (a hopper route's GEMM plan and the classes of the M-derived ints it passes) and,
    for the triton lessons, ``kernels_triton.tuning.specializations`` (the quantizer's tile, the
    class of the amax partial count, nvfp4's BLOCK_P); the activation quantizer's tile
    (``kernels_triton.tuning.quant_tile`` for the lessons, ``quant_config`` for the hopper
    quantizers; None for a weight-only variant); M's class (== 1, divisible by 16, other:
    triton.runtime.jit). cute: the b12x plan capacity ``cap_for(next_pow2(M), K)`` that
    kernels_cute plans for an unprepared M. reference: () (torch only).

    Raises ValueError for another impl.
    """
    return _key_function(impl, variant, n, k, device, dtype)(m)


def _key_function(impl: str, variant: str, n: int, k: int, device, dtype) -> Callable[[int], tuple]:
    """route_key with everything but M bound once (buckets calls it for every M)."""
    if impl == "reference":
        return lambda m: ()
    if impl in ("triton", "hopper"):
        from kernels_triton.tuning import quant_config, quant_tile, specializations

        from .. import contract, registry
        from ..devices import current_device

        dev = current_device() if device is None else device
        interp = dev.kind == "cpu"  # where the kernels run: the interpreter on the CPU, compiled on a GPU
        backend = registry.get(impl, variant)
        v = contract.variant(variant)  # its format and whether it is weight-only (_w4a16, _w8a16)

        def key(m: int) -> tuple:
            r = backend.route(registry.Problem(variant, m, n, k, dtype), dev)
            options = tuple(getattr(r, "options", ()))
            if impl == "triton":
                options += specializations(v.fmt, m, k, a16=v.a16, interpreted=interp)
                quant = None if v.a16 else quant_tile(v.fmt, m, k, interp)
            else:
                quant = None if v.a16 else quant_config(m, k, interp, 32)
            return RouteKey(tuple(r.kernels), r.tile, r.split_k, options, quant, _specialization(m))

        return key
    if impl == "cute":
        import kernels_cute
        from kernels_cute._common import next_pow2

        mod = kernels_cute.module(variant)
        return lambda m: (mod.cap_for(next_pow2(m), k),)
    raise ValueError(f"impl must be one of reference, triton, hopper, cute, got {impl!r}")


def buckets(impl: str, variant: str, n: int, k: int, max_tokens: int, device=None,
            dtype: torch.dtype = torch.bfloat16) -> tuple[int, ...]:
    """The smallest M of every distinct :func:`route_key` for M in 1..max_tokens (sorted): running a
    layer once at each compiles everything a call of up to ``max_tokens`` tokens can use."""
    key = _key_function(impl, variant, n, k, device, dtype)
    first: dict[tuple, int] = {}
    for m in range(1, int(max_tokens) + 1):
        first.setdefault(key(m), m)
    return tuple(sorted(first.values()))


def layer_counts(st: ops.LayerState, counts: Iterable[int], device: torch.device) -> tuple[int, ...]:
    """``counts`` plus, on a CUDA device, the layer's :func:`buckets` up to the largest of them.
    (On the CPU nothing compiles: Triton runs in its interpreter and the reference is torch.)"""
    counts = set(counts)
    if counts and torch.device(device).type == "cuda":
        for impl in sorted({backend.impl for backend, _ in st.backends.values()}):
            counts.update(buckets(impl, st.variant, st.n, st.k, max(counts), st.device, st.dtype))
    return tuple(sorted(counts))


def _run(st: ops.LayerState, counts: Iterable[int], device: torch.device,
         bias: Optional[torch.Tensor] = None) -> int:
    global compiles
    ran = 0
    counts = layer_counts(st, counts, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    for m in counts:
        key = (st.signature, bias is not None, m)
        if key not in _done:
            x = torch.randn(m, st.k, generator=g).to(device=device, dtype=st.dtype)
            st.run(x, bias, watch=False)  # the op's path; random inputs are not the watchdog's to check
            _done.add(key)
            compiles += 1
            ran += 1
        st.warmed.add(m)
    return ran


def _device(st: ops.LayerState) -> torch.device:
    """Where the prepared weights live (QuantizedTensor and CuteWeight both have ``.device``)."""
    _, prepared = next(iter(st.backends.values()))
    return torch.device(getattr(prepared, "device", "cpu"))


def served_bias(layer: torch.nn.Module) -> Optional[torch.Tensor]:
    """The bias vLLM hands our op for ``layer`` (None when it has none or adds it itself:
    ``skip_bias_add``); with a bias the kernels compile another specialization (HAS_BIAS)."""
    bias = getattr(layer, "bias", None)
    if not isinstance(bias, torch.Tensor) or getattr(layer, "skip_bias_add", False):
        return None
    return bias


def _parts(layer: torch.nn.Module, counts) -> tuple[str, tuple, Callable[[], None]]:
    """(name, key, compile) of one layer's warmup unit; the key is the layer's signature, whether
    it has a bias, the device and the counts."""
    st = ops.state(layer.b12x_dual_handle)
    counts = tuple(counts)
    dev = _device(st)
    bias = served_bias(layer)

    def compile() -> None:
        _run(st, counts, dev, bias)
        # Layers that share the signature are warm too (the unit ran once for all of them).
        for other in ops._STATES.values():
            if other.signature == st.signature:
                other.warmed.update(layer_counts(st, counts, dev))

    return f"b12x-dual {st.variant}", ("b12x_dual", st.signature, bias is not None, str(dev), counts), compile


def _moe_parts(layer: torch.nn.Module, counts) -> tuple[str, tuple, Callable[[], None]]:
    """(name, key, compile) for an MoE layer our method serves (``layer.b12x_dual_moe``): the key
    is the BoundMoE's signature; compile runs it once at each token count (x of the layer's dtype,
    every expert routed to, weights 1/top_k)."""
    method = layer.b12x_dual_moe
    b, top_k = method.bound, method.top_k
    dtype = getattr(layer, "params_dtype", None) or torch.bfloat16
    key = ("moe", tuple(sorted(b.backends)), b.variant, b.num_experts, b.hidden, b.intermediate, top_k,
           b.activation, dtype)

    def compile() -> None:
        global compiles
        dev = b.w13[0].data.device
        for m in counts:
            if (key, m) in _done:
                continue
            x = torch.full((m, b.hidden), 0.01, dtype=dtype, device=dev)
            ids = (torch.arange(m * top_k, device=dev) % b.num_experts).view(m, top_k).to(torch.int32)
            w = torch.full((m, top_k), 1.0 / top_k, device=dev)
            b(x, ids, w, watch=False)  # warmup's inputs are not the model's: no watchdog
            _done.add((key, m))
            compiles += 1

    return f"b12x-dual MoE {b.variant}", key, compile


def unit(layer: torch.nn.Module, counts):
    """vLLM's B12xWarmupUnit for one layer (key = the layer's signature and bias presence)."""
    from vllm.utils.b12x import B12xWarmupUnit

    parts = _moe_parts if getattr(layer, "b12x_dual_moe", None) is not None else _parts
    name, key, compile = parts(layer, counts)
    return B12xWarmupUnit(name=name, key=key, compile=compile)


def warmup_model(model: torch.nn.Module, counts: Iterable[int]) -> dict[str, int]:
    """Run every b12x-dual layer signature in ``model`` at each token count once (on a CUDA
    device also at every :func:`buckets` M up to the largest count); needs no vLLM.

    Returns {"b12x-dual <variant>": signatures warmed}. Safe to call again: what already ran is skipped.
    """
    counts = tuple(counts)
    units: dict[tuple, tuple] = {}
    for layer in model.modules():
        if getattr(layer, "b12x_dual_handle", None) is not None:
            name, key, compile = _parts(layer, counts)
            units.setdefault(key, (name, compile))
        elif getattr(layer, "b12x_dual_moe", None) is not None:
            name, key, compile = _moe_parts(layer, counts)
            units.setdefault(key, (name, compile))
    warmed: dict[str, int] = {}
    with torch.inference_mode():
        for name, compile in units.values():
            compile()
            warmed[name] = warmed.get(name, 0) + 1
    log.info("b12x-dual warmup: %s at token counts %s", warmed, counts)
    return warmed
