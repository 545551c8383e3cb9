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

# Hypothesis profiles: "ci" (default) 100 derandomized examples per property (500 quantizer
# cases), for the CPU interpreter; "h200" 10,000 per property (HYPOTHESIS_PROFILE=h200, on a
# GPU). No example database (the runs are derandomized or seeded; nothing is written into the
# checkout).
_HYP = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, **_HYP)
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


# ---------------------------------------------------------------------------------------------
# Element-wise GEMM bound, derived from the arithmetic (used instead of norm-wise tolerances)
# ---------------------------------------------------------------------------------------------
# The kernels multiply exactly decoded operands (e4m3/e2m1 codes times power-of-two, e4m3 or fp32
# scales are exact in fp32 or bf16, and so are the products of two of them), so a kernel's errors
# against formats.reference_linear on the same quantized operands are:
#   * its K-term summation: |acc - exact| <= K * u_acc * sum_k |a_k b_k| (Higham's gamma_K), u_acc =
#     2^-24 for an fp32 accumulator. Hopper's fp8 MMA keeps ~13 accumulator mantissa bits (2^-12
#     per addition) within a promotion interval of L products, and the kernels add the interval
#     sums in fp32: (L * 2^-12 + K * 2^-24) * sum_k |a_k b_k| (fp8_tensor / fp8_block on a GPU,
#     L = 128; mxfp8's sm_90 decode kernel, L = 32);
#   * the epilogue: the scales or nvfp4's alpha (two reciprocals and a product) and the bias, at
#     most 6 fp32 roundings: 6 * 2^-24 * (|y| + |bias|);
#   * y and ref are each rounded once to the output dtype, so they may sit one spacing apart:
#     spacing(v) <= 2^(1-p) |v| for p significand bits (bf16 8, fp16 11, fp32 24), plus one
#     subnormal spacing for results that underflow.
OUT_P = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def gemm_bound(x, qweight, bias, out_dtype, ref, *, fp8_interval: int = 0):
    """The bound above, float64 [M, N] on the CPU. x: the activation as the kernel multiplies it, a
    QuantizedTensor (W4A4 / W8A8) or a float tensor [M, K] (W4A16). ``fp8_interval`` L > 0: the
    products are summed on Hopper's fp8 MMA in runs of L (its promotion interval: 128 for fp8_tensor /
    fp8_block, 32 for mxfp8's decode kernel), each run with 2^-12 per addition, and the runs in fp32:
    (L 2^-12 + K 2^-24) |x| . |w|^T in place of K 2^-24 |x| . |w|^T."""
    import formats

    a = (formats.dequantize(x.to("cpu"), torch.float64) if isinstance(x, formats.QuantizedTensor)
         else x.reshape(-1, x.shape[-1]).double().cpu()).abs()
    b = formats.dequantize(qweight.to("cpu"), torch.float64).abs()
    acc = qweight.k * 2.0 ** -24 + min(fp8_interval, qweight.k) * 2.0 ** -12
    r = ref.reshape(a.shape[0], -1).double().abs().cpu()
    bias_abs = 0.0 if bias is None else bias.double().abs().cpu()[None, :]
    spacing = 2.0 ** (1 - OUT_P[out_dtype])
    tiny = torch.finfo(out_dtype).smallest_normal * spacing
    return acc * (a @ b.T) + 6 * 2.0 ** -24 * (r + bias_abs) + spacing * r + tiny


def assert_within_bound(y, ref, bound, what=""):
    """|y - ref| <= bound everywhere (y finite); the message names the worst element."""
    y2, r2 = y.reshape(bound.shape).double().cpu(), ref.reshape(bound.shape).double().cpu()
    assert bool(torch.isfinite(y2).all()), f"{what}: non-finite output"
    err = (y2 - r2).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: |y - ref| = {err.view(-1)[worst].item():.3e} > bound "
                                        f"{bound.view(-1)[worst].item():.3e} at flat index {worst}")
