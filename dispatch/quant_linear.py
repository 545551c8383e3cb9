"""QuantLinear: an nn.Linear whose weight is quantized, served by the dispatcher; model-wide
swapping (quantize_model) and safetensors save/load of the quantized weights.

    model = quantize_model(model, "nvfp4", skip=["classifier"])   # every allowed nn.Linear swapped
    save_quantized(model, "model.nvfp4.safetensors")
    load_quantized(fresh_model, "model.nvfp4.safetensors")        # bit-exact round trip

The quantized weight lives in buffers (codes, scales, global scale, stored as same-width integer
views so that dtype casts of the model leave them alone), so ``.to(device)`` and ``state_dict()``
work as for any module. A layer's calls go through one ``dispatch.bound.BoundLinear`` bound to
those buffers: it validates x, lets the registry decide per M bucket and prepares what a backend
consumes once per backend, lazily, on the first call that backend serves, never per call. A reload
(load_quantized, load_state_dict) copies into the existing buffers and then into each prepared
weight's existing storage, so every data_ptr() (and a CUDA graph that captured it) stays valid;
``.to(device)`` allocates anew and binds the moved buffers afresh (the prepared weights dropped).
"""

from __future__ import annotations

import fnmatch
import json
import logging
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from formats import QuantizedTensor, quantize, spec
from formats.base import check_positive_scalar
from formats.validate import check_scale_values, check_weight

from . import policy, registry
from .bound import BoundLinear
from .contract import tokens
from .devices import device_of

log = logging.getLogger(__name__)

SAFETENSORS_FORMAT = "b12x-dual.quantized.v1"
"""Value of the ``format`` metadata key in files written by save_quantized."""


