"""``b12x-dual info --vllm``: for each quantization scheme, which kernel vLLM picks here, with and
without the plugin, under ``--linear-backend auto`` and ``b12x``, and every reason along the list.

The pick is what vLLM's own ``init_*_linear_kernel`` returns (the truth); the reasons come from
walking the same priority list with vLLM's own ``is_supported_and_can_implement_kernel``. "Without
the plugin" takes our classes out of the lists and puts the in-tree B12x classes back into
``--linear-backend b12x`` for the duration of the call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

SCHEMES = ("fp8_w8a8 static", "fp8_w8a8 dynamic", "fp8_w8a8 channel", "fp8_w8a8 channel static", "fp8_block_w8a8",
           "mxfp8", "nvfp4_w4a4", "nvfp4_w4a16", "mxfp4 W4A4", "mxfp4 W4A16")


@dataclass
class Row:
    """One line of the table: scheme, linear backend asked for, plugin on/off, the pick (class
    name, or "error: ..." when vLLM finds none) and (kernel, ok, reason) for each list entry."""

    scheme: str
    backend: str
    plugin: bool
    chosen: str
    reasons: list = field(default_factory=list)


def _schemes(n: int, k: int, dtype: torch.dtype):
    """scheme -> (priority-list attribute, quantization key, config, init call)."""
    import vllm.model_executor.kernels.linear as lin
    from vllm.model_executor.layers.quantization.utils import quant_utils as q

    def fp8(act, w, block=False):
        cfg = lin.FP8ScaledMMLinearLayerConfig(weight_quant_key=w, activation_quant_key=act, weight_shape=(n, k),
                                               input_dtype=dtype, out_dtype=dtype)
        init = lambda: lin.init_fp8_linear_kernel(act, w, dtype, dtype, (n, k))  # noqa: E731
        return ("_POSSIBLE_FP8_BLOCK_KERNELS" if block else "_POSSIBLE_FP8_KERNELS",
                "fp8_block_w8a8" if block else "fp8_w8a8", cfg, init)

    return {
        "fp8_w8a8 static": fp8(q.kFp8StaticTensorSym, q.kFp8StaticTensorSym),
        "fp8_w8a8 dynamic": fp8(q.kFp8DynamicTensorSym, q.kFp8StaticTensorSym),
        "fp8_w8a8 channel": fp8(q.kFp8DynamicTokenSym, q.kFp8StaticChannelSym),  # CT FP8_DYNAMIC
        "fp8_w8a8 channel static": fp8(q.kFp8StaticTensorSym, q.kFp8StaticChannelSym),
        "fp8_block_w8a8": fp8(q.kFp8Dynamic128Sym, q.kFp8Static128BlockSym, block=True),
        "mxfp8": ("_POSSIBLE_MXFP8_KERNELS", "mxfp8", lin.Mxfp8LinearLayerConfig(weight_shape=(n, k)),
                  lambda: lin.init_mxfp8_linear_kernel(weight_shape=(n, k))),
        "nvfp4_w4a4": ("_POSSIBLE_NVFP4_KERNELS", "nvfp4_w4a4", lin.NvFp4LinearLayerConfig(),
                       lambda: lin.init_nvfp4_linear_kernel(use_a16=False)),
        "nvfp4_w4a16": ("_POSSIBLE_NVFP4_KERNELS", "nvfp4_w4a16", lin.NvFp4LinearLayerConfig(),
                        lambda: lin.init_nvfp4_linear_kernel(use_a16=True)),
        "mxfp4 W4A4": ("_POSSIBLE_MXFP4_KERNELS", "mxfp4", lin.MxFp4LinearLayerConfig(q.kMxfp4Dynamic),
                       lambda: lin.init_mxfp4_linear_kernel(q.kMxfp4Dynamic)),
        "mxfp4 W4A16": ("_POSSIBLE_MXFP4_KERNELS", "mxfp4", lin.MxFp4LinearLayerConfig(None),
                        lambda: lin.init_mxfp4_linear_kernel(None)),
    }


@contextlib.contextmanager
def without_plugin():
    """vLLM's lists and ``b12x`` backend set as they are without the plugin (restored after)."""
    import vllm.model_executor.kernels.linear as lin

    from . import kernels as K
    from . import patches

    ours = set(K.KERNELS)
    saved = {}
    for attr in patches.LIST_NAMES.values():
        table = getattr(lin, attr)
        saved[attr] = {p: list(v) for p, v in table.items()}
        for p in table:
            table[p] = [c for c in table[p] if c not in ours]
    kset = lin._LINEAR_BACKEND_KERNEL_MAP["b12x"]
    saved_set = set(kset)
    kset.difference_update(ours)
    kset.update(patches.removed_in_tree)
    nv_init = lin.init_nvfp4_linear_kernel
    lin.init_nvfp4_linear_kernel = getattr(nv_init, "__b12x_dual_original__", nv_init)
    try:
        yield
    finally:
        for attr, table in saved.items():
            getattr(lin, attr).update(table)
        kset.clear()
        kset.update(saved_set)
        lin.init_nvfp4_linear_kernel = nv_init


