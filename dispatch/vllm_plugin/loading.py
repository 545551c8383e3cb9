"""Every checkpoint tensor vLLM loads into a layer our kernels serve is checked before vLLM copies it.

vLLM creates a layer's parameters in ``quant_method.create_weights`` (``torch.empty``: uninitialised
memory) and fills each from the checkpoint through the parameter's ``weight_loader``, which narrows
and ``copy_``-casts without looking at the dtype. Left alone, that gives four silent failures:

- a tensor missing from the file leaves its parameter uninitialised (any value, NaN or 1e36);
- an MXFP8/MXFP4 E8M0 ``weight_scale`` stored as float32 (2^-3 = 0.125) is cast to the byte 0;
- E8M0 scales stored as float8_e8m0fnu go into vLLM's uint8 parameter through ``copy_``, which
  converts values (2^-3 becomes 0) instead of keeping the bytes;
- a wrongly shaped block scale or packed weight fails deep in vLLM's ``parameter.py`` (``start (0) +
  length (3) exceeds dimension size (2)``), naming no layer or tensor.

:func:`guard` (called by the ``load_checks`` patch right after ``create_weights``, only for a layer
whose kernel is one of ours) wraps each kept ``weight_loader``: the wrapper checks the checkpoint
tensor's dtype and shape against :data:`SPECS` (the family's tensors as checkpoints store them:
compressed-tensors, ModelOpt, DeepSeek ``Fp8Config``), records which (parameter, shard) arrived,
then calls vLLM's loader (E8M0 bytes reinterpreted, not converted, to the parameter's byte
dtype). :func:`check_complete` (run when vLLM processes the layer's weights, before vLLM's own
processing reads them) names every parameter, and every fused shard, that never received a
tensor. Each failure raises :class:`convert.CheckpointError` (a ValueError) naming the layer (its
checkpoint prefix), the tensor, what arrived and what is expected.

Shapes are checked on the full checkpoint tensor (vLLM narrows it per tensor-parallel rank after
the check), in the layer's full (unsharded) sizes: K = ``layer.input_size``; N of the shard = the
fused module's own size (q: total heads x head size, k/v: total KV heads x head size; a merged
column's ``output_sizes[i]``; else ``layer.output_size``).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .convert import CheckpointError, layer_name

log = logging.getLogger("dispatch.vllm_plugin")

E8M0 = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
SCALE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # upcast to vLLM's float32 exactly
BIAS_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
E4M3 = (torch.float8_e4m3fn,)
U8 = (torch.uint8,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: allowed dtypes and its full shape from (N, K), or None for a
    per-tensor scale (one element per shard); ``hint`` is added to a dtype refusal; ``positive``:
    every value must be finite and > 0 (the fp32 per-tensor and per-channel scales: a zero,
    negative, NaN or Inf one is refused as it arrives, before vLLM's max over fused shards could
    hide it)."""

    dtypes: tuple
    shape: Optional[Callable[[int, int], tuple]]
    what: str
    hint: str = ""
    positive: bool = False

    def expected(self, n: int, k: int) -> str:
        return "one element (shape (), (1,))" if self.shape is None else str(self.shape(n, k))


_E8M0_HINT = ("; E8M0 scales must be stored as their bytes (uint8 or float8_e8m0fnu, byte = log2(scale) + "
              "127): vLLM's loader would cast float values such as 0.125 to the byte 0 without a word")
_W_E4M3 = Spec(E4M3, lambda n, k: (n, k), "an e4m3 weight [N, K]")
_W_FP4 = Spec(U8, lambda n, k: (n, _cdiv(k, 2)), "a packed e2m1 weight [N, K/2] (two codes a byte)")
_PER_TENSOR = Spec(SCALE_FLOATS, None, "a per-tensor scale", positive=True)
_MX_SCALE = Spec(E8M0, lambda n, k: (n, _cdiv(k, 32)), "an E8M0 block scale [N, K/32]", _E8M0_HINT)
_BLOCK_SCALE = Spec(SCALE_FLOATS + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()),
                    lambda n, k: (_cdiv(n, 128), _cdiv(k, 128)), "a 128x128 block scale [ceil(N/128), ceil(K/128)]",
                    "; UE8M0 block scales must be float8_e8m0fnu (uint8 bytes would be cast as integers)")
_NV_SCALE = Spec(E4M3, lambda n, k: (n, _cdiv(k, 16)), "an e4m3 block scale [N, K/16]")
_CHANNEL_SCALE = Spec(SCALE_FLOATS, lambda n, k: (n, 1), "a per-channel scale [N, 1] (one per output channel)",
                      positive=True)

