"""Mixture-of-experts layers through the registry: the MoE table, its backends, choose, BoundMoE.

The same design as the dense linear layer (``dispatch.contract`` / ``registry`` / ``backends`` /
``bound``), in a small table of its own beside the dense one:

    p = MoEProblem("mxfp4", num_experts=32, top_k=4, hidden=2880, intermediate=2880, M=16,
                   activation="swigluoai")                 # what a decision is about
    b = get("triton", "mxfp4")                             # an MoEBackend with vLLM's four verbs
    b.is_supported(device) -> (ok, reason)                 # can this platform run it
    b.can_implement(problem, device) -> (ok, reason)       # variant, activation, shape, dtype
    prepared = b.prepare(w13, w2, activation="silu")       # stack / repack the experts once
    y = b.apply(x, prepared, topk_ids, topk_weights, ...)  # validates, then runs
    y = b.run(...)                                         # the trusted path (arguments validated)
    b.route(problem, device) -> Route                      # the kernels a call launches, and why

    c = choose(problem, device)        # walks registry.priority(device): cached per (device, variant,
                                       # M bucket, E, top_k, H, I, activation, dtype, bias, static
                                       # activation scales, request)
    layer = BoundMoE(w13, w2, activation="swigluoai")      # one layer's experts bound to the table
    y = layer(x, topk_ids, topk_weights)                   # [M, H], x's dtype
    y = fused_moe(x, w13, w2, topk_ids, topk_weights)      # the same, unbound (prepares per call)
    print(explain_moe("mxfp4", 16, 32, 4, 2880, 2880))     # which backend auto picks here, and why

The implementations are the dense table's names (``contract.IMPLS``), so ``B12X_IMPL``,
``use_impl()`` and ``impl=`` mean the same here (``dispatch.policy``), and auto walks the same
priority list (``registry.PRIORITY``): on SM120/SM121 cute (``kernels_cute.moe``, b12x's fused MoE)
where it serves the call, else the Triton lesson; on sm_90 hopper (``kernels_triton.hopper.moe``,
nvfp4 / mxfp4 W4A4 and W4A16; its gate ``HOPPER_MOE_GPU_RAN`` is on since it ran on the H200), a
named gap for the other variants, which the Triton lesson serves; on other GPUs and the CPU (Triton's interpreter) the
lesson; the float64 oracle ``formats.reference_moe`` everywhere. A cell with no kernel is an
:class:`~dispatch.contract.UnsupportedEntry` saying why. Neither this module nor building the table
imports b12x: ``kernels_cute.moe`` is imported on the first verb that needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from formats import QuantizedTensor, reference_moe, spec
from formats.moe import MOE_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT
from formats.validate import check_weight

from . import check as _check
from . import moe_check
from . import policy, registry
from .contract import (ACT_DTYPES, DECODE_M, DECODE_MAX_M, IMPLS, M_BUCKETS, PREFILL_M, ImplementationUnavailable,
                       NoBackend, Unsupported, UnsupportedEntry, m_bucket, variant)
from .describe import describe_device, library_versions, route_text
from .devices import DeviceInfo, device_of, resolve

from kernels_triton import Route

log = logging.getLogger(__name__)

INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


# ---------------------------------------------------------------------------------------------
# The problem
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEProblem:
    """One MoE layer call: x [M, hidden] routed to ``top_k`` of ``num_experts`` experts, each
    W13 [2 intermediate, hidden] and W2 [hidden, intermediate] in ``variant`` (a name of
    dispatch.registry.VARIANTS: a format, or its weight-only form), with ``activation`` (one of
    formats.MOE_ACTIVATIONS); ``dtype`` is x's (and y's) dtype; ``has_bias``: the experts carry
    biases (gpt-oss's do; b12x's fused MoE takes none); ``static_scales``: both GEMMs' activations
    have a static per-tensor value (fp8_tensor ``scale``, nvfp4 ``global_scale`` in the act options;
    b12x's fused MoE quantizes nvfp4 activations with static per-expert global scales only)."""

    variant: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    M: int
    activation: str = "silu"
    dtype: torch.dtype = torch.bfloat16
    has_bias: bool = False
    static_scales: bool = False

    @property
    def fmt(self) -> str:
        return variant(self.variant).fmt

    @property
    def a16(self) -> bool:
        return variant(self.variant).a16


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _problem_ok(problem: MoEProblem, allowed) -> tuple[bool, str]:
    """The checks every backend makes of a problem: sizes, activation, dtype, the format's K multiple
    (hidden is W13's K, intermediate W2's)."""
    p = problem
    if p.M < 0 or min(p.num_experts, p.top_k, p.hidden, p.intermediate) <= 0:
        return False, (f"M must be >= 0 and num_experts, top_k, hidden, intermediate > 0, got M={p.M} "
                       f"E={p.num_experts} top_k={p.top_k} H={p.hidden} I={p.intermediate}")
    if p.top_k > p.num_experts:
        return False, f"top_k={p.top_k} exceeds the expert count {p.num_experts}"
    if p.activation not in MOE_ACTIVATIONS:
        return False, f"activation must be one of {MOE_ACTIVATIONS}, got {p.activation!r}"
    if p.dtype not in allowed:
        return False, (f"activation dtype must be one of {', '.join(_dtype_name(d) for d in allowed)}, "
                       f"got {_dtype_name(p.dtype)}")
    mult = spec(p.fmt).k_multiple
    if p.hidden % mult or p.intermediate % mult:
        return False, (f"{p.fmt} needs hidden and intermediate (the two GEMMs' K) to be multiples of {mult}, "
                       f"got H={p.hidden} I={p.intermediate}")
    return True, ""


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
class MoEBackend:
    """Base class of an MoE backend: one implementation serving one variant, with vLLM's four verbs.

    ``prepare(w13, w2, *, activation)`` returns what ``run`` consumes (reference: the expert lists;
    triton: kernels_triton.moe.MoEWeights, stacked once; cute: kernels_cute.moe's prepared experts).
    ``apply`` validates its arguments (:func:`validate_call`), then runs; ``run`` is the trusted path
    of a caller that validated them at its door (:class:`BoundMoE`).
    """

    impl: str = ""

    def __init__(self, variant_name: str):
        self.variant = variant_name
        v = variant(variant_name)
        self.fmt, self.a16 = v.fmt, v.a16

    @property
    def name(self) -> str:
        return f"{self.impl}:{self.variant}"

    @property
    def act_dtypes(self) -> tuple[torch.dtype, ...]:
        return ACT_DTYPES[self.impl]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        raise NotImplementedError

    def can_implement(self, problem: MoEProblem, device: Optional[DeviceInfo] = None) -> tuple[bool, str]:
        """(ok, reason) for ``problem``: pure. ``device`` (optional) is where it would run, for a
        backend whose kernels' support depends on the capability (cute)."""
        raise NotImplementedError

    def prepare(self, w13: Sequence[QuantizedTensor], w2: Sequence[QuantizedTensor], *, activation: str = "silu"):
        raise NotImplementedError

    def run(self, x, prepared, topk_ids, topk_weights, *, activation="silu", renormalize=False, w13_bias=None,
            w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA,
            swiglu_limit=SWIGLU_LIMIT) -> torch.Tensor:
        """y [M, H] of x's dtype on arguments the caller validated (:func:`validate_call`)."""
        raise NotImplementedError

    def apply(self, x, prepared, topk_ids, topk_weights, **kw) -> torch.Tensor:
        """y [M, H]: :func:`validate_call` (x, topk_ids, topk_weights against the prepared experts'
        E and H), then :meth:`run`. Raises ValueError naming a bad argument."""
        E, H = self.experts_of(prepared)
        validate_call(x, topk_ids, topk_weights, E, H, self.act_dtypes)
        return self.run(x, prepared, topk_ids, topk_weights, **kw)

    def experts_of(self, prepared) -> tuple[int, int]:
        """(E, H) of what prepare returned."""
        raise NotImplementedError

    def route(self, problem: MoEProblem, device: DeviceInfo) -> Route:
        """The kernels a call of ``problem`` launches on ``device`` (by name, in order), the tile and why."""
        raise NotImplementedError

    def stages(self, x, prepared, topk_ids, topk_weights, **kw):
        """Each step's result of a call (kernels_triton.moe.Stages: W13's quantized input, W13's output,
        the activation, W2's quantized input, W2's weighted output, y), for a debugger
        (dispatch.moe_check); None where the implementation exposes no intermediate values (its
        kernels keep them on chip). Arguments as :meth:`run`'s, trusted."""
        return None

    def prepared_experts(self, prepared, w13, w2) -> Optional[tuple[list, list]]:
        """(w13, w2) as ``prepare`` left them, as per-expert QuantizedTensors of the layout of the given
        ``w13`` / ``w2`` (to compare them byte for byte), or None where prepare repacks them."""
        return None


class ReferenceMoE(MoEBackend):
    """formats.reference_moe: every expert's two GEMMs from the dequantized operands in float64."""

    impl = "reference"

    def is_supported(self, device):
        return True, "the formats/ oracle runs on every device"

    def can_implement(self, problem, device=None):
        ok, why = _problem_ok(problem, self.act_dtypes)
        return (True, "float64 oracle (formats.reference_moe)") if ok else (False, f"reference: {why}")

    def prepare(self, w13, w2, *, activation="silu"):
        check_experts(w13, w2, self.variant)
        return (list(w13), list(w2))

    def experts_of(self, prepared):
        return len(prepared[0]), prepared[1][0].shape[0]

    def run(self, x, prepared, topk_ids, topk_weights, *, activation="silu", renormalize=False, w13_bias=None,
            w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT):
        w13, w2 = prepared
        return reference_moe(x, w13, w2, topk_ids, topk_weights, activation=activation, renormalize=renormalize,
                             w13_bias=w13_bias, w2_bias=w2_bias, a16=self.a16, w13_act_opts=w13_act_opts,
                             w2_act_opts=w2_act_opts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

    def prepared_experts(self, prepared, w13, w2):
        return prepared[0], prepared[1]

    def route(self, problem, device):
        return Route("reference", (), "", 1, "formats.reference_moe: a loop over experts, dequantize both operands, "
                     "float64 GEMMs, one rounding (torch on the host or device, no kernel of ours)")


def _capability(device: DeviceInfo):
    """A kernel module's capability argument: None for the CPU (the interpreter), else (major, minor)."""
    return None if device is None or device.kind == "cpu" else tuple(device.capability)


class TritonMoE(MoEBackend):
    """kernels_triton.moe, the readable lesson: any CUDA GPU, and CPU tensors through the interpreter."""

    impl = "triton"

    @staticmethod
    def _module():
        from kernels_triton import moe

        return moe

    def is_supported(self, device):
        # the dense backend's rule: a GPU, or the CPU with Triton's interpreter on
        from .backends import TritonBackend

        ok, why = TritonBackend.is_supported(self, device)
        return ok, why

    def can_implement(self, problem, device=None):
        ok, why = _problem_ok(problem, self.act_dtypes)
        if not ok:
            return False, f"triton: {why}"
        return True, f"kernels_triton.moe (the lesson){' weight-only' if self.a16 else ''}"

    def prepare(self, w13, w2, *, activation="silu"):
        check_experts(w13, w2, self.variant)
        return self._module().prepare_experts(w13, w2)

    def experts_of(self, prepared):
        return prepared.num_experts, prepared.hidden

    def validate_device(self, x) -> None:
        """ImplementationUnavailable where x lives where these kernels cannot run (the dense rule)."""
        from .backends import TritonBackend

        TritonBackend.validate_device(self, x)

    def run(self, x, prepared, topk_ids, topk_weights, *, activation="silu", renormalize=False, w13_bias=None,
            w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT):
        self.validate_device(x)
        return self._module().fused_moe_unchecked(
            x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize, w13_bias=w13_bias,
            w2_bias=w2_bias, a16=self.a16, w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

    def route(self, problem, device):
        p = problem
        return self._module().route(p.M, p.num_experts, p.top_k, p.hidden, p.intermediate, fmt=p.fmt, a16=p.a16,
                                    capability=_capability(device), sm_count=max(int(device.sm_count), 1))

    def stages(self, x, prepared, topk_ids, topk_weights, *, activation="silu", renormalize=False, w13_bias=None,
               w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA,
               swiglu_limit=SWIGLU_LIMIT):
        """kernels_triton.moe.fused_moe_stages: the lesson's steps of this call, one row per slot."""
        self.validate_device(x)
        return self._module().fused_moe_stages(
            x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize, w13_bias=w13_bias,
            w2_bias=w2_bias, a16=self.a16, w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

    def prepared_experts(self, prepared, w13, w2):
        """The lesson's stacks (MoEWeights) split per expert, in the dtypes of ``w13`` / ``w2``."""
        from dataclasses import replace

        out = []
        for (data, block, per_expert), ws in ((prepared.w13, w13), (prepared.w2, w2)):
            qs = []
            for e, q in enumerate(ws):
                scale = q.scale if block is None else block[e].view(q.scale.dtype).reshape(q.scale.shape)
                if q.block_shape is None and per_expert is not None:  # fp8_tensor: the per-tensor scale
                    scale = per_expert[e].reshape(q.scale.shape).to(q.scale.dtype)
                gs = None if q.global_scale is None else per_expert[e].reshape(q.global_scale.shape)
                qs.append(replace(q, data=data[e].view(q.data.dtype).reshape(q.data.shape), scale=scale,
                                  global_scale=gs))
            out.append(qs)
        return out[0], out[1]


STATIC_SCALE_OPTION = {"fp8_tensor": "scale", "nvfp4": "global_scale"}
"""The activation option that holds a format's static per-tensor value (MoEProblem.static_scales)."""
CUTE_MODULE = "kernels_cute.moe"
CUTE_NO_FP8 = "b12x 1.5.1 has no FP8 MoE; triton serves"
CUTE_NO_BIAS = "b12x 1.5.1's fused MoE takes no expert biases (gpt-oss's experts have them); triton serves"
CUTE_BF16_ONLY = "the MoE table prepares kernels_cute.moe's experts for bfloat16 I/O; triton serves other dtypes"
CUTE_STATIC_NVFP4 = ("b12x's fused MoE quantizes nvfp4 activations with static per-expert global scales only; this "
                     "layer's are dynamic (no 'global_scale' in w13_act_opts and w2_act_opts): triton serves")
HOPPER_MOE_GPU_RAN = True
"""The gate of the sm_90 MoE (kernels_triton.hopper.moe): new sm_90 routes stay off until a GPU ran
them. True since tests/kernels_triton/hopper/test_hopper_moe.py and tools/probes/hopper_moe_gpu.py
passed on the H200 (docs/results.md, 2026-12-05, third session). False: make("hopper", v) is a named
gap for every variant (HOPPER_UNRUN for the served ones)."""
HOPPER_UNVERIFIED_ENV = "B12X_HOPPER_MOE_UNVERIFIED"
"""Set to 1 to turn the gate on in this process while HOPPER_MOE_GPU_RAN is False (for the GPU probe
tools/probes/hopper_moe_gpu.py and the bench on the H200, nothing else); read when the table is built."""
HOPPER_MOE_VARIANTS = ("nvfp4", "nvfp4_w4a16", "mxfp4", "mxfp4_w4a16")
"""The variants kernels_triton.hopper.moe serves (its VARIANTS; the table's without importing it)."""
HOPPER_UNRUN = (f"kernels_triton.hopper.moe is written, not yet run on a GPU (dispatch.moe.HOPPER_MOE_GPU_RAN is "
                f"False; {HOPPER_UNVERIFIED_ENV}=1 forces it on): the triton lesson serves sm_90")
HOPPER_GAP = (f"no sm_90 MoE kernels for this variant (kernels_triton.hopper.moe serves "
              f"{', '.join(HOPPER_MOE_VARIANTS)}): the triton lesson serves sm_90")


def hopper_moe_on() -> bool:
    """Whether make("hopper", v) serves kernels_triton.hopper.moe's variants: HOPPER_MOE_GPU_RAN, or
    B12X_HOPPER_MOE_UNVERIFIED=1. ValueError naming the variable for a value other than 0 / 1 / unset."""
    import os

    value = os.environ.get(HOPPER_UNVERIFIED_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{HOPPER_UNVERIFIED_ENV}={value!r} is not allowed; allowed: 1 (serve the unverified sm_90 "
                         "MoE kernels), 0 or unset")
    return HOPPER_MOE_GPU_RAN or value == "1"


def hopper_gap(variant_name: str) -> str:
    """The reason of the hopper MoE cell of ``variant_name`` while it is a gap."""
    return HOPPER_UNRUN if variant_name in HOPPER_MOE_VARIANTS else HOPPER_GAP


@functools.lru_cache(maxsize=1)
def cute_moe_present() -> bool:
    """Whether kernels_cute.moe is in this installation (found, not imported: it may pull in b12x)."""
    return importlib.util.find_spec(CUTE_MODULE) is not None


class CuteMoE(MoEBackend):
    """kernels_cute.moe: b12x's fused MoE on SM120/SM121, through exactly ``supports``,
    ``prepare_experts``, ``fused_moe`` and ``route`` of that module (imported on first use)."""

    impl = "cute"

    @staticmethod
    def _module():
        return importlib.import_module(CUTE_MODULE)

    def is_supported(self, device):
        """SM120/SM121 with b12x and CuTe DSL importable (the dense cute rule, without its per-variant
        GEMM gate: ``supports`` of kernels_cute.moe, in can_implement, is the MoE one)."""
        from . import backends

        if device.kind == "cpu":
            return False, "cute needs an SM120/SM121 GPU; this call runs on the CPU"
        if not device.is_sm12x:
            return False, f"cute needs an SM120/SM121 GPU; {device.name} is {device.arch}"
        probe = backends.b12x_probe()
        if probe.module is None:
            return False, f"b12x is not installed ({probe.error}); install it with: {backends.INSTALL_CUTE}"
        from kernels_cute import _common

        err = _common.b12x_import_error()
        if err:
            return False, err
        try:
            self._module()
        except Exception as e:  # noqa: BLE001  (a module that cannot load serves nothing: say why)
            return False, f"{CUTE_MODULE} does not import: {type(e).__name__}: {e}"
        return True, f"b12x {probe.version} on {device.arch}"

    def can_implement(self, problem, device=None):
        ok, why = _problem_ok(problem, self.act_dtypes)
        if not ok:
            return False, f"cute: {why}"
        if problem.has_bias:
            return False, f"cute: {CUTE_NO_BIAS}"
        if problem.dtype != torch.bfloat16:  # prepare_experts plans b12x's I/O for one dtype: bf16 here
            return False, f"cute: {CUTE_BF16_ONLY}, got {_dtype_name(problem.dtype)}"
        if problem.fmt == "nvfp4" and not problem.a16 and not problem.static_scales:
            return False, f"cute: {CUTE_STATIC_NVFP4}"
        mod = self._module()
        ok, why = mod.supports(self.variant, problem.activation, _capability(device))
        if not ok:
            return False, f"cute: {why}"
        try:
            r = self.route(problem, device)
        except ValueError as e:
            return False, f"cute: {e}"
        return True, why or (r.why if r is not None else f"{CUTE_MODULE}")

    def prepare(self, w13, w2, *, activation="silu"):
        check_experts(w13, w2, self.variant)
        return self._module().prepare_experts(w13, w2, variant=self.variant, activation=activation)

    def experts_of(self, prepared):
        for a, b in (("num_experts", "hidden"), ("E", "H")):
            if hasattr(prepared, a) and hasattr(prepared, b):
                return int(getattr(prepared, a)), int(getattr(prepared, b))
        raise ValueError(f"{CUTE_MODULE}'s prepared experts name neither num_experts/hidden nor E/H")

    def run(self, x, prepared, topk_ids, topk_weights, *, activation="silu", renormalize=False, w13_bias=None,
            w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT):
        return self._module().fused_moe(x, prepared, topk_ids, topk_weights, renormalize=renormalize,
                                        w13_bias=w13_bias, w2_bias=w2_bias, w13_act_opts=w13_act_opts,
                                        w2_act_opts=w2_act_opts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

    def route(self, problem, device):
        p = problem
        return self._module().route(p.M, p.num_experts, p.top_k, p.hidden, p.intermediate, variant=self.variant,
                                    capability=_capability(device))


class HopperMoE(TritonMoE):
    """kernels_triton.hopper.moe: the sm_90 MoE (decode and prefill routes) for nvfp4 / mxfp4, W4A4
    and W4A16, on the lesson's prepared experts (kernels_triton.moe.prepare_experts): the lesson
    backend's experts, prepared_experts and run, with its own module, device rule and route."""

    impl = "hopper"

    @staticmethod
    def _module():
        from kernels_triton.hopper import moe

        return moe

    def is_supported(self, device):
        if device.kind == "cpu":
            return False, "hopper needs an sm_90 GPU; this call runs on the CPU"
        if not device.is_sm90:
            return False, f"hopper needs an sm_90 GPU; {device.name} is {device.arch}"
        from kernels_triton import hopper

        return hopper.supported(tuple(device.capability))

    def can_implement(self, problem, device=None):
        ok, why = _problem_ok(problem, self.act_dtypes)
        if not ok:
            return False, f"hopper: {why}"
        r = self._module().route(problem.M, problem.num_experts, problem.top_k, problem.hidden, problem.intermediate,
                                 fmt=problem.fmt, a16=problem.a16, capability=(9, 0), x_dtype=problem.dtype)
        kind = "decode" if "_decode_gemm_kernel" in r.kernels else "prefill"
        return True, f"kernels_triton.hopper.moe{' weight-only' if self.a16 else ''} ({kind} route)"

    def prepare(self, w13, w2, *, activation="silu"):
        check_experts(w13, w2, self.variant)
        return TritonMoE._module().prepare_experts(w13, w2)

    # its kernels keep the steps on chip: no intermediate values for a debugger (not the lesson's stages)
    stages = MoEBackend.stages

    def validate_device(self, x) -> None:
        """ImplementationUnavailable unless x is on an sm_90 GPU with the interpreter off."""
        from kernels_triton._common import device_capability

        dev = device_of(x)
        if device_capability(x.device) is None or not dev.is_sm90:
            raise ImplementationUnavailable(self.impl, dev, f"MoE {self.variant}: kernels_triton.hopper.moe runs on "
                                            f"an sm_90 GPU with TRITON_INTERPRET off, got x on {x.device}")

    def route(self, problem, device):
        p = problem
        return self._module().route(p.M, p.num_experts, p.top_k, p.hidden, p.intermediate, fmt=p.fmt, a16=p.a16,
                                    capability=_capability(device), sm_count=max(int(device.sm_count), 1),
                                    x_dtype=p.dtype)


_CLASSES = {"reference": ReferenceMoE, "triton": TritonMoE, "cute": CuteMoE, "hopper": HopperMoE}


def make(impl: str, variant_name: str):
    """The MoE table cell of (impl, variant): an MoEBackend, or an UnsupportedEntry saying why."""
    # [moe-make]
    v = variant(variant_name)
    if impl == "hopper" and (variant_name not in HOPPER_MOE_VARIANTS or not hopper_moe_on()):
        return UnsupportedEntry(impl, variant_name, hopper_gap(variant_name))
    if impl == "triton":
        from kernels_triton import moe

        if v.fmt not in moe.FORMATS or (v.a16 and v.fmt not in moe.A16_FORMATS):
            return UnsupportedEntry(impl, variant_name, f"kernels_triton.moe serves {moe.FORMATS} (weight-only: "
                                    f"{moe.A16_FORMATS}), not {variant_name}")
    if impl == "cute":
        if spec(v.fmt).element == "e4m3":  # fp8_tensor, fp8_block, fp8_channel, mxfp8 (and its W8A16)
            return UnsupportedEntry(impl, variant_name, CUTE_NO_FP8)
        if not cute_moe_present():
            return UnsupportedEntry(impl, variant_name, f"{CUTE_MODULE} is not in this installation")
    return _CLASSES[impl](variant_name)
    # [/moe-make]


# ---------------------------------------------------------------------------------------------
# The table and choose
# ---------------------------------------------------------------------------------------------
_TABLE: dict[tuple[str, str], object] = {}


def entries() -> dict[tuple[str, str], object]:
    """The MoE table: {(impl, variant): MoEBackend or UnsupportedEntry}, built on first use (it
    imports the Triton lesson, never b12x)."""
    if not _TABLE:
        for v in registry.VARIANTS:
            for impl in IMPLS:
                _TABLE[(impl, v)] = make(impl, v)
    return dict(_TABLE)


def get(impl: str, variant_name: str) -> MoEBackend:
    """The MoEBackend of (impl, variant). ValueError for an unknown name, Unsupported (with the
    reason) for a named gap."""
    variant(variant_name)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    entry = entries()[(impl, variant_name)]
    if isinstance(entry, UnsupportedEntry):
        raise Unsupported(f"MoE {entry.name} is not implemented: {entry.reason}")
    return entry


def verdict(entry, problem: MoEProblem, device: DeviceInfo) -> tuple[bool, str]:
    """is_supported then can_implement, as one (ok, reason); a named gap gives (False, its reason)."""
    if isinstance(entry, UnsupportedEntry):
        return False, f"{entry.impl} has no MoE kernel for {entry.variant}: {entry.reason}"
    ok, why = entry.is_supported(device)
    if not ok:
        return False, why
    ok2, why2 = entry.can_implement(problem, device)
    return ok2, (f"{why}; {why2}" if ok2 else why2)


@functools.lru_cache(maxsize=None)
def act_dtypes_of(variant_: str, requested: str) -> tuple[torch.dtype, ...]:
    """The activation dtypes an MoE call of ``variant_`` can take under a request ("auto": the union
    over the implementations with a backend for it; a forced one: its own)."""
    table = entries()
    names = IMPLS if requested == "auto" else (requested,)
    found = [d for n in names if isinstance(table[(n, variant_)], MoEBackend) for d in ACT_DTYPES[n]]
    if not found:  # a forced implementation with no backend: choose says why
        found = [d for (n, v), e in table.items() if v == variant_ and isinstance(e, MoEBackend)
                 for d in ACT_DTYPES[n]]
    return tuple(dict.fromkeys(found))


_cache: dict[tuple, registry.Choice] = {}
_logged: set[tuple] = set()


def clear_cache() -> None:
    """Forget cached MoE decisions (tests; a changed environment)."""
    _cache.clear()
    _logged.clear()


def choose(problem: MoEProblem, device: DeviceInfo, *, impl: Optional[str] = None,
           log_choice: bool = True) -> registry.Choice:
    """The MoE backend for ``problem`` on ``device``: ``impl=`` > use_impl() > B12X_IMPL > auto
    (dispatch.policy). Returns a registry.Choice (backend, reason, requested, source, considered),
    the same object for every call of one (device, variant, M bucket, E, top_k, H, I, activation,
    dtype, request). Raises ValueError (unknown variant), InvalidImplementation,
    ImplementationUnavailable (a forced implementation cannot serve it) and NoBackend."""
    return decide(policy.requested_impl(impl), problem, device, log_choice=log_choice)


def decide(request: policy.Request, problem: MoEProblem, device: DeviceInfo, *,
           log_choice: bool = True) -> registry.Choice:
    """:func:`choose` for a request already read (a bound call reads it once)."""
    requested, source = request
    p = problem
    key = (device, p.variant, m_bucket(p.M), p.num_experts, p.top_k, p.hidden, p.intermediate, p.activation,
           p.dtype, p.has_bias, p.static_scales, requested, source)
    c = _cache.get(key)
    if c is not None:
        return c
    variant(p.variant)
    table = entries()
    if requested != "auto":
        entry = table[(requested, p.variant)]
        ok, why = verdict(entry, p, device)
        if not ok:
            raise ImplementationUnavailable(requested, device, f"MoE {p.variant}: {why}")
        c = registry.Choice(entry, why, requested, source, ((requested, True, why),))
    else:
        # [moe-auto-walk]
        considered, skipped = [], []
        for name in registry.priority(device):
            ok, why = verdict(table[(name, p.variant)], p, device)
            considered.append((name, ok, why))
            if ok:
                c = registry.Choice(table[(name, p.variant)], "; ".join(skipped + [why]), requested, source,
                                    tuple(considered))
                break
            skipped.append(why)
        # [/moe-auto-walk]
        if c is None:
            lines = "; ".join(f"{n}: {w}" for n, _, w in considered)
            raise NoBackend(f"no backend serves MoE {p.variant} M={p.M} E={p.num_experts} top_k={p.top_k} "
                            f"H={p.hidden} I={p.intermediate} {p.activation} {_dtype_name(p.dtype)} on "
                            f"{device.describe()}: {lines}")
        if log_choice and (device, p.variant, c.impl) not in _logged:
            _logged.add((device, p.variant, c.impl))
            log.info("b12x-dual: MoE %s on %s: auto chose %s: %s", p.variant, device.describe(), c.impl, c.reason)
    _cache[key] = c
    return c


# ---------------------------------------------------------------------------------------------
# Argument checks (made once, at the door)
# ---------------------------------------------------------------------------------------------
def _desc(t) -> str:
    return f"{_dtype_name(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_experts(w13, w2, variant_name: Optional[str] = None) -> tuple[str, int, int, int]:
    """(variant, E, H, I) of per-expert weight lists W13 [2I, H] and W2 [H, I].

    Raises ValueError naming the argument: not a non-empty list of weight QuantizedTensors (vLLM's
    stacked tensors: formats.moe.experts_from_stacked), a malformed expert (formats.validate.check_weight),
    mixed formats or shapes; w13 and w2 of other formats; an expert count w13 and w2 disagree on;
    shapes that are not [2I, H] and [H, I]; a variant of another format than the weights' (or unknown).
    """
    for name, ws in (("w13", w13), ("w2", w2)):
        if isinstance(ws, (QuantizedTensor, torch.Tensor)) or not isinstance(ws, Sequence) or len(ws) == 0:
            raise ValueError(f"{name} must be a non-empty list of weight QuantizedTensors, one per expert, got "
                             f"{type(ws).__name__} (for vLLM's stacked [E, N, K] tensors use "
                             "formats.moe.experts_from_stacked)")
        for e, q in enumerate(ws):
            check_weight(q, name=f"{name}[{e}]")
            if (q.fmt, q.shape) != (ws[0].fmt, ws[0].shape):
                raise ValueError(f"every expert of {name} must have {name}[0]'s format and shape ({ws[0].fmt}, "
                                 f"{tuple(ws[0].shape)}), got {name}[{e}]: {q.fmt}, {tuple(q.shape)}")
    if w13[0].fmt != w2[0].fmt:
        raise ValueError(f"w13 and w2 must have one format, got {w13[0].fmt} and {w2[0].fmt}")
    if len(w13) != len(w2):
        raise ValueError(f"w13 and w2 must have the same expert count, got {len(w13)} and {len(w2)}")
    (n13, h), (h2, i) = w13[0].shape, w2[0].shape
    if n13 != 2 * i or h2 != h:
        raise ValueError(f"w13's experts must be [2I, H] and w2's [H, I], got w13 {list(w13[0].shape)} and w2 "
                         f"{list(w2[0].shape)} (need w13 rows = 2 x w2 columns, w13 columns = w2 rows)")
    name = variant_name or w13[0].fmt
    v = variant(name, "variant")
    if v.fmt != w13[0].fmt:
        raise ValueError(f"variant {name!r} needs {v.fmt} experts, got {w13[0].fmt} ones")
    return v.name, len(w13), h, i


def _check_bias(b, name: str, E: int, n: int, what: str) -> None:
    if b is None:
        return
    if not isinstance(b, torch.Tensor) or not b.is_floating_point() or b.dim() != 2:
        raise ValueError(f"{name} must be a float tensor [E={E}, {n}] ({what}), got {_desc(b)}")
    if b.shape[0] != E:
        raise ValueError(f"{name} has {b.shape[0]} expert rows but w13/w2 have {E} experts (expert count mismatch)")
    if b.shape[1] != n:
        raise ValueError(f"{name} must be [E={E}, {n}] ({what}), got {_desc(b)}")


def _check_act_opts(opts, name: str, E: int, a16: bool, variant_name: str) -> dict:
    if opts is None:
        return {}
    if not isinstance(opts, Mapping):
        raise ValueError(f"{name} must be a dict of activation options, got {type(opts).__name__}")
    if opts and a16:
        raise ValueError(f"{name} must be empty for the weight-only variant {variant_name} (no activation is "
                         f"quantized), got {sorted(opts)}")
    for key, v in opts.items():
        if isinstance(v, torch.Tensor) and v.numel() > 1 and v.numel() != E:
            raise ValueError(f"{name}[{key!r}] must hold one value or one per expert ({E}), got shape "
                             f"{tuple(v.shape)} (expert count mismatch)")
    return dict(opts)


def validate_call(x, topk_ids, topk_weights, E: int, H: int, allowed) -> tuple[int, int]:
    """(M, top_k) of a call, after the door's checks: x a 2-D [M, H] float tensor of a dtype in
    ``allowed``, not on the meta device; topk_ids an integer [M, top_k] tensor on x's device with
    every id in [0, E) (read back: one device synchronization); topk_weights a float [M, top_k]
    tensor on x's device. Raises ValueError naming the argument, the value and what is allowed."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [M, H={H}] float tensor, got {_desc(x)}")
    if x.dtype not in allowed:
        raise ValueError(f"x must be one of ({', '.join(_dtype_name(d) for d in allowed)}) here, got "
                         f"{_dtype_name(x.dtype)}")
    if x.shape[1] != H:
        raise ValueError(f"x must be [M, H={H}] (the experts' hidden size), got {tuple(x.shape)}")
    if x.is_meta:
        raise ValueError("x is on the meta device: it holds no values to compute with")
    M = x.shape[0]
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in INTEGER_DTYPES or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != M or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be an integer tensor [M={M}, top_k >= 1], got {_desc(topk_ids)}")
    top_k = topk_ids.shape[1]
    if top_k > E:
        raise ValueError(f"topk_ids has top_k={top_k} columns but there are only {E} experts")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() \
            or topk_weights.dim() != 2 or topk_weights.shape[0] != M:
        raise ValueError(f"topk_weights must be a float tensor [M={M}, top_k], got {_desc(topk_weights)}")
    if topk_weights.shape[1] != top_k:
        raise ValueError(f"top-k mismatch: topk_ids has top_k={top_k} but topk_weights has "
                         f"{topk_weights.shape[1]} columns (both must be [M, top_k])")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            bad = lo if lo < 0 else hi
            note = " (-1, expert parallelism's 'not on this rank', has no meaning for a whole layer)" if bad == -1 \
                else ""
            raise ValueError(f"topk_ids must lie in [0, {E}) (the expert count), got {bad}{note}")
    return M, top_k


# ---------------------------------------------------------------------------------------------
# BoundMoE
# ---------------------------------------------------------------------------------------------
class BoundMoE:
    """One MoE layer's experts bound to the registry: choose per M bucket (contract.m_bucket),
    prepared experts per backend (prepared once), apply.

    Args:
        w13, w2: lists of E weight formats.QuantizedTensors (formats.moe's representation):
            W13 [2I, H] (gate and up rows as ``activation`` reads them), W2 [H, I], one format.
        variant: None (the weights' format: W4A4 / W8A8) or a weight-only name ("nvfp4_w4a16",
            "mxfp4_w4a16", "mxfp8_w8a16") of that format.
        activation: one of formats.MOE_ACTIVATIONS ("silu", "swigluoai", "swigluoai_uninterleave").
        w13_bias [E, 2I], w2_bias [E, H]: optional float biases, per expert.
        w13_act_opts, w2_act_opts: the activation options of the two GEMMs' inputs (formats.quantize's:
            fp8_tensor ``scale``, nvfp4 ``global_scale`` (a number or [E] tensor), fp8_block ``ue8m0``,
            MX ``scale_rule``); must be empty for a weight-only variant.
        swiglu_alpha, swiglu_limit: the swigluoai activations' constants (gpt-oss's by default).
        name: the layer's name (in messages and reports).
        device: a DeviceInfo to decide on (a described device); None: x's device per call (for
            ``choice`` / ``prepare_buckets`` without a call: the experts' device).
    Attributes: ``backends`` {backend name ("triton:mxfp4"): what its prepare returned}, the one
    cache of prepared experts; ``sealed``; ``last_impl``; ``variant``, ``num_experts``, ``hidden``,
    ``intermediate``.
    Raises ValueError naming the argument (check_experts; biases not [E, 2I] / [E, H]; act options
    with neither one nor E values, or any for a weight-only variant; an unknown activation).
    """

    def __init__(self, w13, w2, *, variant=None, activation="silu", w13_bias=None, w2_bias=None,
                 w13_act_opts=None, w2_act_opts=None, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                 name="moe", device=None):
        self.variant, self.num_experts, self.hidden, self.intermediate = check_experts(w13, w2, variant)
        self.a16 = registry.variant(self.variant).a16
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
        E, H, I = self.num_experts, self.hidden, self.intermediate
        _check_bias(w13_bias, "w13_bias", E, 2 * I, "W13's rows")
        _check_bias(w2_bias, "w2_bias", E, H, "W2's rows")
        self.w13_act_opts = _check_act_opts(w13_act_opts, "w13_act_opts", E, self.a16, self.variant)
        self.w2_act_opts = _check_act_opts(w2_act_opts, "w2_act_opts", E, self.a16, self.variant)
        if device is not None and not isinstance(device, DeviceInfo):
            raise ValueError(f"device must be None or a dispatch.DeviceInfo, got {type(device).__name__}")
        self.w13, self.w2 = list(w13), list(w2)
        key = STATIC_SCALE_OPTION.get(registry.variant(self.variant).fmt)
        self.static_scales = key is not None and not self.a16 and all(
            o.get(key) is not None for o in (self.w13_act_opts, self.w2_act_opts))
        self.activation = activation
        self.w13_bias, self.w2_bias = w13_bias, w2_bias
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.name, self.device = name, device
        self.backends: dict[str, object] = {}
        self._backend_of: dict[str, MoEBackend] = {}
        self.sealed = False
        self.last_impl: Optional[str] = None

    def __repr__(self) -> str:
        return (f"<BoundMoE {self.name} {self.variant} E={self.num_experts} H={self.hidden} I={self.intermediate} "
                f"{self.activation}, prepared for {sorted(self.backends)}>")

    def _home(self) -> DeviceInfo:
        """Where decisions are made without a call: the bound device, else the experts' device."""
        if self.device is not None:
            return self.device
        return device_of(self.w13[0].data)

    def problem(self, M: int, top_k: int, dtype: torch.dtype = torch.bfloat16) -> MoEProblem:
        """This layer's MoEProblem for an M-token call with ``top_k`` experts per token."""
        return MoEProblem(self.variant, self.num_experts, top_k, self.hidden, self.intermediate, M,
                          self.activation, dtype, self.w13_bias is not None or self.w2_bias is not None,
                          self.static_scales)

    def choice(self, M: int, top_k: int, *, request: Optional[policy.Request] = None,
               device: Optional[DeviceInfo] = None, dtype: Optional[torch.dtype] = None) -> registry.Choice:
        """The registry's Choice (backend + why) for an M-token call with ``top_k`` (no call made),
        cached per M bucket: under ``request`` (default: read now), on the bound device (else
        ``device``, else the experts'), x of ``dtype`` (default bfloat16). Raises what choose raises."""
        request = policy.requested_impl() if request is None else request
        dev = self.device or device or self._home()
        return decide(request, self.problem(M, top_k, dtype or torch.bfloat16), dev)

    def _entry(self, c: registry.Choice, M: int):
        prepared = self.backends.get(c.backend.name)
        if prepared is not None:
            return prepared
        if self.sealed:
            raise RuntimeError(
                f"b12x-dual: MoE layer {self.name} ({self.variant}, E={self.num_experts}, H={self.hidden}, "
                f"I={self.intermediate}) was prepared for {sorted(self.backends)}, but a {M}-token call now chooses "
                f"{c.backend.name} ({_request_text(c)}); B12X_IMPL / use_impl() must not change after the "
                "model is loaded")
        return self._prepare(c.backend)

    def _prepare(self, backend: MoEBackend):
        prepared = backend.prepare(self.w13, self.w2, activation=self.activation)
        self.backends[backend.name] = prepared
        self._backend_of[backend.name] = backend
        return prepared

    def __call__(self, x, topk_ids, topk_weights, *, renormalize=False, watch=True) -> torch.Tensor:
        """y [M, H] of x's dtype: x [M, H] (bf16/fp16; the reference also float32), topk_ids integer
        [M, top_k] in [0, E), topk_weights float [M, top_k], all on the experts' device; ``renormalize``
        divides each token's weights by their sum first. Validated once here (:func:`validate_call`),
        then the chosen backend's trusted ``run``; with B12X_CHECK on, sampled calls are checked
        (dispatch.moe_check.after_moe_call; ``watch=False`` keeps a call out: warmup's inputs).
        Raises ValueError naming a bad argument,
        InvalidImplementation / ImplementationUnavailable / NoBackend from the decision, and
        RuntimeError for a sealed layer whose choice changed."""
        return self._call(x, topk_ids, topk_weights, renormalize, policy.requested_impl(), watch)

    def _call(self, x, topk_ids, topk_weights, renormalize: bool, request: policy.Request,
              watch: bool = True) -> torch.Tensor:
        allowed = act_dtypes_of(self.variant, request.impl)
        M, top_k = validate_call(x, topk_ids, topk_weights, self.num_experts, self.hidden, allowed)
        if x.device != self.w13[0].data.device:
            raise ValueError(f"x must be on the experts' device {self.w13[0].data.device}, got {x.device}")
        dev = self.device or device_of(x)
        c = decide(request, self.problem(M, top_k, x.dtype), dev)
        prepared = self._entry(c, M)
        y = c.backend.run(x, prepared, topk_ids, topk_weights, activation=self.activation, renormalize=renormalize,
                          w13_bias=self.w13_bias, w2_bias=self.w2_bias, w13_act_opts=self.w13_act_opts or None,
                          w2_act_opts=self.w2_act_opts or None, swiglu_alpha=self.swiglu_alpha,
                          swiglu_limit=self.swiglu_limit)
        self.last_impl = c.impl
        if _check.WATCHDOG is not None and watch:  # B12X_CHECK on; off: this test is all
            moe_check.after_moe_call(_check.WATCHDOG, self.name, c.backend, self, x, topk_ids, topk_weights,
                                     renormalize, y)
        return y

    def prepare_buckets(self, top_k: int, dtype: Optional[torch.dtype] = None) -> None:
        """Prepare now (load time), on the bound device (else the experts') and under the request as it
        reads now, the backend chosen for every M bucket (contract.M_BUCKETS) at this ``top_k``, so a
        sealed layer finds its prepared experts at any call. Raises RuntimeError naming the layer
        when nothing serves a bucket (the registry's reason inside)."""
        request = policy.requested_impl()
        for m in M_BUCKETS:
            try:
                c = self.choice(m, top_k, request=request, dtype=dtype)
            except ValueError as e:
                raise RuntimeError(f"b12x-dual: MoE layer {self.name} ({self.variant}, M={m}, E={self.num_experts}, "
                                   f"top_k={top_k}, H={self.hidden}, I={self.intermediate}): {e}") from e
            if c.backend.name not in self.backends:
                self._prepare(c.backend)

    def seal(self) -> None:
        """After load: no backend is prepared any more; a call whose choice changed is a RuntimeError
        naming the layer (as BoundLinear)."""
        self.sealed = True

    def report(self, M: int, top_k: int) -> str:
        """Which kernels a call of M tokens (``top_k`` experts each) launches here, and why: the
        choice (with every backend auto skipped) and the chosen backend's route."""
        dev = self._home()
        p = self.problem(M, top_k)
        head = (f"MoE {self.name}: {self.variant} E={self.num_experts} top_k={top_k} H={self.hidden} "
                f"I={self.intermediate} {self.activation} M={M} ({_bucket_text(M)}) on {dev.describe()}")
        try:
            c = self.choice(M, top_k)
        except ValueError as e:
            return f"{head}: error: {e}"
        lines = [f"{head}: {_request_text(c)} -> {c.impl}: {c.reason}"]
        if len(c.considered) > 1:
            lines += [f"    {n}: {'yes' if ok else 'no'}: {w}" for n, ok, w in c.considered]
        lines.append(f"    route: {route_text(c.backend.route(p, dev))}")
        return "\n".join(lines)


def _request_text(c_or_request) -> str:
    """"B12X_IMPL=triton", "impl=cute", "use_impl()=reference", "default=auto"."""
    source, impl = (c_or_request.source, c_or_request.requested) if isinstance(c_or_request, registry.Choice) \
        else (c_or_request.source, c_or_request.impl)
    return f"{source}{impl}" if source.endswith("=") else f"{source}={impl}"


def _bucket_text(M: int) -> str:
    hi = m_bucket(M)
    return f"M bucket {hi}" if M <= DECODE_MAX_M else f"M bucket {hi // 2 + 1}-{hi}"


# ---------------------------------------------------------------------------------------------
# The unbound call and the report
# ---------------------------------------------------------------------------------------------
def fused_moe(x, w13, w2, topk_ids, topk_weights, *, variant=None, activation="silu", renormalize=False,
              w13_bias=None, w2_bias=None, w13_act_opts=None, w2_act_opts=None, impl=None) -> torch.Tensor:
    """y [M, H] of x's dtype: one MoE layer's routed experts through the backend the registry picks.

    The arguments are :class:`BoundMoE`'s and its call's (x bf16/fp16 [M, H], the reference also
    float32; topk_ids integer [M, top_k] in [0, E); topk_weights float [M, top_k]); ``impl``
    overrides use_impl() / B12X_IMPL for this call. The experts are prepared on every call (a
    layer called more than once should hold a BoundMoE). Raises ValueError naming a bad argument
    (check_experts, validate_call, biases, act options), InvalidImplementation,
    ImplementationUnavailable and NoBackend. Source: formats.reference_moe (the numbers)."""
    layer = BoundMoE(w13, w2, variant=variant, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias,
                     w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts, name="fused_moe")
    return layer._call(x, topk_ids, topk_weights, renormalize, policy.requested_impl(impl), watch=False)


def moe_shape_classes(M: int) -> list[tuple[str, int, str]]:
    """[(label, M, note)]: the asked M first, then decode (1, 16) and prefill (4096) where not asked."""
    classes = {f"decode M={m}": m for m in DECODE_M}
    classes[f"prefill M={PREFILL_M}"] = PREFILL_M
    asked = next((label for label, m in classes.items() if m == M), f"M={M}")
    return [(asked, M, f" ({_bucket_text(M)}, asked)")] + [(lb, m, "") for lb, m in classes.items() if m != M]


def explain_moe(variant, M, num_experts, top_k, hidden, intermediate, device=None, *, activation="silu",
                impl=None) -> str:
    """A few lines saying which backend serves an MoE layer call here, and why: the device (a
    DeviceInfo, a table key such as "gb10", a torch device, or None for this process's), the
    library versions and the request; then for the asked M (with its M bucket) and the decode
    (1, 16) and prefill (4096) classes: auto's pick, every backend of the priority list with its
    verdict where one was skipped, and the chosen backend's route; under a forced request (``impl``,
    use_impl(), B12X_IMPL) a last line with that request's pick. Raises ValueError for an unknown
    variant, activation or device; InvalidImplementation for an unknown ``impl``."""
    registry.variant(variant)
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    dev = resolve(device)
    request = policy.requested_impl(impl)
    versions = ", ".join(f"{k} {v}" for k, v in library_versions().items())
    lines = [f"device: {describe_device(dev)}", f"libraries: {versions}",
             f"requested: {request.impl} (from {request.source})"]
    shape = f"E={num_experts} top_k={top_k} H={hidden} I={intermediate} {activation}"
    for label, m, note in moe_shape_classes(M):
        p = MoEProblem(variant, num_experts, top_k, hidden, intermediate, m, activation)
        head = f"MoE {variant} {label} {shape}{note}: auto -> "
        try:
            c = decide(policy.Request("auto", "default"), p, dev, log_choice=False)
        except NoBackend as e:
            lines.append(head + f"error: {e}")
            continue
        lines.append(head + f"{c.impl}: {c.reason}")
        if len(c.considered) > 1:
            lines += [f"    {n}: {'yes' if ok else 'no'}: {w}" for n, ok, w in c.considered]
        lines.append(f"    route: {route_text(c.backend.route(p, dev))}")
    if request.impl != "auto":
        p = MoEProblem(variant, num_experts, top_k, hidden, intermediate, M, activation)
        head = f"MoE {variant} M={M} {shape}: {_request_text(request)} -> "
        try:
            c = decide(request, p, dev, log_choice=False)
            lines.append(head + f"{c.impl}: {c.reason}")
            lines.append(f"    route: {route_text(c.backend.route(p, dev))}")
        except ImplementationUnavailable as e:
            lines.append(head + f"error: {e}")
    return "\n".join(lines)


__all__ = ["BoundMoE", "CuteMoE", "HopperMoE", "MoEBackend", "MoEProblem", "ReferenceMoE", "TritonMoE", "check_experts",
           "choose", "decide", "entries", "explain_moe", "fused_moe", "get", "hopper_gap", "hopper_moe_on", "make",
           "validate_call", "verdict"]
