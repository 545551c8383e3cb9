"""Routes as data for the FP4 lessons: the route a module reports is the route its launch takes.

For each variant (nvfp4, nvfp4 W4A16, mxfp4, mxfp4 W4A16) and each M bucket (0, 1, 16: decode;
17..256; thousands of rows with a small K), ``record_launches()`` around ``linear`` must list
exactly ``route(...).kernels`` for the device the call ran on: the lesson (kernels_triton.nvfp4 /
mxfp4) on whatever device this is (the CPU interpreter here). The outputs are checked against the
float64 oracle too (conftest.gemm_bound: exact products, fp32 sums, one rounding to the output
dtype), so a route that launches the wrong kernel cannot pass by launching nothing. The routes for
described devices name only kernels their module defines. The hopper implementation's routes
(kernels_triton.hopper.nvfp4 / mxfp4): tests/kernels_triton/hopper/test_hopper_fp4_routes.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_input

from _fp4_testlib import check_fp4_output, fp4_weight, jit_names
from kernels_triton import mxfp4, nvfp4, record_launches
from kernels_triton._common import device_capability, gemm_path
from kernels_triton.hopper._route import sm_count

VARIANTS = [("nvfp4", False), ("nvfp4", True), ("mxfp4", False), ("mxfp4", True)]
IDS = ["nvfp4", "nvfp4_w4a16", "mxfp4", "mxfp4_w4a16"]
# (M, N, K): the M buckets; small N and K keep the interpreter fast
SHAPES = [(0, 40, 64), (1, 40, 64), (16, 72, 128), (37, 40, 96), (4096, 16, 64)]
CAPABILITIES = [None, (8, 9), (9, 0), (12, 0), (12, 1)]
LESSON = {"nvfp4": nvfp4, "mxfp4": mxfp4}


@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=IDS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_lesson_launches_its_route(fmt, a16, M, N, K):
    mod = LESSON[fmt]
    qw = fp4_weight(fmt, N, K)
    x = make_input((M, K), torch.bfloat16, block=16)
    dev = torch.device(DEVICE)
    r = mod.route(M, N, K, capability=device_capability(dev), sm_count=sm_count(dev), a16=a16)
    assert r.impl == "triton" and r.split_k == 1
    with record_launches() as log:
        y = mod.linear(x, qw, a16=a16)
    assert tuple(log) == r.kernels, r.describe()
    check_fp4_output(y, x, qw, a16)


def test_lesson_static_scale_and_forced_native_routes():
    """nvfp4 with a static global scale skips the amax kernel; mxfp4's native kernel runs under the
    interpreter too (its dot_scaled is right for E8M0 scales), and path= reaches the route."""
    dev = torch.device(DEVICE)
    cap, sms = device_capability(dev), sm_count(dev)
    x = make_input((5, 64), torch.bfloat16, block=16)
    qw = fp4_weight("nvfp4", 24, 64)
    r = nvfp4.route(5, 24, 64, capability=cap, sm_count=sms, global_scale=30.0)
    assert r.kernels[0] == "_quantize_kernel"
    with record_launches() as log:
        y = nvfp4.linear(x, qw, global_scale=30.0)
    assert tuple(log) == r.kernels
    check_fp4_output(y, x, qw, False, global_scale=30.0)
    qw4 = fp4_weight("mxfp4", 24, 64)
    for path in ("portable", "native"):
        r = mxfp4.route(5, 24, 64, capability=cap, sm_count=sms, path=path)
        with record_launches() as log:
            y = mxfp4.linear(x, qw4, path=path)
        assert tuple(log) == r.kernels and r.kernels[-1] == f"_{path}_gemm_kernel"
        check_fp4_output(y, x, qw4, False)


@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=IDS)
@pytest.mark.parametrize("capability", CAPABILITIES, ids=str)
def test_lesson_routes_name_kernels_of_the_module(fmt, a16, capability):
    """Pure: no GPU needed. Every route of the lesson is impl "triton", names kernels the lesson
    defines, never a split-K, and the native kernel only on SM12x W4A4."""
    mod = LESSON[fmt]
    names = jit_names(mod)
    for M, N, K in SHAPES:
        r = mod.route(M, N, K, capability=capability, sm_count=132, a16=a16)
        assert r.impl == "triton" and r.split_k == 1 and set(r.kernels) <= names, r.describe()
        native = "_native_gemm_kernel" in r.kernels
        # native exactly where the path policy says so: SM12x W4A4 with a Triton that lowers
        # dot_scaled natively there (3.6+ on sm_120, 3.8+ on sm_121), never elsewhere
        want = not a16 and M > 0 and capability is not None and gemm_path(fmt, capability)[0] == "native"
        assert native == want, r.describe()
        assert not want or capability[0] == 12


def test_lesson_route_refuses_what_the_launch_refuses():
    with pytest.raises(ValueError, match="path must be None or one of"):
        mxfp4.route(1, 8, 64, path="fast")
    with pytest.raises(ValueError, match="W4A16 has no native kernel"):
        mxfp4.route(1, 8, 64, a16=True, path="native")
    with pytest.raises(ValueError, match="nvfp4 path='native' cannot run under the Triton interpreter"):
        nvfp4.route(1, 8, 64, path="native")  # the interpreter
    with pytest.raises(ValueError, match=r"M, N, K must be >= 0, got \(-1, 8, 64\)"):
        nvfp4.route(-1, 8, 64)
