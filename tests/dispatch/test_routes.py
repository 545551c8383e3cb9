"""Routes as data: what explain reports is the route the backend takes, and the route the launch took.

For every variant x device of the table (dispatch.devices.KNOWN_DEVICES) x M bucket, the route
``explain`` prints and ``dispatch.route`` returns is the chosen backend's ``route(problem, device)``
(one decision, reported as made). On the device this process runs on (the CPU interpreter in CI,
the GPU on a GPU run) the kernels ``record_launches()`` sees around the real call are exactly the
route's kernels, for every implementation that runs here.
"""

from __future__ import annotations

import pytest
import torch

from dispatch import api, policy, registry
from dispatch.backends import Route, record_launches
from dispatch.devices import CPU, KNOWN_DEVICES, current_device, interpreting

from conftest import DEVICE, device_name

VARIANTS = tuple(registry.VARIANTS)
# One M per registry bucket class: decode (1, 16), a small prefill bucket (17..32 -> 32; 33..64 -> 64)
# and a large one (4096).
M_BUCKETS = (1, 16, 17, 40, 4096)
HERE = CPU if interpreting() else current_device()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _route_line(text: str, label: str) -> str:
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(label))
    return next(line for line in lines[i + 1:] if line.startswith("    route: "))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_explain_reports_the_route_the_chosen_backend_takes(key, variant):
    dev = KNOWN_DEVICES[key]
    N, K = 8192, 8192
    for M in M_BUCKETS:
        c = registry.choose(variant, M, N, K, dev, log_choice=False)
        r = c.backend.route(registry.Problem(variant, M, N, K), dev)
        assert isinstance(r, Route) and r.impl == c.impl, (M, r)
        assert r.split_k >= 1 and r.why
        assert api.route(variant, M, N, K, dev) == r
        text = api.explain(variant, M, N, K, device=dev)
        label = {1: "decode M=1 ", 16: "decode M=16 ", 4096: "prefill M=4096 "}.get(M, f"M={M} ")
        assert _route_line(text, f"{variant} {label}") == f"    route: {api.route_text(r)}", (M, text)


def _runnable_here(variant: str) -> list[str]:
    """The implementations of this device's priority list that serve a small call here."""
    out = []
    for impl in registry.priority(HERE):
        entry = registry.entries()[(impl, variant)]
        if registry.verdict(entry, registry.Problem(variant, 16, 64, 256), HERE)[0]:
            out.append(impl)
    return out


@pytest.mark.parametrize("M", (1, 16, 33, 160))
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_launch_takes_the_route_explain_reports(variant, M):
    # Small N, K: the interpreter runs every kernel on the CPU. The kernels launched inside the
    # call, in order, are the route's; the reference launches none of ours.
    impls = _runnable_here(variant)
    if not impls:
        pytest.skip(f"no implementation serves {variant} on {device_name()}")
    N, K = 64, 256
    g = torch.Generator().manual_seed(M)
    qw = api.quantize_weight(torch.randn(N, K, generator=g), variant).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    for impl in impls:
        b = registry.get(impl, variant)
        r = b.route(registry.Problem(variant, M, N, K), HERE)
        with record_launches() as log:
            y = b.apply(x, b.prepare(qw))
        assert y.shape == (M, N) and bool(torch.isfinite(y).all())
        if impl == "cute":
            # b12x's GEMM and our CuTe DSL quantizer are not Triton launches: record_launches sees
            # none of them, and nothing of kernels_triton may run on the cute path.
            assert r.kernels and log == [], (r, log)
            continue
        assert tuple(log) == r.kernels, (impl, r)
        if impl == "reference":
            assert r.kernels == ()
        else:
            assert r.kernels, (impl, r)


def test_the_h200_routes_name_the_hopper_kernels():
    # The example: on an H200 fp8_tensor at M = 1, 16 and 4096 runs hopper's kernels, and
    # explain says so (not the readable triton path).
    dev = KNOWN_DEVICES["h200"]
    ok, why = registry.get("hopper", "fp8_tensor").is_supported(dev)
    if not ok:
        pytest.skip(f"needs kernels_triton.hopper: {why}")
    for M in (1, 16, 4096):
        r = api.route("fp8_tensor", M, 8192, 8192, dev)
        assert r.impl == "hopper" and r.kernels, (M, r)


@pytest.mark.parametrize("variant,option", [("fp8_tensor", "scale"), ("nvfp4", "global_scale")])
def test_a_static_activation_scale_is_part_of_the_route(variant, option):
    # A static scale (vLLM's input_scale / input_global_scale) drops the amax kernel: the route
    # given the same options says so, and the launch agrees.
    N, K, M = 64, 256, 16
    g = torch.Generator().manual_seed(7)
    qw = api.quantize_weight(torch.randn(N, K, generator=g), variant).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    amax = x.float().abs().amax()
    value = amax / 448.0 if option == "scale" else 448.0 * 6.0 / amax  # the formats' dynamic rules
    for impl in _runnable_here(variant):
        if impl in ("reference", "cute"):
            continue
        b = registry.get(impl, variant)
        dynamic = b.route(registry.Problem(variant, M, N, K), HERE)
        static = b.route(registry.Problem(variant, M, N, K), HERE, **{option: value})
        assert len(static.kernels) < len(dynamic.kernels), (dynamic, static)
        with record_launches() as log:
            b.apply(x, b.prepare(qw), **{option: value})
        assert tuple(log) == static.kernels, (impl, static)