# Registry variant -> {parameter name as vLLM registers it -> Spec}. Names vLLM 0.32/0.33 use:
# CT (weight_packed, weight_global_scale, input_global_scale), ModelOpt (weight, weight_scale_2,
# input_scale), DeepSeek Fp8Config (weight_scale_inv).
_NVFP4 = {"weight_packed": _W_FP4, "weight": _W_FP4, "weight_scale": _NV_SCALE,
          "weight_global_scale": _PER_TENSOR, "input_global_scale": _PER_TENSOR,
          "weight_scale_2": _PER_TENSOR, "input_scale": _PER_TENSOR}
SPECS: dict[str, dict[str, Spec]] = {
    "fp8_tensor": {"weight": _W_E4M3, "weight_scale": _PER_TENSOR, "input_scale": _PER_TENSOR},
    "fp8_channel": {"weight": _W_E4M3, "weight_scale": _CHANNEL_SCALE, "input_scale": _PER_TENSOR},
    "fp8_block": {"weight": _W_E4M3, "weight_scale": _BLOCK_SCALE, "weight_scale_inv": _BLOCK_SCALE},
    "mxfp8": {"weight": _W_E4M3, "weight_scale": _MX_SCALE},
    "mxfp8_w8a16": {"weight": _W_E4M3, "weight_scale": _MX_SCALE},
    "nvfp4": _NVFP4,
    "nvfp4_w4a16": _NVFP4,
    "mxfp4": {"weight_packed": _W_FP4, "weight": _W_FP4, "weight_scale": _MX_SCALE},
    "mxfp4_w4a16": {"weight_packed": _W_FP4, "weight": _W_FP4, "weight_scale": _MX_SCALE},
}
_BIAS = Spec(BIAS_FLOATS, lambda n, k: (n,), "a bias [N]")


@dataclass
class LoadRecord:
    """What a guarded layer expects and what arrived: parameter name -> shards loaded."""

    variant: str
    shards: tuple  # (None,) or ("q", "k", "v") or (0, 1, ...)
    wrapped: dict = field(default_factory=dict)  # name -> Spec
    arrived: dict = field(default_factory=dict)  # name -> set of shard ids
    checked: bool = False  # a load was checked complete (and its arrivals forgotten)


def _shards(layer) -> tuple:
    if hasattr(layer, "total_num_kv_heads") and hasattr(layer, "head_size"):
        return ("q", "k", "v")
    sizes = getattr(layer, "output_sizes", None)
    if sizes is not None and len(sizes) > 1 and type(layer).__name__ != "ColumnParallelLinear":
        return tuple(range(len(sizes)))
    return (None,)


def _full_n(layer, shard) -> Optional[int]:
    """The checkpoint tensor's N (output features, unsharded) for one shard id (None: the whole
    layer); None for a shard id this module does not know (then only the dtype is checked)."""
    if isinstance(shard, (tuple, list)):
        parts = [_full_n(layer, s) for s in shard]
        return None if None in parts else sum(parts)
    if hasattr(layer, "total_num_kv_heads") and hasattr(layer, "head_size"):
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        v = layer.total_num_kv_heads * getattr(layer, "v_head_size", layer.head_size)
        if len(getattr(layer, "output_sizes", ())) > 3:  # a fused layer with more than q/k/v
            return {"q": q, "k": kv, "v": v}.get(shard)
        return {"q": q, "k": kv, "v": v, None: q + kv + v}.get(shard)
    if isinstance(shard, int):
        sizes = getattr(layer, "output_sizes", ())
        return int(sizes[shard]) if 0 <= shard < len(sizes) else None
    if shard is None:
        return int(layer.output_size)
    return None


def our_kernel(layer):
    """The b12x-dual kernel object serving ``layer`` (held by its quant method or CT scheme), else None."""
    for owner in (getattr(layer, "quant_method", None), getattr(layer, "scheme", None)):
        if owner is None:
            continue
        for v in vars(owner).values():
            if getattr(type(v), "B12X_DUAL_KERNEL", False):  # kernels._Adapter's mark (kernels imports us)
                return v
    return None


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)}"


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _shard_text(shard) -> str:
    return "" if shard is None else f" (shard {shard!r})"


