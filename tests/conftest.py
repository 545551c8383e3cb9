"""Shared test helpers: devices, fresh random inputs with outliers and zero blocks, error norms."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

import kernels_triton  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without a GPU)
from kernels_triton import interpreting  # noqa: F401  (for the tests that import it from here)

# Hypothesis profiles: "ci" (default) a few dozen derandomized examples per property, for the CPU
# interpreter; "h200" 10,000 per property (HYPOTHESIS_PROFILE=h200, on a GPU). No example database
# (the runs are derandomized or seeded; nothing is written into the checkout).
_HYP = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=30, derandomize=True, **_HYP)
settings.register_profile("h200", max_examples=10_000, derandomize=True, **_HYP)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed torch and random for every test: B12X_TEST_SEED if set, else a hash of the test id (so
    each test is reproducible alone and tests do not share a stream). Printed when the test fails."""
    seed = int(os.environ.get("B12X_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    torch.manual_seed(seed)
    random.seed(seed)
    request.node._b12x_seed = seed
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_b12x_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"torch/random seed {seed} (rerun with B12X_TEST_SEED={seed})"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_name() -> str:
    """What a skip message should say was found."""
    if not torch.cuda.is_available():
        return "no CUDA device (CPU only)"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def make_input(shape, dtype=torch.bfloat16, *, block: int = 32, zero_blocks: bool = True,
               outliers: bool = True, generator=None, device=DEVICE) -> torch.Tensor:
    """Fresh random [..., K] tensor: normal values, a few large outliers, and (when K allows) a few
    all-zero ``block``-wide groups along K, so that amax and zero-block paths are both exercised."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32)
    flat = x.reshape(-1, shape[-1])
    n = flat.numel()
    if outliers and n:
        idx = torch.randint(0, n, (max(1, n // 500),), generator=generator)
        flat.view(-1)[idx] *= 40.0
    if zero_blocks and flat.shape[0] and shape[-1] >= 2 * block:
        rows = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 4),), generator=generator)
        kb = torch.randint(0, shape[-1] // block, (rows.numel(),), generator=generator)
        for r, b in zip(rows.tolist(), kb.tolist()):
            flat[r, b * block:(b + 1) * block] = 0.0
    return x.to(dtype).to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64; NaN anywhere makes it inf, so NaN never passes."""
    y64, r64 = y.double(), ref.double()
    if not bool(torch.isfinite(y64).all()):
        return float("inf")
    den = r64.norm().item()
    return (y64 - r64).norm().item() / (den if den > 0 else 1.0)


@pytest.fixture
def device() -> str:
    return DEVICE
