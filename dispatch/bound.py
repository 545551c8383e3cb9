"""One bound call: a layer's weight bound to the registry.

    bound = BoundLinear(qweight, "nvfp4")     # a weight [N, K] of the variant
    y = bound(x, bias)                        # the public door: x and bias validated once, then run
    y = bound.run(x, bias)                    # the trusted path: the caller validated them (the vLLM op)

A call reads the request (``impl=`` > ``use_impl()`` > ``B12X_IMPL`` > auto) once, asks the registry
for the backend of its M bucket (``registry.decide``: a dict lookup after the bucket's first call),
takes that backend's prepared weight from this object's cache (prepared on first use; a sealed
layer has every bucket's prepared at load and refuses a backend it lacks), runs the backend
(``Backend.run``, which checks nothing of x again) and hands the call to the watchdog when
B12X_CHECK is on. ``dispatch.linear``, ``QuantLinear.forward`` and the vLLM op
(``dispatch.vllm_plugin.ops``) are each a few lines over it.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from formats import QuantizedTensor
from formats.validate import check_bias, check_linear_input

from . import check as _check
from . import policy, registry
from .contract import M_BUCKETS, tokens, variant
from .devices import DeviceInfo, device_of

_THE_WEIGHT = object()
"""Stands, in a weakly bound object's cache, for a prepared weight that is the bound weight itself."""


def validate_input(x, variant_: str, K: int, request: policy.Request, *,
                   act_dtype: Optional[torch.dtype] = None) -> None:
    """The argument checks of a linear call's activation, made at the public door before any
    implementation is chosen, so that a bad argument is reported as one (not as an implementation
    that cannot serve the call).

    x: [..., K] float tensor; its dtype (or ``act_dtype``, the dtype the call casts it to) must be
    one of ``registry.act_dtypes_of(variant_, request.impl)``: the requested implementation's,
    under auto their union. Raises ValueError naming ``x`` (or ``act_dtype``), the value found and
    what is allowed (formats.validate.check_linear_input): a QuantizedTensor, not a tensor, another
    dtype, a 0-d tensor, another K, the meta device."""
    allowed = registry.act_dtypes_of(variant_, request.impl)
    if act_dtype is None:
        check_linear_input(x, K, allowed)
        return
    check_linear_input(x, K, (x.dtype,) if isinstance(x, torch.Tensor) and x.is_floating_point() else allowed)
    if act_dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"act_dtype must be one of ({names}) here, got {str(act_dtype).removeprefix('torch.')}")