class QuantLinear(nn.Module):
    """y = x . W^T + b with W stored quantized; each call goes through dispatch.

    Args:
        qweight: weight [N, K] from dispatch.quantize_weight (role "weight").
        bias: optional [N] (kept in its own dtype; the implementations add it in their precision).
        a16: weight-only (W4A16, nvfp4 and mxfp4): activations are not quantized.
        impl: pin this layer's implementation (None: use_impl() / B12X_IMPL / auto per call).
        act_dtype: cast the input to this dtype for the call and the output back to the input's
            dtype (e.g. bf16 to run a float32 model through kernels that take bf16/fp16);
            None: pass the input as is.
        act_opts: activation-quantization options passed to the implementation. A static
            ``scale`` (fp8_tensor) or ``global_scale`` (nvfp4), number or tensor, is checked here
            (finite and > 0; reading a tensor's value synchronizes once, at build, never per call).
    Raises:
        ValueError: a malformed weight, a meta weight, bad scale values, or a bad static act_opts scale;
            at a call, an x that is not a float tensor [..., K] of a dtype the implementation takes
            (or an act_dtype it does not take), as dispatch.bound.validate_input says.
    """

    def __init__(self, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *, a16: bool = False,
                 impl: Optional[str] = None, act_dtype: Optional[torch.dtype] = None,
                 act_opts: Optional[dict] = None):
        super().__init__()
        check_weight(qweight)
        if qweight.data.is_meta:
            raise ValueError("qweight is on the meta device; quantize a materialized weight")
        check_scale_values(qweight)  # once per layer, where it is built (reads the scales: a sync)
        self.fmt = qweight.fmt
        self.a16 = bool(a16)
        self.variant = registry.variant_name(self.fmt, self.a16)
        self.impl = None if impl is None else policy.parse_impl(impl, "impl")
        self.act_dtype = act_dtype
        self.act_opts = dict(act_opts or {})
        # Static activation scales: value-checked once, here, and kept as float32 buffers (they move
        # with the module), so a call passes a device tensor the kernels trust: no host read, no
        # allocation, nothing that would break CUDA-graph capture.
        self._act_scales = []
        for key in ("scale", "global_scale"):
            if self.act_opts.get(key) is not None:
                t = check_positive_scalar(self.act_opts.pop(key), f"act_opts[{key!r}]")
                # an int32 view, like the weight's buffers, so model.half() cannot round it
                self.register_buffer(f"act_{key}", _as_int(t.reshape(1)), persistent=False)
                self._act_scales.append(key)
        self.out_features, self.in_features = qweight.shape
        self._meta = {"block_shape": qweight.block_shape, "scale_layout": qweight.scale_layout}
        # The quantized tensors are stored as same-width integer views, so that module.to(dtype),
        # .half() or .float() (which cast every floating-point buffer, float8 included) leave the
        # codes and scales alone; ``qweight`` views them back as their real dtypes.
        self._dtypes = {}
        for buf, t in (("weight_data", qweight.data), ("weight_scale", qweight.scale),
                       ("weight_global_scale", qweight.global_scale)):
            self._dtypes[buf] = None if t is None else t.dtype
            self.register_buffer(buf, None if t is None else _as_int(t))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._bind()

    def _bind(self, last_impl: Optional[str] = None) -> None:
        """Bind the buffers as they are now (the weight's views, the static activation scales). The
        watchdog's name is the one quantize_model / load_quantized set, else (as
        dispatch.check.layer_name names an unnamed layer) the shape and id."""
        name = self.__dict__.get("_b12x_name") or f"QuantLinear({self.out_features}x{self.in_features})@{id(self):x}"
        opts = {**self.act_opts, **{k: getattr(self, f"act_{k}").view(torch.float32) for k in self._act_scales}}
        self._bound = BoundLinear(self.qweight, self.variant, impl=self.impl, act_dtype=self.act_dtype,
                                  act_opts=opts, name=name)
        self._bound.last_impl = last_impl

    def __getstate__(self):
        # The bound call holds views of the buffers (pickle refuses one storage under two dtypes):
        # a copy or a pickle is bound afresh to its own buffers, keeping the name and last_impl.
        state = self.__dict__.copy()
        state["_bound"] = state["_bound"].last_impl
        return state

    def __setstate__(self, state):
        last_impl = state.pop("_bound")
        super().__setstate__(state)
        self._bind(last_impl)

    @property
    def b12x_name(self) -> str:
        """What the watchdog (B12X_CHECK) calls the layer: its name in the model where
        quantize_model / load_quantized set it, else its shape and id."""
        return self._bound.name

    @b12x_name.setter
    def b12x_name(self, name: str) -> None:
        self.__dict__["_b12x_name"] = name
        self._bound.name = name

    @property
    def last_impl(self) -> Optional[str]:
        """The implementation that served the last call (None before the first)."""
        return self._bound.last_impl

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, *, a16: bool = False, impl: Optional[str] = None,
                    act_dtype: Optional[torch.dtype] = None, act_opts: Optional[dict] = None,
                    **weight_opts) -> "QuantLinear":
        """Quantize an nn.Linear's weight to ``fmt`` (a variant name of dispatch.registry.VARIANTS);
        ``weight_opts`` go to quantize_weight. Raises ValueError when the shape does not suit the format."""
        spec = registry.variant(fmt)
        qweight = quantize(linear.weight.detach(), spec.fmt, role="weight", **weight_opts)
        return cls(qweight, linear.bias, a16=a16 or spec.a16, impl=impl, act_dtype=act_dtype,
                   act_opts=act_opts)

    @property
    def qweight(self) -> QuantizedTensor:
        """The weight as a QuantizedTensor (views of the buffers, no copy)."""
        def real(buf):
            t = getattr(self, buf)
            return None if t is None else t.view(self._dtypes[buf])

        return QuantizedTensor(self.fmt, "weight", real("weight_data"), real("weight_scale"),
                               real("weight_global_scale"), self._meta["block_shape"],
                               (self.out_features, self.in_features), self._meta["scale_layout"])

    # -- preparation ----------------------------------------------------------------------------
    def prepared(self, backend: registry.Backend):
        """What ``backend`` consumes for this weight, prepared on first use and then reused."""
        return self._bound.prepared(backend)

    @property
    def _prepared(self) -> dict[str, object]:
        """{backend name: prepared weight} of the bound cache (read-only)."""
        return {name: self._bound.prepared(backend) for name, (backend, _) in self._bound.backends.items()}

    def refresh_prepared(self) -> None:
        """After new values were copied into the buffers: copy them into every prepared weight's
        existing storage (``prepare(..., into=)``), so their data_ptr()s stay as they were."""
        self._bound.reload(self.qweight)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() replace the buffers: anything prepared from the old ones is stale.
        out = super()._apply(fn, *args, **kwargs)
        self._bind(self._bound.last_impl)
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict copies new values into the existing buffers; the prepared weights follow.
        out = super()._load_from_state_dict(*args, **kwargs)
        self.refresh_prepared()
        return out

    # -- call -----------------------------------------------------------------------------------
    def choose(self, x: torch.Tensor) -> registry.Choice:
        """The registry's choice for input ``x`` (no call is made)."""
        dtype = x.dtype if self.act_dtype is None else self.act_dtype
        return self._bound.choice(tokens(x), device=device_of(x), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._bound(x, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        if self.impl is not None:
            impl = f"{self.impl} (pinned)"
        else:
            requested, source = policy.requested_impl()
            impl = f"{requested} (from {source})"
        if self.last_impl is not None:
            impl += f", last call: {self.last_impl}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt}, variant={self.variant}, impl={impl}")


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as an integer dtype of the same width (no copy)."""
    return t.detach().contiguous().view(_INT_OF_WIDTH[t.element_size()])


# ---------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------
Skip = Union[None, Iterable[str], Callable[[str, nn.Linear], bool]]


def _skip_reason(name: str, module: nn.Linear, fmt: str, skip: Skip) -> Optional[str]:
    if callable(skip):
        if skip(name, module):
            return "skip() returned True"
    elif skip is not None:
        for pattern in ([skip] if isinstance(skip, str) else skip):
            if fnmatch.fnmatchcase(name, pattern):
                return f"name matches skip pattern {pattern!r}"
    k_multiple = spec(registry.variant(fmt).fmt).k_multiple
    if module.in_features % k_multiple:
        return f"K={module.in_features} is not a multiple of {k_multiple} ({registry.variant(fmt).fmt} block)"
    return None


def quantize_model(model: nn.Module, fmt: str, skip: Skip = None, **opts) -> nn.Module:
    """Replace, in place, every nn.Linear of ``model`` that ``fmt`` allows by a QuantLinear.

    Args:
        model: any module.
        fmt: a variant name (a format, or "nvfp4_w4a16" / "mxfp4_w4a16" / "mxfp8_w8a16").
        skip: fnmatch patterns of module names to leave alone (e.g. ["lm_head", "*.gate"]), or a
            callable(name, linear) -> bool.
        **opts: QuantLinear.from_linear options (impl, act_dtype, act_opts, weight options).
    Returns:
        ``model``. Each layer left in place is logged (INFO) with the reason; the list is also in
        ``model.b12x_skipped`` as {name: reason}.
    """
    registry.variant(fmt)  # unknown format: ValueError before anything is touched
    skipped: dict[str, str] = {}
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    for name, module in targets:
        reason = _skip_reason(name, module, fmt, skip)
        if reason is not None:
            skipped[name] = reason
            log.info("quantize_model(%s): left %s (%dx%d) unquantized: %s", fmt, name,
                     module.out_features, module.in_features, reason)
            continue
        _set_submodule(model, name, QuantLinear.from_linear(module, fmt, **opts))
    model.b12x_skipped = skipped
    return model


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(new, QuantLinear):
        new.b12x_name = name  # what the watchdog (B12X_CHECK) calls the layer
    setattr(parent, child, new)


# ---------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------
def _layer_meta(q: QuantLinear) -> dict:
    return {"fmt": q.fmt, "variant": q.variant, "a16": q.a16, "shape": [q.out_features, q.in_features],
            "block_shape": None if q._meta["block_shape"] is None else list(q._meta["block_shape"]),
            "scale_layout": q._meta["scale_layout"], "bias": q.bias is not None}


def save_quantized(model: nn.Module, path) -> dict[str, dict]:
    """Write every QuantLinear's quantized weight (and bias) to a safetensors file.

    Tensors are named ``<layer>.weight_data``, ``.weight_scale``, ``.weight_global_scale`` (nvfp4)
    and ``.bias``; the metadata holds ``format`` = SAFETENSORS_FORMAT and ``layers``, a JSON object
    {layer: {fmt, variant, a16, shape, block_shape, scale_layout, bias}}. Returns that object.
    """
    from safetensors.torch import save_file

    tensors, layers = {}, {}
    for name, q in model.named_modules():
        if not isinstance(q, QuantLinear):
            continue
        layers[name] = _layer_meta(q)
        qw = q.qweight
        for buf, t in (("weight_data", qw.data), ("weight_scale", qw.scale),
                       ("weight_global_scale", qw.global_scale), ("bias", q.bias)):
            if t is not None:
                tensors[f"{name}.{buf}"] = t.detach().contiguous().cpu()
    if not layers:
        raise ValueError("the model has no QuantLinear layers to save (run quantize_model first)")
    save_file(tensors, str(path), metadata={"format": SAFETENSORS_FORMAT, "layers": json.dumps(layers)})
    return layers


def read_quantized(path) -> dict[str, tuple[QuantizedTensor, Optional[torch.Tensor], dict]]:
    """Read a save_quantized file: {layer: (qweight, bias or None, metadata)} on the CPU.

    Every layer's weight is validated as it is read (formats.validate: dtypes and shapes per format,
    then the scale values: global and fp32 scales finite and > 0, no NaN scale codes).
    Raises:
        ValueError naming the path (and the layer and tensor where there is one): an unreadable or
        truncated file, not a b12x-dual file, a tensor missing from a layer or present in the file
        without belonging to a layer, or a tensor of the wrong dtype or shape for its format.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != SAFETENSORS_FORMAT:
                raise ValueError(f"{path}: not a b12x-dual quantized file (metadata format={meta.get('format')!r})")
            layers = json.loads(meta["layers"])
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{path}: cannot read it as a b12x-dual safetensors file "
                         f"({type(e).__name__}: {e}); is it truncated or of another kind?") from None
    out, used = {}, set()
    for name, m in layers.items():
        def get(buf, required):
            key = f"{name}.{buf}"
            if key in tensors:
                used.add(key)
                return tensors[key]
            if required:
                raise ValueError(f"{path}: layer {name!r}: tensor {key!r} is missing from the file")
            return None

        block = None if m["block_shape"] is None else tuple(m["block_shape"])
        q = QuantizedTensor(m["fmt"], "weight", get("weight_data", True), get("weight_scale", True),
                            get("weight_global_scale", False), block, tuple(m["shape"]), m["scale_layout"])
        what = f"{path}: layer {name!r} weight"
        check_weight(q, m["fmt"], name=what)
        check_scale_values(q, name=what)
        out[name] = (q, get("bias", bool(m["bias"])), m)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{path}: tensors {extra} belong to no layer of the file's metadata")
    return out