# vLLM's weight-only NVFP4 kernels (the tuple init_nvfp4_linear_kernel filters through).
NVFP4_A16 = ("B12xNvFp4W4A16LinearKernel", "FlashInferCuteDslNvFp4W4A16LinearKernel", "MarlinNvFp4LinearKernel",
             "HummingNvFp4LinearKernel")


def _walk(attr: str, quantization: str, config, compute_capability: Optional[int]) -> list:
    import vllm.model_executor.kernels.linear as lin
    from vllm.platforms import current_platform

    kernels = list(getattr(lin, attr).get(current_platform._enum, []))
    out = []
    if quantization == "nvfp4_w4a16":
        kernels = [c for c in kernels if c.__name__ in NVFP4_A16]
        if getattr(lin.init_nvfp4_linear_kernel, "__b12x_dual_original__", None) is not None:
            from .kernels import B12xDualNvFp4W4A16Kernel as W4A16

            ok, why = W4A16.is_supported(compute_capability)
            out.append((W4A16.__name__, ok, f"plugin step before vLLM's: {why or 'supported'}"))
        out.append(("(vLLM)", True, "under auto vLLM forces Marlin here (FlashInfer CuTe DSL W4A16 on SM100/103)"))
    kernels = lin._resolve_backend_kernels(kernels, "report", quantization=quantization,
                                           compute_capability=compute_capability)
    for kernel in kernels:
        ok, why = lin.is_supported_and_can_implement_kernel(kernel, config, compute_capability)
        out.append((kernel.__name__, ok, why.strip() or "supported and can implement"))
    return out


def selection_report(*, n: int = 4096, k: int = 4096, dtype: torch.dtype = torch.bfloat16,
                     backends=("auto", "b12x"), compute_capability: Optional[int] = None) -> list[Row]:
    """Rows for every scheme x backend x (plugin, no plugin), on the platform this process runs.

    ``compute_capability`` (vLLM's integer form, e.g. 120) is passed to each kernel's
    ``is_supported`` along the walk; vLLM's ``init_*`` pick always describes the running device.
    Needs vLLM importable (raises ImportError naming the install otherwise).
    """
    try:
        import vllm.model_executor.kernels.linear  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the vLLM report needs vLLM ({e}); pip install 'b12x-dual[vllm]'") from e
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config

    from . import register

    register()
    rows = []
    for backend in backends:
        with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig(linear_backend=backend))):
            for plugin in (True, False):
                ctx = contextlib.nullcontext() if plugin else without_plugin()
                with ctx:
                    for scheme, (attr, quant, cfg, init) in _schemes(n, k, dtype).items():
                        try:
                            chosen = type(init()).__name__
                        except Exception as e:  # noqa: BLE001  (vLLM found no kernel: report why)
                            chosen = f"error: {str(e).splitlines()[0]}"
                        rows.append(Row(scheme, backend, plugin, chosen, _walk(attr, quant, cfg, compute_capability)))
    return rows


def format_rows(rows: list[Row], *, reasons: bool = True) -> str:
    """Plain-text table (the CLI prints this)."""
    lines = [f"{'scheme':<24} {'backend':<8} {'plugin':<7} chosen"]
    for r in rows:
        lines.append(f"{r.scheme:<24} {r.backend:<8} {'yes' if r.plugin else 'no':<7} {r.chosen}")
        if reasons:
            lines.extend(f"{'':<42}{'+' if ok else '-'} {name}: {why}" for name, ok, why in r.reasons)
    return "\n".join(lines)
