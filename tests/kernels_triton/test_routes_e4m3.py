"""Routes as data for the three e4m3 lessons (fp8_tensor, fp8_block, mxfp8; kernels_triton.<fmt>,
impl "triton"); the Hopper modules' (kernels_triton.hopper.<fmt>, impl "hopper") are checked in
tests/kernels_triton/hopper/test_hopper_e4m3_routes.py.

What is checked:
- the route a lesson reports is the route its linear launched (record_launches), for every
  variant (activation option, path) and M bucket (1, 16, 17..256, a large M with a small K), on
  the CPU; and route() for each described device names only kernels that exist in the module;
- any float bias dtype (fp32, bf16, fp16) on every launcher, at M <= 16 and M > 16, against the
  float64 oracle (formats.reference_linear) within conftest.gemm_bound's bound.
"""

from __future__ import annotations

import pytest
import torch

import kernels_triton
from _e4m3_testlib import check_linear, make_bias, make_weight
from conftest import DEVICE, make_input
from kernels_triton import record_launches
from kernels_triton._common import Route

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8")
BLOCK = {"fp8_tensor": 32, "fp8_block": 128, "mxfp8": 32}  # the K granule of make_input / make_weight
# activation options of linear, per format: each variant is a separate route
VARIANTS = {
    "fp8_tensor": ({}, {"scale": 0.02}),
    "fp8_block": ({}, {"ue8m0": True}),
    "mxfp8": ({}, {"scale_rule": "floor"}),
}
# M buckets: decode (1, 16), the first row past decode, a medium M, a large M with a small K
SHAPES = ((1, 40, 256), (16, 40, 256), (17, 72, 256), (130, 40, 256), (4096, 16, 128))
CAPABILITIES = (None, (8, 9), (9, 0), (12, 0), (12, 1))
H200_SMS = 132
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_names(*mods) -> set[str]:
    """Names of the @triton.jit kernels (launchable functions) defined in ``mods``."""
    import triton

    return {name for m in mods for name, obj in vars(m).items()
            if isinstance(obj, triton.runtime.jit.KernelInterface) and name.endswith("_kernel")}


def _opts(fmt: str, variant: dict, path=None) -> dict:
    return {**variant, **({"path": path} if path else {})}


# ---------------------------------------------------------------------------------------------
# Lessons: the reported route is the launched route
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_linear_launches_its_route(fmt, variant, M, N, K):
    mod = kernels_triton.module(fmt)
    opts = VARIANTS[fmt][variant]
    w = make_weight(fmt, N, K, BLOCK[fmt])
    x = make_input((M, K), block=BLOCK[fmt])
    cap = None if DEVICE == "cpu" else tuple(torch.cuda.get_device_capability())
    r = mod.route(M, N, K, capability=cap, **opts)
    assert isinstance(r, Route) and r.impl == "triton" and r.split_k == 1
    with record_launches() as log:
        y = mod.linear(x, w, None, **opts)
    assert log == list(r.kernels), (r.describe(), log)
    assert y.shape == (M, N)
    assert r.tile == str(mod.tile_config(M, N, K, capability=cap))


@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_native_path_launches_its_route(fmt):
    """path="native" (tl.dot_scaled; the interpreter runs the e4m3 formats' correctly)."""
    mod = kernels_triton.module(fmt)
    M, N, K = 5, 40, 256
    w = make_weight(fmt, N, K, BLOCK[fmt])
    x = make_input((M, K), block=BLOCK[fmt])
    cap = None if DEVICE == "cpu" else tuple(torch.cuda.get_device_capability())
    r = mod.route(M, N, K, capability=cap, path="native")
    assert r.kernels[-1] == "_native_gemm_kernel"
    class _Native:  # check_linear's module interface, on the native path
        @staticmethod
        def linear(x_, w_, b_, **o):
            return mod.linear(x_, w_, b_, path="native", **o)

    with record_launches() as log:
        check_linear(_Native, x, w, make_bias(N))
    assert log == list(r.kernels)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_no_rows_launch_nothing(fmt):
    mod = kernels_triton.module(fmt)
    w = make_weight(fmt, 8, 128, BLOCK[fmt])
    assert mod.route(0, 8, 128).kernels == ()
    with record_launches() as log:
        y = mod.linear(make_input((0, 128)), w)
    assert log == [] and y.shape == (0, 8)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_routes_name_kernels_of_the_module(fmt, cap):
    mod = kernels_triton.module(fmt)
    names = _kernel_names(mod)
    for M, N, K in SHAPES + ((8192, 8192, 8192),):
        for variant in VARIANTS[fmt]:
            r = mod.route(M, N, K, capability=cap, sm_count=H200_SMS, **variant)
            assert r.kernels and set(r.kernels) <= names, (cap, M, r.kernels, names)
            assert r.tile and r.why and r.split_k == 1
            want = kernels_triton.gemm_path(fmt, cap)[0]
            assert r.kernels[-1] == ("_native_gemm_kernel" if want == "native" else "_portable_gemm_kernel")


@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_route_refuses_bad_arguments(fmt):
    mod = kernels_triton.module(fmt)
    if fmt == "mxfp8":  # W8A16 exists (the portable kernel alone), but never natively
        assert mod.route(1, 8, 128, a16=True).kernels == ("_portable_gemm_kernel",)
        with pytest.raises(ValueError, match="W8A16 has no native kernel"):
            mod.route(1, 8, 128, a16=True, path="native")
    else:
        with pytest.raises(ValueError, match="a16"):
            mod.route(1, 8, 128, a16=True)
    with pytest.raises(ValueError, match="path"):
        mod.route(1, 8, 128, path="fast")
    with pytest.raises(ValueError, match="M, N, K"):
        mod.route(-1, 8, 128)


# ---------------------------------------------------------------------------------------------
# Any float bias dtype, at decode and past it, on every launcher
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [4, 20])
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lesson_takes_any_float_bias(fmt, bias_dtype, M):
    N, K = 40, 256
    check_linear(kernels_triton.module(fmt), make_input((M, K), block=BLOCK[fmt]), make_weight(fmt, N, K, BLOCK[fmt]),
                 make_bias(N, bias_dtype))
