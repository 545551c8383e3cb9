"""Routes as data for the Hopper production kernels of the three e4m3 formats
(kernels_triton.hopper.fp8_tensor, fp8_block, mxfp8, impl "hopper"; the package's module() and
supported()); the lessons' routes: tests/kernels_triton/test_routes_e4m3.py.

What is checked:
- on the CPU the Hopper modules' route for sm_90 (132 SMs, the H200) is executed under the
  interpreter (execute()), so the host logic that decides and launches is tested here, and the
  launches equal the route; on an sm_90 GPU their linear itself is checked (skipped elsewhere,
  naming the device); route() for other devices refuses, naming sm_90;
- any float bias dtype (fp32, bf16, fp16) on every sm_90 launcher, at M <= 16 and M > 16, against
  the float64 oracle (formats.reference_linear) within conftest.gemm_bound's bound.
"""

from __future__ import annotations

import pytest
import torch

import formats
from _e4m3_testlib import check_linear, make_bias, make_weight
from conftest import DEVICE, assert_within_bound, device_name, gemm_bound, make_input
from kernels_triton import hopper, record_launches
from kernels_triton._common import Route

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8")
BLOCK = {"fp8_tensor": 32, "fp8_block": 128, "mxfp8": 32}  # the K granule of make_input / make_weight
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


def _hopper_kernel_names(fmt: str) -> set[str]:
    from kernels_triton.hopper import _e4m3_decode, _fp8_decode, _fp8_prefill, _twopass

    return _kernel_names(hopper.module(fmt), _e4m3_decode, _fp8_decode, _fp8_prefill, _twopass)


# ---------------------------------------------------------------------------------------------
# Hopper: route() is pure; on the CPU its sm_90 route runs under the interpreter via execute()
# ---------------------------------------------------------------------------------------------
HOPPER_VARIANTS = {
    "fp8_tensor": ({}, {"scale": 0.02}),
    "fp8_block": ({}, {"ue8m0": True}),
    "mxfp8": ({}, {"scale_rule": "floor"}, {"decode_kernel": "fp8"}),
}


def _act_opts(opts: dict) -> dict:
    """The activation options execute() takes (decode_kernel is a route option only)."""
    return {k: v for k, v in opts.items() if k != "decode_kernel"}


def _route_linear(H, r: Route):
    """check_linear's module interface (linear(x, w, bias, **opts)) running route ``r`` by execute()."""
    class _Linear:
        @staticmethod
        def linear(x_, w_, b_, **o):
            return H.execute(r, x_, w_, b_, **o)
    return _Linear


def _check_fp8_decode_linear(H, x, w, bias):
    """mxfp8 with decode_kernel="fp8" on sm_90: 32-deep fp8 wgmma partials, so conftest.gemm_bound
    with the fp8 MMA's accumulation over 32 products (_e4m3_testlib.fp8_decode_interval)."""
    y = H.linear(x, w, bias, decode_kernel="fp8")
    ref = formats.reference_linear(x, w, bias)
    xq = formats.quantize(x.cpu(), "mxfp8", role="activation")
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, x.dtype, ref, fp8_interval=32), "linear decode_kernel=fp8")


