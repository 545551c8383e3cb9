"""dispatch.devices: the table of known parts, and DeviceInfo from what the driver reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dispatch import devices
from dispatch.devices import CPU, KNOWN_DEVICES, DeviceInfo

# (key, capability, SMs, shared memory per block in bytes, bandwidth GB/s), from the issue / notes.
TABLE = [
    ("rtx_pro_6000", (12, 0), 188, 101_376, 1792.0),
    ("rtx_5090", (12, 0), 170, 101_376, 1792.0),
    ("rtx_5080", (12, 0), 84, 101_376, 960.0),
    ("gb10", (12, 1), 48, 101_376, 273.0),
    ("h100_sxm", (9, 0), 132, 232_448, 3350.0),
    ("h200", (9, 0), 132, 232_448, 4800.0),
]


@pytest.mark.parametrize("key,cap,sms,smem,bw", TABLE)
def test_table_holds_the_published_numbers(key, cap, sms, smem, bw):
    d = KNOWN_DEVICES[key]
    assert (d.capability, d.sm_count, d.smem_per_block, d.mem_bandwidth, d.kind) == (cap, sms, smem, bw, "cuda")
    assert d.is_sm12x == (cap[0] == 12)


def test_cpu_entry_is_not_a_gpu():
    assert KNOWN_DEVICES["cpu"] is CPU
    assert CPU.kind == "cpu" and CPU.arch == "cpu" and not CPU.is_sm12x


def test_device_info_is_a_frozen_hashable_value():
    d = KNOWN_DEVICES["gb10"]
    with pytest.raises(AttributeError):
        d.sm_count = 1  # type: ignore[misc]
    assert {d: 1}[DeviceInfo(**d.__dict__)] == 1
    assert d.arch == "sm_121"


def _props(name, major, minor, sms, smem=None):
    p = SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms)
    if smem is not None:
        p.shared_memory_per_block_optin = smem
    return p


@pytest.mark.parametrize("name,cap,key", [
    ("NVIDIA GeForce RTX 5090", (12, 0), "rtx_5090"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), "rtx_pro_6000"),
    ("NVIDIA GB10", (12, 1), "gb10"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "h100_sxm"),
    ("NVIDIA H200", (9, 0), "h200"),
    ("NVIDIA H100 PCIe", (9, 0), None),          # a different part (2 TB/s): not guessed
    ("NVIDIA GeForce RTX 5090", (9, 0), None),   # name and capability must both match
])
def test_lookup_matches_driver_names(name, cap, key):
    assert devices.lookup(name, cap) == key


def test_from_properties_prefers_the_driver_and_fills_bandwidth_from_the_table():
    # A cut-down part reporting fewer SMs keeps its own count; bandwidth comes from the table.
    d = devices.from_properties(_props("NVIDIA GeForce RTX 5090", 12, 0, 160, smem=101_376))
    assert (d.sm_count, d.smem_per_block, d.mem_bandwidth, d.capability) == (160, 101_376, 1792.0, (12, 0))
    unknown = devices.from_properties(_props("NVIDIA A100-SXM4-80GB", 8, 0, 108, smem=166_912))
    assert unknown.mem_bandwidth is None and unknown.smem_per_block == 166_912
    no_field = devices.from_properties(_props("NVIDIA GB10", 12, 1, 48))
    assert no_field.smem_per_block == 101_376


def test_current_device_on_a_cpu_tensor_is_the_cpu():
    assert devices.current_device("cpu") == CPU
    assert devices.current_device(torch.device("cpu")) == CPU
    if not torch.cuda.is_available():
        assert devices.current_device() == CPU


def test_resolve_accepts_keys_values_and_torch_devices():
    assert devices.resolve("gb10") is KNOWN_DEVICES["gb10"]
    assert devices.resolve(KNOWN_DEVICES["h200"]) is KNOWN_DEVICES["h200"]
    assert devices.resolve("cpu") == CPU
    with pytest.raises(ValueError, match="rtx_5090"):
        devices.resolve("not-a-device")


# sm_90 is (9, 0) exactly: the H100 and H200 of the table, and any other part of that capability.
SM90_EXPECTED = {"h100_sxm": True, "h200": True, "rtx_pro_6000": False, "rtx_5090": False, "rtx_5080": False,
                 "gb10": False, "cpu": False}


@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_the_device_predicates_are_the_one_definition_the_registry_uses(key):
    from dispatch import registry

    d = KNOWN_DEVICES[key]
    assert d.is_sm90 == SM90_EXPECTED[key]
    assert registry.device_class(d) == ("sm_90" if d.is_sm90 else "sm_12x" if d.is_sm12x else "other")


def test_a_described_part_of_capability_9_0_is_sm90_and_9_x_is_not():
    h20 = DeviceInfo("NVIDIA H20", [9, 0], 78, 232_448, None, "cuda")  # a list, as a caller may pass one
    assert h20.is_sm90 and not h20.is_sm12x
    assert not DeviceInfo("a 9.1 part", (9, 1), 1, 0, None, "cuda").is_sm90
    assert not DeviceInfo("cpu (9, 0)", (9, 0), 0, 0, None, "cpu").is_sm90
    assert DeviceInfo("a 12.1 part", [12, 1], 1, 0, None, "cuda").is_sm12x