def _check_materialized(module: nn.Module, name: str, path) -> None:
    meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(f"{path}: layer {name!r} has tensors on the meta device ({meta}); materialize the "
                         "model first (e.g. model.to_empty(device=...)) so the weights have real storage")


def load_quantized(model: nn.Module, path, **opts) -> nn.Module:
    """Load a save_quantized file into ``model``, in place.

    A layer that is an nn.Linear is replaced by a QuantLinear built from the file (``opts``: impl,
    act_dtype, act_opts); a layer that is already a QuantLinear of the same format and shape gets
    the stored tensors copied into its existing buffers and from there into every weight prepared
    for a backend (their storage, hence captured CUDA graphs, stays valid). Anything else raises
    ValueError naming the layer: a layer missing from the model, of another variant or shape, or on
    the meta device; and what read_quantized raises for the file (missing, extra, mis-shaped or
    mis-typed tensors, a truncated file).
    """
    for name, (q, bias, m) in read_quantized(path).items():
        try:
            current = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: layer {name!r} is not in the model") from None
        _check_materialized(current, name, path)
        if isinstance(current, QuantLinear):
            if current.variant != m["variant"] or [current.out_features, current.in_features] != m["shape"]:
                raise ValueError(f"{path}: layer {name!r} is {current.variant} {current.out_features}x"
                                 f"{current.in_features} in the model but {m['variant']} {m['shape']} in the file")
            mine = _layer_meta(current)
            for field in ("block_shape", "scale_layout", "bias"):
                if mine[field] != m[field]:
                    raise ValueError(f"{path}: layer {name!r} has {field}={mine[field]!r} in the model but "
                                     f"{m[field]!r} in the file; load into a matching layer (or a fresh model)")
            with torch.no_grad():
                for buf, t in (("weight_data", q.data), ("weight_scale", q.scale),
                               ("weight_global_scale", q.global_scale), ("bias", bias)):
                    if t is not None:
                        dst = getattr(current, buf)
                        dst.copy_(t if buf == "bias" else _as_int(t.to(current._dtypes[buf])))
            current.refresh_prepared()
        elif isinstance(current, nn.Linear):
            if [current.out_features, current.in_features] != m["shape"]:
                raise ValueError(f"{path}: layer {name!r} is {current.out_features}x{current.in_features} in the "
                                 f"model but {m['shape']} in the file")
            dev = current.weight.device
            new = QuantLinear(q.to(dev), None if bias is None else bias.to(dev), a16=m["a16"], **opts)
            _set_submodule(model, name, new)
        else:
            raise ValueError(f"{path}: layer {name!r} is a {type(current).__name__}, not a Linear")
    return model
