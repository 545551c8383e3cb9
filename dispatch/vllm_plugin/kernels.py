"""vLLM 0.33.0 linear-kernel classes over the b12x-dual backend registry, one per format.

Each subclasses vLLM's base for its format and implements vLLM's four verbs:

    is_supported(compute_capability)  platform, device and request (see placement.py)
    can_implement(config)             format constraints; the reason names the value and what is allowed
    process_weights_after_loading     layer tensors -> QuantizedTensor (convert.py) -> prepare for each
                                      backend registry.choose picks over the M buckets (one in practice),
                                      once; on a reload, into the existing storage; frees what it copied
    apply_weights                     one torch.ops.b12x_dual.linear call (ops.py): registry.choose for
                                      the call's M bucket, then that backend's apply

Importing this module imports vLLM's linear-kernel package (and whatever that imports), never our
kernel packages: those load on the first prepare/apply.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from vllm.model_executor.kernels.linear import (
    Fp8BlockScaledMMLinearKernel,
    FP8ScaledMMLinearKernel,
    MxFp4LinearKernel,
    Mxfp8LinearKernel,
    NvFp4LinearKernel,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, kMxfp4Dynamic
from vllm.model_executor.utils import replace_parameter

from .. import check as _check
from ..contract import KERNEL_DTYPES
from ..devices import current_device
from . import convert, loading, ops, placement, scheme

log = logging.getLogger("dispatch.vllm_plugin")

ACT_DTYPES = KERNEL_DTYPES


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _check_dtypes(config) -> tuple[bool, Optional[str]]:
    if config.input_dtype not in ACT_DTYPES:
        return False, f"input dtype is {_dtype_name(config.input_dtype)}; b12x-dual takes bfloat16 or float16"
    if config.out_dtype is not None and config.out_dtype != config.input_dtype:
        return False, (f"output dtype {_dtype_name(config.out_dtype)} differs from the input dtype "
                       f"{_dtype_name(config.input_dtype)}; b12x-dual writes the input's dtype")
    return True, None


def _check_copy(qw):
    """A copy of the weight for the watchdog (the layer's own tensors are freed after prepare)."""
    g = None if qw.global_scale is None else qw.global_scale.clone()
    from dataclasses import replace

    return replace(qw, data=qw.data.clone(), scale=qw.scale.clone(), global_scale=g)


class _Adapter:
    """What the seven classes share: placement, load (choose, prepare, free) and the op call."""

    B12X_DUAL_KERNEL = True  # what loading.our_kernel looks for (it cannot import this module back)
    VARIANT: str = ""
    QUANT_KEY: str = ""
    FREED: tuple[str, ...] = ("weight", "weight_scale")
    # The variants this class's conversion serves: the checkpoint's scheme picks among them.
    SERVES: tuple[str, ...] = ()

    @classmethod
    def _placement(cls, compute_capability=None, variant: Optional[str] = None) -> tuple[bool, Optional[str]]:
        ok, why = placement.placement(variant or cls.VARIANT, cls.QUANT_KEY, compute_capability)
        placement.log_once(logging.INFO if ok else logging.DEBUG, "b12x-dual %s: %s: %s", cls.__name__,
                           "eligible" if ok else "declines", why)
        return ok, (None if ok else why)

    def _variant(self) -> str:
        return self.VARIANT

    def _checkpoint_variant(self, layer: torch.nn.Module, name: str) -> str:
        """The variant the checkpoint's own scheme names (scheme.py), which wins over the one vLLM's
        scheme object implies; logged once where the two differ. Raises CheckpointError where the
        checkpoint's scheme is one this class does not serve."""
        implied = self._variant()
        ck = scheme.read(layer)
        if ck is None:
            return implied
        serves = self.SERVES or (self.VARIANT,)
        if ck.variant is None or ck.variant not in serves:
            what = ck.why or f"its variant {ck.variant} is not served by {type(self).__name__}"
            raise convert.CheckpointError(
                f"layer {name}: the checkpoint's scheme is {ck.text}; {what}. {type(self).__name__} "
                f"serves {', '.join(serves)}: serve this layer with another --linear-backend, or "
                "quantize it with a scheme b12x-dual serves")
        if ck.variant != implied:
            placement.log_once(logging.WARNING, "b12x-dual: vLLM's scheme for %s implies %s, but the checkpoint "
                               "says %s; serving %s, as the checkpoint says", type(self).__name__, implied,
                               ck.text, ck.variant)
        return ck.variant

    def _load(self, layer: torch.nn.Module, qw, act_opts: dict) -> None:
        n, k = qw.shape
        name = convert.layer_name(layer)
        loading.check_values(qw, act_opts, name)  # once per layer (reads codes and scales): diff's checkpoint checks
        variant = self._checkpoint_variant(layer, name)
        dtype = getattr(layer, "params_dtype", None) or torch.get_default_dtype()
        handle = getattr(layer, "b12x_dual_handle", None)
        if handle is not None:  # reload: same storage, so captured CUDA graphs stay valid
            st = ops.state(handle)
            if (st.variant, st.n, st.k) != (variant, n, k):
                raise convert.CheckpointError(
                    f"layer {name}: reloaded weight is {variant} N={n} K={k}, but the layer was loaded as "
                    f"{st.variant} N={st.n} K={st.k}; a reload must keep the format and shape")
            st.reload(qw, act_opts)
        else:
            st = ops.LayerState(qw, variant, name=name, device=current_device(qw.device), dtype=dtype,
                                act_opts=act_opts)
            for m, chosen in st.prepare_buckets():  # every M bucket's choice, so each call finds its weight
                placement.log_once(logging.INFO, "b12x-dual: %s %s N=%d K=%d -> %s (%s=%s) from M=%d: %s",
                                   type(self).__name__, variant, n, k, chosen.impl, chosen.source,
                                   chosen.requested, m, chosen.reason)
            layer.b12x_dual_handle = ops.new_handle(st)
        # B12X_CHECK on: the oracle needs the weight as loaded (the layer's own tensors are freed below)
        keep = None if _check.WATCHDOG is None else (qw if st.prepared is qw else _check_copy(qw))
        st.seal(keep)
        layer.b12x_dual_n = n
        for pname in self.FREED:
            p = getattr(layer, pname, None)
            if isinstance(p, torch.nn.Parameter) and p.numel():
                replace_parameter(layer, pname, p.data.new_empty((0,)))  # keeps weight_loader
        layer.b12x_warmup_provider = self

    # [apply]
    def _run(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.b12x_dual.linear(x, bias, layer.b12x_dual_handle, layer.b12x_dual_n)
    # [/apply]

    def get_b12x_warmup_unit(self, layer, token_counts, output_dtype):
        """vLLM's b12x warmup hook (vllm/model_executor/warmup/b12x_warmup.py): a unit per layer,
        keyed by the layer's signature, so identical layers compile once."""
        from . import warmup

        return warmup.unit(layer, token_counts)


# ---------------------------------------------------------------------------------------------
# FP8 with vLLM's ScaledMM keys: per-tensor and per-channel weight scales
# ---------------------------------------------------------------------------------------------
class _Fp8ScaledMM(_Adapter, FP8ScaledMMLinearKernel):
    """What the two FP8 ScaledMM classes share: the dtype and placement checks after ``_scales_ok``
    (each class's scale granularity), the conversion ``CONVERT`` (a dispatch.vllm_plugin.convert
    function) and apply_weights. Not registered itself (KERNELS lists its subclasses)."""

    CONVERT = None

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return cls._placement(compute_capability)

    @classmethod
    def _scales_ok(cls, w, a) -> tuple[bool, Optional[str]]:
        raise NotImplementedError

    @classmethod
    def can_implement(cls, config):
        ok, why = cls._scales_ok(config.weight_quant_key.scale, config.activation_quant_key.scale)
        if not ok:
            return ok, why
        ok, why = _check_dtypes(config)
        if not ok:
            return ok, why
        n, k = config.weight_shape
        ok, why = placement.shape_placement(cls.VARIANT, cls.QUANT_KEY, n, k, config.input_dtype)
        return ok, (None if ok else why)

    def process_weights_after_loading(self, layer):
        n, k = self.config.weight_shape
        static = bool(self.config.activation_quant_key.scale.static)
        qw, act = type(self).CONVERT(layer, n, k, static_input=static)
        self._load(layer, qw, act)

    def apply_weights(self, layer, x, bias=None):
        return self._run(layer, x, bias)

    def apply_scaled_mm(self, **kwargs):  # the base class's hook; apply_weights never calls it
        raise NotImplementedError(f"{type(self).__name__} overrides apply_weights")


class B12xDualFp8TensorKernel(_Fp8ScaledMM):
    """Per-tensor FP8 (CT / ModelOpt ``fp8_w8a8``) through b12x-dual's fp8_tensor backend
    (per-channel weights go to B12xDualFp8ChannelKernel, next in vLLM's list)."""

    VARIANT, QUANT_KEY = "fp8_tensor", "fp8_w8a8"
    CONVERT = staticmethod(convert.fp8_tensor)

    @classmethod
    def _scales_ok(cls, w, a):
        if not (w.static and w.group_shape.is_per_tensor()):
            return False, (f"weight scale is {w.group_shape} (static={w.static}); this class takes one static "
                           "per-tensor scale (per-channel: B12xDualFp8ChannelKernel)")
        # A dynamic checkpoint leaves the activation granularity to the runtime; vLLM asks for
        # per-token scales there (its CUTLASS path's choice), our fp8_tensor uses one dynamic
        # per-tensor scale (amax/448 per call), as the checkpoint's "dynamic, tensor" declares.
        dynamic_token = not a.static and a.group_shape.is_per_token()
        if not (a.group_shape.is_per_tensor() or dynamic_token):
            return False, (f"activation scale group shape is {a.group_shape} (static={a.static}); b12x-dual "
                           "takes per-tensor (static or dynamic) or dynamic per-token (served per tensor)")
        return True, None


class B12xDualFp8ChannelKernel(_Fp8ScaledMM):
    """Per-channel FP8 weights (compressed-tensors strategy "channel", the FP8_DYNAMIC preset: vLLM's
    weight key ``GroupShape(-1, 1)``) with dynamic per-token or static per-tensor activation scales,
    through b12x-dual's fp8_channel backend."""

    VARIANT, QUANT_KEY = "fp8_channel", "fp8_w8a8"
    CONVERT = staticmethod(convert.fp8_channel)

    @classmethod
    def _scales_ok(cls, w, a):
        if not (w.static and w.group_shape.is_per_channel()):
            return False, (f"weight scale is {w.group_shape} (static={w.static}); this class takes one static "
                           "scale per output channel (GroupShape(row=-1, col=1))")
        if not ((not a.static and a.group_shape.is_per_token()) or (a.static and a.group_shape.is_per_tensor())):
            return False, (f"activation scale is {a.group_shape} (static={a.static}); fp8_channel takes dynamic "
                           "per-token or static per-tensor activation scales")
        return True, None


# ---------------------------------------------------------------------------------------------
# Block FP8 (1x128 activations, 128x128 weights)
# ---------------------------------------------------------------------------------------------
class B12xDualFp8BlockKernel(_Adapter, Fp8BlockScaledMMLinearKernel):
    """Block FP8 (``Fp8Config`` weight_block_size [128, 128], CT FP8_BLOCK) via fp8_block."""

    VARIANT, QUANT_KEY = "fp8_block", "fp8_block_w8a8"
    FREED = ("weight", "weight_scale", "weight_scale_inv")

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return cls._placement(compute_capability)

    @classmethod
    def can_implement(cls, config):
        a, w = config.activation_quant_key.scale, config.weight_quant_key.scale
        if a.static or a.group_shape != GroupShape(1, 128):
            return False, (f"activation scales are {a.group_shape} (static={a.static}); b12x-dual takes dynamic "
                           "1x128 groups")
        if w.group_shape != GroupShape(128, 128):
            return False, f"weight blocks are {w.group_shape}; b12x-dual takes 128x128"
        ok, why = _check_dtypes(config)
        if not ok:
            return ok, why
        n, k = config.weight_shape
        if k <= 0 or k % 128:
            return False, f"K (input features of this shard) is {k}; block FP8 needs a positive multiple of 128"
        ok, why = placement.shape_placement(cls.VARIANT, cls.QUANT_KEY, n, k, config.input_dtype)
        return ok, (None if ok else why)

    def process_weights_after_loading(self, layer):
        n, k = self.config.weight_shape
        qw, act = convert.fp8_block(layer, n, k)
        self._load(layer, qw, act)

    def apply_weights(self, layer, x, bias=None, **kwargs):
        return self._run(layer, x, bias)

    def apply_block_scaled_mm(self, A, B, As, Bs):  # the base class's hook; unused
        raise NotImplementedError("B12xDualFp8BlockKernel overrides apply_weights")


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------
class B12xDualMxfp8Kernel(_Adapter, Mxfp8LinearKernel):
    """MXFP8 (CT / ModelOpt) through b12x-dual's mxfp8 backend, or mxfp8_w8a16 where the checkpoint
    keeps the activations in bf16/fp16 (CT MXFP8A16; vLLM builds its W8A8 class for it, scheme.py)."""

    VARIANT, QUANT_KEY = "mxfp8", "mxfp8"
    SERVES = ("mxfp8", "mxfp8_w8a16")  # the same weight tensors; the activations differ

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return cls._placement(compute_capability)

    @classmethod
    def can_implement(cls, config):
        if config.bmm_batch_size is not None:
            return False, f"bmm_batch_size is {config.bmm_batch_size}; b12x-dual serves plain linear layers (None)"
        n, k = config.weight_shape
        if k <= 0 or k % 32:
            return False, f"K (input features of this shard) is {k}; MXFP8 needs a positive multiple of 32"
        ok, why = placement.shape_placement(cls.VARIANT, cls.QUANT_KEY, n, k, torch.get_default_dtype())
        return ok, (None if ok else why)

    def process_weights_after_loading(self, layer):
        n, k = self.config.weight_shape
        qw, act = convert.mxfp8(layer, n, k)
        self._load(layer, qw, act)

    def apply_weights(self, layer, x, bias=None):
        return self._run(layer, x, bias)


# ---------------------------------------------------------------------------------------------
# NVFP4 W4A4 and W4A16
# ---------------------------------------------------------------------------------------------
class B12xDualNvFp4Kernel(_Adapter, NvFp4LinearKernel):
    """NVFP4 W4A4 (CT / ModelOpt) through b12x-dual's nvfp4 backend; the activation global scale
    is the checkpoint's static ``input_global_scale_inv``."""

    VARIANT, QUANT_KEY = "nvfp4", "nvfp4_w4a4"
    A16 = False

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return cls._placement(compute_capability)

    @classmethod
    def can_implement(cls, config):
        # NvFp4LinearLayerConfig carries no shape: the shard's K is checked at load (convert.nvfp4).
        return True, None

    def process_weights_after_loading(self, layer):
        qw, act = convert.nvfp4(layer, a16=self.A16)
        self._load(layer, qw, act)

    def apply_weights(self, layer, x, bias=None):
        return self._run(layer, x, bias)


class B12xDualNvFp4W4A16Kernel(B12xDualNvFp4Kernel):
    """NVFP4 weights with bf16/fp16 activations (CT NVFP4A16, ModelOpt W4A16)."""

    VARIANT, QUANT_KEY = "nvfp4_w4a16", "nvfp4_w4a16"
    A16 = True


# ---------------------------------------------------------------------------------------------
# MXFP4 (W4A4 with dynamic MXFP4 activations, or W4A16)
# ---------------------------------------------------------------------------------------------
class B12xDualMxFp4Kernel(_Adapter, MxFp4LinearKernel):
    """MXFP4 (CT mxfp4-pack-quantized, Quark, online) through mxfp4 / mxfp4_w4a16."""

    VARIANT, QUANT_KEY = "mxfp4", "mxfp4"
    SERVES = ("mxfp4", "mxfp4_w4a16")  # the same weight tensors; the activations differ

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return cls._placement(compute_capability)

    @classmethod
    def can_implement(cls, config):
        key = config.activation_quant_key
        if key is not None and key != kMxfp4Dynamic:
            return False, f"activation quantization is {key}; b12x-dual takes dynamic MXFP4 ({kMxfp4Dynamic}) or none (W4A16)"
        if key is None:
            ok, why = placement.placement("mxfp4_w4a16", cls.QUANT_KEY)
            return ok, (None if ok else why)
        return True, None

    def _variant(self) -> str:
        return "mxfp4_w4a16" if self.config.activation_quant_key is None else "mxfp4"

    def process_weights_after_loading(self, layer):
        qw, act = convert.mxfp4(layer)
        self._load(layer, qw, act)

    def apply_weights(self, layer, x, bias=None):
        return self._run(layer, x, bias)


KERNELS = (B12xDualFp8TensorKernel, B12xDualFp8ChannelKernel, B12xDualFp8BlockKernel, B12xDualMxfp8Kernel,
           B12xDualNvFp4Kernel, B12xDualNvFp4W4A16Kernel, B12xDualMxFp4Kernel)