@pytest.mark.parametrize("cap", [c for c in CAPABILITIES if c != (9, 0)], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_hopper_route_refuses_other_devices(fmt, cap):
    H = hopper.module(fmt)
    ok, why = hopper.supported(cap)
    assert not ok and why
    with pytest.raises(ValueError, match="sm_90"):
        H.route(16, 64, 256, capability=cap, sm_count=H200_SMS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hopper_routes_name_kernels_of_the_package(fmt):
    H = hopper.module(fmt)
    names = _hopper_kernel_names(fmt)
    for M, N, K in SHAPES + ((1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192), (8192, 8192, 8192)):
        for variant in HOPPER_VARIANTS[fmt]:
            r = H.route(M, N, K, capability=(9, 0), sm_count=H200_SMS, **variant)
            assert r.impl == "hopper" and r.kernels and set(r.kernels) <= names, (M, r.kernels)
            assert r.tile and r.why
            assert (r.split_k > 1) == ("splitk_reduce_kernel" in r.kernels)


@pytest.mark.parametrize("M,N,K", SHAPES[:4] + ((300, 48, 256),))
@pytest.mark.parametrize("fmt", FORMATS)
def test_hopper_route_executes_as_reported_under_the_interpreter(fmt, M, N, K):
    """The sm_90 route of each M bucket, run by execute() (what linear runs after route()) on this
    machine's device: the launches equal the route and y matches the oracle."""
    H = hopper.module(fmt)
    w = make_weight(fmt, N, K, BLOCK[fmt])
    x = make_input((M, K), block=BLOCK[fmt])
    for variant in HOPPER_VARIANTS[fmt]:
        r = H.route(M, N, K, capability=(9, 0), sm_count=H200_SMS, **variant)
        with record_launches() as log:
            check_linear(_route_linear(H, r), x, w, make_bias(N), **_act_opts(variant))
        assert log == list(r.kernels), (r.describe(), log)


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_block"])
def test_hopper_prefill_route_without_tma_alignment(fmt):
    """A weight TMA cannot read takes the fp8 tl.dot GEMM on the prefill tile, as the route says."""
    H = hopper.module(fmt)
    aligned = H.route(300, 64, 256, capability=(9, 0), sm_count=H200_SMS)
    misaligned = H.route(300, 64, 256, capability=(9, 0), sm_count=H200_SMS, tma_aligned=False)
    assert aligned.kernels[-1] == "fp8_prefill_kernel" and misaligned.kernels[-1] == "_gemm_kernel"
    assert aligned.tile == misaligned.tile
    w = make_weight(fmt, 64, 256, BLOCK[fmt])
    x = make_input((300, 256), block=BLOCK[fmt])
    with record_launches() as log:
        check_linear(_route_linear(H, misaligned), x, w, make_bias(64))
    assert log == list(misaligned.kernels)


def test_hopper_decode_kernel_is_an_argument_and_checked():
    H = hopper.module("mxfp8")
    bf16 = H.route(8, 256, 1024, capability=(9, 0), sm_count=H200_SMS)
    fp8 = H.route(8, 256, 1024, capability=(9, 0), sm_count=H200_SMS, decode_kernel="fp8")
    assert "e4m3_decode_gemm_kernel" in bf16.kernels and "fp8_decode_gemm_kernel" in fp8.kernels
    with pytest.raises(ValueError, match=r"decode_kernel must be one of \('bf16', 'fp8'\), got 'fast'"):
        H.route(8, 256, 1024, capability=(9, 0), sm_count=H200_SMS, decode_kernel="fast")


def _sm90_or_skip():
    if not torch.cuda.is_available():
        pytest.skip(f"the Hopper kernels run on sm_90 only; found {device_name()}")
    cap = tuple(torch.cuda.get_device_capability())
    if cap != (9, 0):
        pytest.skip(f"the Hopper kernels run on sm_90 only; found {device_name()} (sm_{cap[0]}{cap[1]})")
    return cap


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", ((1, 4096, 4096), (16, 4096, 4096), (17, 4096, 4096), (64, 1024, 4096),
                                   (200, 4096, 4096), (4096, 1024, 1024)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_hopper_linear_launches_its_route_on_sm90(fmt, M, N, K):
    cap = _sm90_or_skip()
    H = hopper.module(fmt)
    w = make_weight(fmt, N, K, BLOCK[fmt])
    x = make_input((M, K), block=BLOCK[fmt])
    for variant in HOPPER_VARIANTS[fmt]:
        r = H.route(M, N, K, capability=cap, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                    **variant)
        with record_launches() as log:
            if "decode_kernel" in variant:
                _check_fp8_decode_linear(H, x, w, make_bias(N))
            else:
                check_linear(H, x, w, make_bias(N), **variant)
        assert log == list(r.kernels), (r.describe(), log)


# ---------------------------------------------------------------------------------------------
# Any float bias dtype, at decode and past it, on every sm_90 launcher
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 4, 20])
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_hopper_takes_any_float_bias(fmt, bias_dtype, M):
    """Every sm_90 launcher (the decode kernels, with mxfp8's both decode kernels and its
    dequantized-activation linear at M = 1, and the tl.dot GEMM past decode) takes the bias as
    nn.Linear and vLLM pass it. On an sm_90 GPU through linear; elsewhere through the same route
    executed under the interpreter (the host checks that refused a bf16 bias run there too)."""
    N, K = 40, 256
    H = hopper.module(fmt)
    w = make_weight(fmt, N, K, BLOCK[fmt])
    x = make_input((M, K), block=BLOCK[fmt])
    bias = make_bias(N, bias_dtype)
    for variant in HOPPER_VARIANTS[fmt]:
        if DEVICE == "cuda" and tuple(torch.cuda.get_device_capability()) == (9, 0):
            if "decode_kernel" in variant:
                _check_fp8_decode_linear(H, x, w, bias)
            else:
                check_linear(H, x, w, bias, **variant)
            continue
        r = H.route(M, N, K, capability=(9, 0), sm_count=H200_SMS, **variant)
        check_linear(_route_linear(H, r), x, w, bias, **_act_opts(variant))
