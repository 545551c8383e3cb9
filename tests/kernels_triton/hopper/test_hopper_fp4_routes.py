"""Routes as data for the hopper implementation of the FP4 family (kernels_triton.hopper.nvfp4 /
mxfp4): the route a module reports is the route its launch takes; the lessons' routes:
tests/kernels_triton/test_fp4_routes.py.

For each variant (nvfp4, nvfp4 W4A16, mxfp4, mxfp4 W4A16) and each M bucket, hopper's route on a
described sm_90 device names only kernels of kernels_triton.hopper; on an sm_90 GPU only (skipped
elsewhere, naming the device) ``record_launches()`` around ``linear`` must list exactly
``route(...).kernels``, and the outputs are checked against the float64 oracle too
(conftest.gemm_bound: exact products, fp32 sums, one rounding to the output dtype), so a route that
launches the wrong kernel cannot pass by launching nothing. Other devices are refused.

Modules: kernels_triton/hopper/_fp4_route.py and kernels_triton/hopper/_tiles.py (hopper's FP4 routes and
tiles, on described sm_90 devices), kernels_triton/hopper/nvfp4.py and kernels_triton/hopper/mxfp4.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, device_name, make_input

from _fp4_testlib import check_fp4_output, fp4_weight, jit_names
from kernels_triton import interpreting, record_launches
from kernels_triton._common import device_capability
from kernels_triton.hopper import _fp4_decode, _fp4_gemm, _nvfp4_quant, _twopass
from kernels_triton.hopper import mxfp4 as hopper_mxfp4
from kernels_triton.hopper._route import sm_count
from kernels_triton.hopper import nvfp4 as hopper_nvfp4

VARIANTS = [("nvfp4", False), ("nvfp4", True), ("mxfp4", False), ("mxfp4", True)]
IDS = ["nvfp4", "nvfp4_w4a16", "mxfp4", "mxfp4_w4a16"]
HOPPER = {"nvfp4": hopper_nvfp4, "mxfp4": hopper_mxfp4}


@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=IDS)
@pytest.mark.parametrize("M", [0, 1, 16, 17, 128, 129, 4096])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_routes_name_kernels_of_the_implementation(fmt, a16, M, x_dtype):
    """Pure: hopper's route on sm_90 names only kernels of kernels_triton.hopper (and the shared
    split-K reduction and bf16 GEMM); decode GEMMs at 1 <= M <= 16 except fp16 W4A16."""
    names = jit_names(_fp4_decode, _fp4_gemm, _nvfp4_quant, hopper_mxfp4, _twopass)
    r = HOPPER[fmt].route(M, 8192, 8192, capability=(9, 0), sm_count=132, a16=a16, x_dtype=x_dtype)
    assert r.impl == "hopper" and set(r.kernels) <= names, r.describe()
    decode = 1 <= M <= 16 and not (a16 and x_dtype == torch.float16)
    assert ("fp4_decode_gemm_kernel" in r.kernels) == decode, r.describe()
    assert (r.split_k > 1) == ("splitk_reduce_kernel" in r.kernels), r.describe()


@pytest.mark.parametrize("capability", [None, (8, 9), (10, 0), (12, 0), (12, 1)], ids=str)
def test_hopper_is_sm90_only(capability):
    for mod in HOPPER.values():
        ok, why = mod.supported(capability)
        assert not ok and why
        with pytest.raises(ValueError, match="capability must be an sm_90 one"):
            mod.route(1, 8, 64, capability=capability, sm_count=1)
    assert hopper_nvfp4.supported((9, 0))[0]


@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=IDS)
def test_hopper_linear_refuses_a_device_that_is_not_sm90(fmt, a16):
    dev = torch.device(DEVICE)
    if hopper_nvfp4.supported(device_capability(dev))[0]:
        pytest.skip(f"this device is sm_90 ({device_name()}): the hopper kernels run here")
    qw = fp4_weight(fmt, 8, 64)
    with pytest.raises(ValueError, match=r"qweight\.device must be an sm_90 GPU for the hopper kernels, got"):
        HOPPER[fmt].linear(make_input((2, 64), torch.bfloat16), qw, a16=a16)


def _require_sm90():
    if interpreting() or not torch.cuda.is_available():
        pytest.skip(f"the hopper kernels run on sm_90 only; found {device_name()}")
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        pytest.skip(f"the hopper kernels run on sm_90 only; found {device_name()} (sm_{cap[0]}{cap[1]})")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=IDS)
@pytest.mark.parametrize("M", [0, 1, 16, 17, 128, 129, 2048])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_launches_its_route(fmt, a16, M, x_dtype):
    _require_sm90()
    N, K = 1024, 2048
    mod = HOPPER[fmt]
    qw = fp4_weight(fmt, N, K)
    x = make_input((M, K), x_dtype, block=16)
    dev = torch.device(DEVICE)
    r = mod.route(M, N, K, capability=device_capability(dev), sm_count=sm_count(dev), a16=a16, x_dtype=x_dtype)
    with record_launches() as log:
        y = mod.linear(x, qw, a16=a16)
    assert tuple(log) == r.kernels, r.describe()
    check_fp4_output(y, x, qw, a16)
