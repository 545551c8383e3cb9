"""Where the plugin's kernels stand in vLLM's selection, and why (pure functions of the request,
the environment and a described device).

- ``--linear-backend b12x`` (or ``linear_backend_per_quant``): our class serves wherever one of
  the implementations of the registry's priority list for the device can (``registry.priority``:
  cute on SM12x, hopper on sm_90, triton on any CUDA GPU or the CPU interpreter, reference
  everywhere); B12X_IMPL narrows that to one. Which backend runs a call is ``registry.choose``'s
  decision per M bucket (ops.py), not this module's.
- ``auto``: our class goes first only on SM120/SM121, only where our CuTe path serves the format
  and shape; everywhere else it declines, with the reason, and vLLM's own order applies.
  ``B12X_VLLM_AUTO=0`` turns this placement off.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..devices import KNOWN_DEVICES, DeviceInfo, current_device
from . import _backend

log = logging.getLogger("dispatch.vllm_plugin")

ENV_AUTO = "B12X_VLLM_AUTO"
BACKEND_NAME = "b12x"  # vLLM's --linear-backend value our classes answer to
QUANT_KEYS = ("fp8_w8a8", "fp8_block_w8a8", "mxfp8", "nvfp4_w4a4", "nvfp4_w4a16", "mxfp4")

_logged: set = set()


def log_once(level: int, msg: str, *args) -> None:
    """Log a message once per process (selection reasons repeat for every layer)."""
    key = (msg, args)
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


AUTO_ON = ("", "1", "true", "on", "yes")
AUTO_OFF = ("0", "false", "off", "no")


def auto_enabled() -> bool:
    """False when B12X_VLLM_AUTO is 0/false/off/no, True when it is unset, empty or 1/true/on/yes
    (case and surrounding blanks ignored: the auto placement is on by default).

    Raises:
        ValueError: any other value, naming the variable, the value and what is allowed (as
            B12X_IMPL and B12X_PDL do), so that a typo never silently leaves the placement on.
    """
    raw = os.environ.get(ENV_AUTO, "")
    value = raw.strip().lower()
    if value in AUTO_OFF:
        return False
    if value in AUTO_ON:
        return True
    raise ValueError(f"{ENV_AUTO}={raw!r} is not allowed; allowed: {', '.join(AUTO_OFF)} (off) "
                     f"or {', '.join(AUTO_ON[1:])} / unset (on)")


def requested_backend(quantization: str) -> str:
    """What vLLM's config asks for this quantization: ``linear_backend_per_quant[quantization]``,
    else ``--linear-backend`` ("auto" with no config). vLLM's own resolver is used."""
    from vllm.model_executor.kernels.linear import _get_linear_backend

    return _get_linear_backend(quantization=quantization)


def device_for(compute_capability: Optional[int] = None) -> DeviceInfo:
    """The device a decision is for: the running one, or one described by vLLM's integer
    compute capability (120 -> (12, 0)); a capability not in the table gets a bare entry."""
    dev = current_device()
    if compute_capability is None:
        return dev
    cap = divmod(int(compute_capability), 10)
    if dev.kind == "cuda" and dev.capability == cap:
        return dev
    for d in KNOWN_DEVICES.values():
        if d.kind == "cuda" and d.capability == cap:
            return d
    return DeviceInfo(f"a GPU of compute capability {cap[0]}.{cap[1]}", cap, 0, 0, None, "cuda")


def _platform_ok() -> tuple[bool, str]:
    from vllm.platforms import current_platform

    if current_platform.is_cuda() or current_platform.is_cpu():
        return True, ""
    return False, (f"b12x-dual serves vLLM's CUDA and CPU platforms, not {current_platform.device_name!r}; "
                   "use vLLM's own kernels there")


def placement(variant: str, quantization: str, compute_capability: Optional[int] = None,
              device: Optional[DeviceInfo] = None) -> tuple[bool, str]:
    """Can our class for ``variant`` run here, given what was requested? (ok, reason).
    Raises ValueError for a B12X_VLLM_AUTO value other than those :func:`auto_enabled` allows."""
    ok, why = _platform_ok()
    if not ok:
        return False, why
    dev = device or device_for(compute_capability)
    auto_on = auto_enabled()  # read (and a bad value refused) whatever the backend asked for
    if requested_backend(quantization) == BACKEND_NAME:
        requested, source = _backend.requested_impl()
        impls = _backend.priority(dev) if requested == "auto" else (requested,)
        reasons = []
        for impl in impls:
            ok, why = _backend.support(impl, variant, dev)
            if ok:
                return True, f"--linear-backend {BACKEND_NAME}: {impl} serves {variant} on {dev.describe()} ({why})"
            reasons.append(f"{impl}: {why}")
        return False, f"no b12x-dual implementation serves {variant} on {dev.describe()}: " + "; ".join(reasons)
    if not auto_on:
        return False, (f"auto placement is off ({ENV_AUTO}={os.environ.get(ENV_AUTO)!r}); "
                       f"select b12x-dual with --linear-backend {BACKEND_NAME}")
    if not dev.is_sm12x:
        return False, (f"under --linear-backend auto, b12x-dual goes first only on SM120/SM121, and this is "
                       f"{dev.describe()}; select it with --linear-backend {BACKEND_NAME}")
    ok, why = _backend.support("cute", variant, dev)
    if not ok:
        return False, f"under --linear-backend auto b12x-dual needs its CuTe path on SM12x: {why}"
    return True, f"auto on {dev.describe()}: cute serves {variant} ({why})"


def shape_placement(variant: str, quantization: str, n: int, k: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Under auto, our class takes only the shapes the CuTe path serves at every M bucket the layer
    is prepared for (``ops.LOAD_M``); asked for, every shape."""
    if requested_backend(quantization) == BACKEND_NAME:
        return True, f"--linear-backend {BACKEND_NAME}"
    from .ops import LOAD_M

    why = ""
    for m in LOAD_M:
        ok, why = _backend.can_implement("cute", variant, m, n, k, dtype)
        if not ok:
            return False, f"under --linear-backend auto b12x-dual takes only shapes its CuTe path serves: {why}"
    return True, why