class BoundLinear:
    """y = x . W^T (+ bias) for one weight, through the backend the registry picks per M bucket.

    Args:
        qweight: the weight, a formats.QuantizedTensor [N, K] (role "weight") of ``variant_``'s format.
        variant_: a name of dispatch.registry.VARIANTS (default: the weight's format).
        impl: pin the implementation ("auto", "cute", ...); None reads use_impl() / B12X_IMPL per call.
        act_dtype: cast x to this dtype for the call (the output comes in it); None: x as is.
        act_opts: activation options every call passes (static scales as device tensors), checked
            once per backend, when it is prepared.
        name: the layer's name; the watchdog (B12X_CHECK) checks named objects only.
        device, dtype: fixed at bind (the vLLM op: the DeviceInfo of the weight and the layer's
            activation dtype); None: x's, per call.
        weak: hold the weight weakly (a bare weight of dispatch.linear, owned by its caller).

    Attributes: ``backends`` {backend name: (Backend, what its prepare returned)}, the one cache of
    prepared weights; ``sealed`` (no backend is prepared after load); ``last_impl``.
    Raises ValueError for a variant of another format than the weight's.
    """

    def __init__(self, qweight: QuantizedTensor, variant_: Optional[str] = None, *, impl: Optional[str] = None,
                 act_dtype: Optional[torch.dtype] = None, act_opts: Optional[dict] = None,
                 name: Optional[str] = None, device: Optional[DeviceInfo] = None,
                 dtype: Optional[torch.dtype] = None, weak: bool = False):
        spec = variant(variant_ or qweight.fmt)
        if spec.fmt != qweight.fmt:
            raise ValueError(f"variant {spec.name!r} needs a {spec.fmt} weight, got a {qweight.fmt} one")
        self.variant, self.fmt, self.a16 = spec.name, spec.fmt, spec.a16
        self.n, self.k = qweight.shape
        self.impl = None if impl is None else policy.parse_impl(impl, "impl")
        self.act_dtype = act_dtype
        self.act_opts = dict(act_opts or {})
        self.name = name
        self.device, self.dtype = device, dtype
        self.backends: dict[str, tuple[object, object]] = {}
        self.sealed = False
        self.last_impl: Optional[str] = None
        self._weight = None if weak else qweight
        self._weight_ref = weakref.ref(qweight) if weak else None

    @property
    def qweight(self) -> Optional[QuantizedTensor]:
        """The bound weight (None once released by :meth:`seal`, or when a weak one is gone)."""
        return self._weight if self._weight_ref is None else self._weight_ref()

    def __repr__(self) -> str:
        return (f"<BoundLinear {self.name or ''} {self.variant} N={self.n} K={self.k}, "
                f"prepared for {sorted(self.backends)}>")

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, *, impl: Optional[str] = None,
                 **opts) -> torch.Tensor:
        """The public door: y [..., N] for x [..., K] (bf16/fp16; the reference also float32).

        ``impl`` overrides the pinned request for this call; ``opts`` are activation options of this
        call only (over the bound ones). Raises ValueError naming a bad x, act_dtype, bias or
        option (:func:`validate_input`, formats.validate.check_bias), and what the registry's
        decision raises (InvalidImplementation, ImplementationUnavailable, NoBackend)."""
        request = policy.requested_impl(self.impl if impl is None else impl)
        validate_input(x, self.variant, self.k, request, act_dtype=self.act_dtype)
        check_bias(bias, self.n, x.device)
        return self._call(x, bias, request, opts)

    def run(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, *, watch: bool = True) -> torch.Tensor:
        """The trusted path: x and bias were validated by the caller (the vLLM op: vLLM's dtype and
        the layer's own bias, checked at load). ``watch=False`` keeps the call from the watchdog
        (warmup's random inputs). Raises what the registry's decision raises, and RuntimeError for
        a sealed layer whose request changed after load."""
        return self._call(x, bias, policy.requested_impl(self.impl), None, watch)

    def _call(self, x, bias, request, opts, watch: bool = True):
        m = tokens(x)
        c = self.choice(m, request=request, device=device_of(x) if self.device is None else None,
                        dtype=x.dtype if self.act_dtype is None else self.act_dtype)
        backend, prepared = self._entry(c, m)
        if opts:
            backend.validate_options(opts)
            opts = {**self.act_opts, **opts}
        else:
            opts = self.act_opts
        xin = x if self.act_dtype is None else x.to(self.act_dtype)
        y = backend.run(xin, prepared, bias, **opts)
        self.last_impl = c.impl
        if _check.WATCHDOG is not None and watch and self.name is not None:  # B12X_CHECK on; off: this test is all
            qweight = self.qweight
            if qweight is not None:
                _check.WATCHDOG.after_call(self.name, backend, xin, y, qweight, bias, opts)
        return y

    # -- the decision and the cache ---------------------------------------------------------------
    def choice(self, m: int, *, request: Optional[policy.Request] = None, device: Optional[DeviceInfo] = None,
               dtype: Optional[torch.dtype] = None) -> registry.Choice:
        """The registry's Choice for an m-token call (no call is made): under ``request`` (default:
        read now, the pinned impl first), on the bound device and dtype where they were bound, else
        on ``device`` and ``dtype`` (default bfloat16)."""
        request = policy.requested_impl(self.impl) if request is None else request
        device = device if self.device is None else self.device
        dtype = (torch.bfloat16 if dtype is None else dtype) if self.dtype is None else self.dtype
        return registry.decide(request, self.variant, m, self.n, self.k, device, dtype=dtype)

    def _entry(self, c: registry.Choice, m: int) -> tuple[object, object]:
        """(Backend, prepared weight) of a choice: from the cache, else prepared now (first use),
        or for a sealed layer RuntimeError naming the layer, what it was prepared for and what the
        request now chooses."""
        entry = self.backends.get(c.backend.name)
        if entry is not None:
            backend, prepared = entry
            return backend, (self.qweight if prepared is _THE_WEIGHT else prepared)
        if self.sealed:
            raise RuntimeError(
                f"b12x-dual: layer {self.name} ({self.variant}, N={self.n}, K={self.k}) was prepared for "
                f"{sorted(self.backends)}, but a {m}-token call now chooses {c.backend.name} ({c.source}="
                f"{c.requested}); B12X_IMPL / use_impl() must not change after the model is loaded")
        return self._prepare(c.backend)

    def _prepare(self, backend) -> tuple[object, object]:
        backend.validate_options(self.act_opts)  # the bound options, once per backend
        qweight = self.qweight
        prepared = backend.prepare(qweight)
        # A weakly bound weight is its caller's: the cache must not keep it alive.
        stored = _THE_WEIGHT if self._weight_ref is not None and prepared is qweight else prepared
        self.backends[backend.name] = (backend, stored)
        return backend, prepared

    def prepared(self, backend) -> object:
        """What ``backend`` consumes for this weight, prepared on first use and then reused."""
        entry = self.backends.get(backend.name)
        if entry is None:
            return self._prepare(backend)[1]
        return self.qweight if entry[1] is _THE_WEIGHT else entry[1]

    def prepare_buckets(self, ms: tuple[int, ...] = M_BUCKETS) -> list[tuple[int, registry.Choice]]:
        """Prepare, on the bound device and dtype and under the request as it reads now, the backend
        the registry chooses for each M of ``ms`` (default: one per M bucket up to 2^20), so that a
        layer sealed afterwards finds its prepared weight at any call. Returns (M, Choice) for
        each backend newly prepared, at the first M that chose it. Raises RuntimeError naming the
        layer, the variant and the shape when nothing serves an M (the registry's reason inside)."""
        request = policy.requested_impl(self.impl)
        out = []
        for m in ms:
            try:
                c = registry.decide(request, self.variant, m, self.n, self.k, self.device, dtype=self.dtype)
            except ValueError as e:
                raise RuntimeError(f"b12x-dual: layer {self.name} ({self.variant}, M={m}, N={self.n}, "
                                   f"K={self.k}): {e}") from e
            if c.backend.name not in self.backends:
                self._prepare(c.backend)
                out.append((m, c))
        return out

    def seal(self, keep: Optional[QuantizedTensor] = None) -> None:
        """No backend is prepared after this (a call whose request now chooses another one is
        refused by name); the weight is released, or ``keep`` is kept in its place for the
        watchdog (a copy, where the prepared weights do not hold the values as loaded)."""
        self.sealed = True
        self._weight, self._weight_ref = keep, None

    def reload(self, qweight: QuantizedTensor, act_opts: Optional[dict] = None) -> None:
        """New values for the bound weight: copied into every prepared weight's existing storage
        (``prepare(qweight, into=old)``), and ``act_opts``' tensors into the bound static
        activation scales, so every data_ptr() (and a CUDA graph that captured it) stays valid.
        Raises ValueError for a weight of another format or shape."""
        if qweight.fmt != self.fmt or tuple(qweight.shape) != (self.n, self.k):
            raise ValueError(f"a reload must keep the format and shape: {self.fmt} ({self.n}, {self.k}), "
                             f"got {qweight.fmt} {tuple(qweight.shape)}")
        for name, (backend, old) in list(self.backends.items()):
            if old is not _THE_WEIGHT:
                self.backends[name] = (backend, backend.prepare(qweight, into=old))
        for key, t in (act_opts or {}).items():
            if t is not None and self.act_opts.get(key) is not None:
                self.act_opts[key].copy_(t)
        if self._weight is not None:
            self._weight = qweight


# Bound objects of bare weights (dispatch.linear), dropped when the weight is garbage-collected.
_BARE: dict[tuple[int, str], BoundLinear] = {}


def bound_weight(qweight: QuantizedTensor, variant_: str) -> BoundLinear:
    """The BoundLinear of a bare weight for ``variant_`` (made on first use, held weakly: it lives
    as long as the weight)."""
    key = (id(qweight), variant_)
    bound = _BARE.get(key)
    if bound is None:
        bound = _BARE[key] = BoundLinear(qweight, variant_, weak=True)
        weakref.finalize(qweight, _BARE.pop, key, None)
    return bound
