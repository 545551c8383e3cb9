"""Devices as values: the parts the policies know, and the one this process runs on.

A policy never asks torch which GPU is present: it takes a :class:`DeviceInfo`. That makes every
decision a pure function of (device, format, shape) that the tests can evaluate for an RTX PRO 6000
or a DGX Spark on a machine that has neither. :func:`current_device` builds the value for the GPU
this process actually sees (or the CPU entry when there is none).

Numbers (SMs, shared memory per block, memory bandwidth) come from the vendors' data sheets
(101,376 B = the 99 KiB opt-in limit per block on SM12x, 232,448 B = 227 KiB
on SM90).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from kernels_triton import interpreting  # noqa: F401  (re-exported: the one definition)


@dataclass(frozen=True)
class DeviceInfo:
    """One device, as the dispatcher sees it.

    Fields:
        name: marketing name ("NVIDIA RTX PRO 6000 Blackwell", or what the driver reports).
        capability: CUDA compute capability (major, minor); (0, 0) for the CPU.
        sm_count: streaming multiprocessors (0 for the CPU).
        smem_per_block: the largest shared memory one block may opt into, in bytes (0 for the CPU).
        mem_bandwidth: DRAM bandwidth in GB/s; None when unknown (a GPU missing from the table).
        kind: "cuda" or "cpu" (the CPU runs Triton kernels in Triton's interpreter).
    """

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    mem_bandwidth: Optional[float]
    kind: str

    @property
    def arch(self) -> str:
        """"sm_120" style name, or "cpu"."""
        if self.kind == "cpu":
            return "cpu"
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def is_sm12x(self) -> bool:
        """True on the SM120/SM121 family (the parts b12x's CuTe DSL kernels target)."""
        return self.kind == "cuda" and tuple(self.capability) in ((12, 0), (12, 1))

    @property
    def is_sm90(self) -> bool:
        """True on sm_90 (H100, H200: the parts the hopper kernels' wgmma and TMA target)."""
        return self.kind == "cuda" and tuple(self.capability) == (9, 0)

    def describe(self) -> str:
        """One line for messages: name, arch and SM count."""
        if self.kind == "cpu":
            return f"{self.name} (no CUDA device)"
        return f"{self.name} ({self.arch}, {self.sm_count} SMs)"


SM12X_SMEM_PER_BLOCK = 101_376  # bytes: 99 KiB opt-in per block on SM120/SM121
SM90_SMEM_PER_BLOCK = 232_448  # bytes: 227 KiB opt-in per block on SM90

CPU = DeviceInfo("CPU (Triton interpreter)", (0, 0), 0, 0, None, "cpu")

KNOWN_DEVICES: dict[str, DeviceInfo] = {
    "rtx_pro_6000": DeviceInfo("NVIDIA RTX PRO 6000 Blackwell", (12, 0), 188, SM12X_SMEM_PER_BLOCK, 1792.0, "cuda"),
    "rtx_5090": DeviceInfo("NVIDIA GeForce RTX 5090", (12, 0), 170, SM12X_SMEM_PER_BLOCK, 1792.0, "cuda"),
    "rtx_5080": DeviceInfo("NVIDIA GeForce RTX 5080", (12, 0), 84, SM12X_SMEM_PER_BLOCK, 960.0, "cuda"),
    "gb10": DeviceInfo("NVIDIA DGX Spark GB10", (12, 1), 48, SM12X_SMEM_PER_BLOCK, 273.0, "cuda"),
    "h100_sxm": DeviceInfo("NVIDIA H100 SXM", (9, 0), 132, SM90_SMEM_PER_BLOCK, 3350.0, "cuda"),
    "h200": DeviceInfo("NVIDIA H200", (9, 0), 132, SM90_SMEM_PER_BLOCK, 4800.0, "cuda"),
    "cpu": CPU,
}
"""The table, keyed by a short id (what ``--device`` of ``b12x-dual info`` accepts)."""

# Substrings of the driver's device name (lower case) that identify a table entry; the capability
# must match too. "H100 80GB HBM3" is how the driver names the SXM part (the PCIe one is "H100 PCIe").
_NAME_PATTERNS: dict[str, tuple[str, ...]] = {
    "rtx_pro_6000": ("rtx pro 6000",),
    "rtx_5090": ("rtx 5090",),
    "rtx_5080": ("rtx 5080",),
    "gb10": ("gb10",),
    "h100_sxm": ("h100 sxm", "h100 80gb hbm3"),
    "h200": ("h200",),
}


def lookup(name: str, capability: tuple[int, int]) -> Optional[str]:
    """The table key of a GPU from its driver name and capability, or None if it is not listed."""
    low = name.lower()
    for key, patterns in _NAME_PATTERNS.items():
        if KNOWN_DEVICES[key].capability == tuple(capability) and any(p in low for p in patterns):
            return key
    return None


def from_properties(props) -> DeviceInfo:
    """A DeviceInfo from ``torch.cuda.get_device_properties(...)`` (or any object with its fields).

    What the driver reports (name, capability, SM count, opt-in shared memory per block) wins; the
    table fills what it cannot report (bandwidth) and the shared memory if the field is missing.
    """
    capability = (int(props.major), int(props.minor))
    key = lookup(props.name, capability)
    known = KNOWN_DEVICES.get(key) if key else None
    smem = getattr(props, "shared_memory_per_block_optin", None) or (known.smem_per_block if known else 0)
    return DeviceInfo(
        name=props.name,
        capability=capability,
        sm_count=int(props.multi_processor_count),
        smem_per_block=int(smem),
        mem_bandwidth=known.mem_bandwidth if known else None,
        kind="cuda",
    )


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> DeviceInfo:
    return from_properties(torch.cuda.get_device_properties(index))


def current_device(device: Union[None, str, int, torch.device] = None) -> DeviceInfo:
    """The DeviceInfo of a torch device (default: the current CUDA device, else the CPU).

    A CPU torch device, or no CUDA at all, gives :data:`CPU`. Results for a GPU are cached.
    """
    if device is None:
        if not torch.cuda.is_available():
            return CPU
        return _cuda_device(torch.cuda.current_device())
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        return CPU
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r} requested but torch sees no CUDA device")
    return _cuda_device(dev.index if dev.index is not None else torch.cuda.current_device())


def device_of(x: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of the device a tensor lives on."""
    return current_device(x.device)


def resolve(device: Union[None, str, DeviceInfo, torch.device] = None) -> DeviceInfo:
    """Accept a DeviceInfo, a table key ("rtx_5090", "gb10", "cpu", ...), a torch device, or None."""
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, str) and device in KNOWN_DEVICES:
        return KNOWN_DEVICES[device]
    try:
        return current_device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be a DeviceInfo, one of {tuple(KNOWN_DEVICES)} or a torch device, got {device!r}"
        ) from e