def check_tensor(layer, name: str, spec: Spec, loaded: torch.Tensor, shard) -> None:
    """Raise CheckpointError unless ``loaded`` (a checkpoint tensor for ``layer.<name>``, shard
    ``shard``) has an allowed dtype, the expected full shape and, for a ``positive`` spec, only
    finite values > 0."""
    n, k = _full_n(layer, shard), int(layer.input_size)
    where = f"layer {layer_name(layer)}: checkpoint tensor {name!r}{_shard_text(shard)}"
    if loaded.dtype not in spec.dtypes:
        raise CheckpointError(f"{where} is {_fmt(loaded)}; {spec.what} must be one of {_names(spec.dtypes)}"
                              f"{spec.hint}")
    if spec.positive and loaded.numel():
        v = loaded.detach().float().reshape(-1)
        bad = ~(torch.isfinite(v) & (v > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            at = f" at row {i}" if loaded.numel() > 1 else ""
            raise CheckpointError(f"{where} is {_fmt(loaded)} holding {float(v[i])!r}{at}; {spec.what} must be "
                                  "finite and > 0 (a zero, negative, NaN or Inf scale is a corrupt checkpoint)")
    if n is None:  # a shard layout this module does not know: vLLM's loader checks the shape
        return
    if spec.shape is None:
        fused = shard is None and len(_shards(layer)) > 1
        ok = loaded.numel() == 1 or (fused and loaded.numel() == len(_shards(layer)) and loaded.dim() == 1)
    else:
        ok = tuple(loaded.shape) == tuple(spec.shape(n, k))
    if not ok:
        raise CheckpointError(f"{where} is {_fmt(loaded)}; expected {spec.what} of shape "
                              f"{spec.expected(n, k)} for N={n}, K={k}")


def _shard_of(args, kwargs):
    if args:
        return args[0]
    for key in ("loaded_shard_id", "shard_id"):
        if key in kwargs:
            return kwargs[key]
    return None


def _wrap(layer, record: LoadRecord, name: str, spec: Spec, original: Callable) -> Callable:
    @functools.wraps(original)
    def b12x_dual_checked_loader(param, loaded_weight, *args, **kwargs):
        shard = _shard_of(args, kwargs)
        check_tensor(layer, name, spec, loaded_weight, shard)
        if spec.dtypes == E8M0 and loaded_weight.dtype != param.dtype and param.dtype in E8M0:
            # The same E8M0 bytes in the parameter's dtype: copy_ between uint8 and float8_e8m0fnu
            # converts values (2^(b-127) <-> integer), which would change every scale.
            loaded_weight = loaded_weight.view(param.dtype)
        try:
            out = original(param, loaded_weight, *args, **kwargs)
        except (RuntimeError, AssertionError, IndexError) as e:
            n, k = _full_n(layer, shard), int(layer.input_size)
            raise CheckpointError(f"layer {layer_name(layer)}: checkpoint tensor {name!r}{_shard_text(shard)} "
                                  f"({_fmt(loaded_weight)}) was refused by vLLM's loader for a parameter of shape "
                                  f"{tuple(param.shape)} (N={n}, K={k}): {type(e).__name__}: {e}") from e
        got = record.arrived.setdefault(name, set())
        if shard is None:
            got.update(record.shards)
        elif isinstance(shard, (tuple, list)):
            got.update(shard)
        else:
            got.add(shard)
        return out

    b12x_dual_checked_loader.__b12x_dual_original__ = original
    return b12x_dual_checked_loader


def guard(layer: torch.nn.Module) -> Optional[LoadRecord]:
    """Wrap the weight_loader of every parameter of ``layer`` that a checkpoint fills (SPECS, and
    the bias), if one of our kernels serves it; idempotent. Returns the layer's LoadRecord or None."""
    kernel = our_kernel(layer)
    if kernel is None or not hasattr(layer, "input_size"):
        return None
    variant = kernel._variant()
    specs = SPECS.get(variant, {})
    record = getattr(layer, "b12x_dual_load_record", None)
    if record is None:
        record = LoadRecord(variant, _shards(layer))
        layer.b12x_dual_load_record = record
    for name, p in layer.named_parameters(recurse=False):
        spec = specs.get(name) or (_BIAS if name == "bias" else None)
        loader = getattr(p, "weight_loader", None)
        if spec is None or loader is None or getattr(loader, "__b12x_dual_original__", None) is not None:
            continue
        p.weight_loader = _wrap(layer, record, name, spec, loader)
        record.wrapped[name] = spec
    return record


def _dummy_load() -> bool:
    """True while vLLM loads with ``load_format="dummy"`` (random values written straight into the
    parameters, no weight_loader runs: nothing comes from a checkpoint, so nothing is missing)."""
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except ImportError:
        return False
    fmt = getattr(getattr(cfg, "load_config", None), "load_format", None)
    return str(getattr(fmt, "value", fmt)) == "dummy"


def check_complete(layer: torch.nn.Module) -> None:
    """Raise CheckpointError naming every guarded parameter (and fused shard) of ``layer`` that no
    checkpoint tensor reached; then forget the arrivals, so that a reload is checked afresh.
    A layer without a LoadRecord (not ours, or built before the patch) passes, and so does every
    layer under vLLM's ``load_format="dummy"``."""
    record = getattr(layer, "b12x_dual_load_record", None)
    if record is None or (record.checked and not record.arrived):  # processing the same load again
        return
    if _dummy_load():
        record.arrived.clear()
        return
    missing = []
    for name in record.wrapped:
        p = getattr(layer, name, None)
        if not isinstance(p, torch.Tensor) or p.numel() == 0:  # removed, or already repacked and freed
            continue
        lost = [s for s in record.shards if s not in record.arrived.get(name, set())]
        if lost:
            shards = "" if lost == [None] else " (shards " + ", ".join(repr(s) for s in lost) + ")"
            missing.append(f"{name!r}{shards}")
    if missing:
        raise CheckpointError(f"layer {layer_name(layer)}: checkpoint tensor(s) {', '.join(missing)} missing "
                              f"from the checkpoint (their weight_loader never ran); the layer would serve "
                              f"uninitialised memory ({record.variant})")
    record.arrived.clear()
    record.checked = True


# ---------------------------------------------------------------------------------------------
# Values: the checkpoint checks of ``b12x-dual diff`` (formats.validate.scan_values), at load
# ---------------------------------------------------------------------------------------------
ENV_ALLOW_NAN_WEIGHTS = "B12X_VLLM_ALLOW_NAN_WEIGHTS"
ALLOW_ON = ("1", "true", "on", "yes")
ALLOW_OFF = ("", "0", "false", "off", "no")


def allow_nan_weights() -> bool:
    """True when B12X_VLLM_ALLOW_NAN_WEIGHTS is 1/true/on/yes (serve a layer whose weight holds NaN
    codes, with a WARNING), False when it is unset, empty or 0/false/off/no (refuse it: the
    default). Case and surrounding blanks are ignored.

    Raises:
        ValueError: any other value, naming the variable, the value and what is allowed (as
            B12X_VLLM_AUTO does), so that a typo never silently serves NaN weights.
    """
    raw = os.environ.get(ENV_ALLOW_NAN_WEIGHTS, "")
    value = raw.strip().lower()
    if value in ALLOW_OFF:
        return False
    if value in ALLOW_ON:
        return True
    raise ValueError(f"{ENV_ALLOW_NAN_WEIGHTS}={raw!r} is not allowed; allowed: {', '.join(ALLOW_ON)} (serve NaN "
                     f"weight codes) or {', '.join(ALLOW_OFF[1:])} / unset (refuse them)")


def check_values(qw, act_opts: dict, name: str, rename=None) -> list[dict]:
    """The value checks of a layer's weight as loaded, once per layer (formats.validate.scan_values
    on the weight, scan_scalar on static activation scales; it reads every code and scale, one
    device synchronization): the same findings as ``b12x-dual diff``'s checkpoint stage.

    Raises CheckpointError naming the layer, the tensor, the positions and what the value means for
    a NaN, Inf, zero or negative scale or an E8M0 0xFF (always: every implementation trusts the
    scales), and for a NaN weight code unless B12X_VLLM_ALLOW_NAN_WEIGHTS is on (then one WARNING
    per layer). A zero block scale over non-zero codes is logged once per layer (WARNING) and
    served. ``rename`` (optional) maps a finding's tensor name ("weight.scale") to the layer's
    own (the MoE method: "w13_weight_scale"). Returns the findings (for reports and tests).
    """
    from formats.validate import UNSOUND, describe_finding, scan_scalar, scan_values

    findings = scan_values(qw, name="weight")
    if rename is not None:
        findings = [dict(f, tensor=rename(f["tensor"])) for f in findings]
    for key, t in act_opts.items():
        if isinstance(t, torch.Tensor):
            findings += scan_scalar(t, f"input {key}")
    refused = [f for f in findings if f["severity"] == UNSOUND and f["kind"] != "nan_code"]
    if refused:
        raise CheckpointError(f"layer {name}: " + "; ".join(describe_finding(f) for f in refused))
    nan_codes = [f for f in findings if f["kind"] == "nan_code"]
    if nan_codes:
        text = f"layer {name}: " + describe_finding(nan_codes[0])
        if not allow_nan_weights():
            raise CheckpointError(f"{text}. Refused: the layer would answer NaN. Serve it anyway with "
                                  f"{ENV_ALLOW_NAN_WEIGHTS}=1; b12x-dual diff MODEL lists every such value")
        log.warning("b12x-dual: %s; served anyway (%s=%s)", text, ENV_ALLOW_NAN_WEIGHTS,
                    os.environ.get(ENV_ALLOW_NAN_WEIGHTS))
    for f in findings:
        if f["severity"] != UNSOUND:
            log.warning("b12x-dual: layer %s: %s", name, describe_finding(f))
    return findings
