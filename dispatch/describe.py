"""The lines reports print: the device, the library versions, a route.

``explain``, ``b12x-dual info``, bench, sweep, diff and the watchdog's replay files all describe a
call the same way; these are the three pieces they share.
"""

from __future__ import annotations

import platform

import torch

from .devices import DeviceInfo


def library_versions() -> dict[str, str]:
    """Versions of what the results depend on, for reports and JSON: torch, triton, b12x,
    nvidia-cutlass-dsl and numpy as installed ("not installed" if absent), the Python version, and
    the CUDA version torch was built with ("None" for a CPU-only torch)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for dist in ("triton", "b12x", "nvidia-cutlass-dsl", "numpy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    out["python"] = platform.python_version()
    out["cuda"] = str(torch.version.cuda)
    return out


def describe_device(device: DeviceInfo) -> str:
    """Device line for reports: name, arch, SMs, shared memory per block and bandwidth."""
    if device.kind == "cpu":
        return f"{device.name}: no CUDA device; Triton kernels run in Triton's interpreter"
    bw = "unknown bandwidth" if device.mem_bandwidth is None else f"{device.mem_bandwidth:g} GB/s"
    return (f"{device.name} ({device.arch}, {device.sm_count} SMs, "
            f"{device.smem_per_block} B shared memory per block, {bw})")


def route_text(r) -> str:
    """One line of a Route: "kernels a -> b, tile T, SPLIT_K=s: why" (no kernel: the why alone)."""
    parts = [" -> ".join(r.kernels) if r.kernels else "no kernel"]
    if r.tile:
        parts.append(f"tile {r.tile}")
    if r.split_k > 1 and "splitk" not in r.tile:  # TileConfig's text names split-K itself
        parts.append(f"SPLIT_K={r.split_k}")
    return ", ".join(parts) + (f": {r.why}" if r.why else "")
