"""Checks shared by the FP4 route tests of the lessons (tests/kernels_triton/test_fp4_routes.py) and of
the hopper modules (tests/kernels_triton/hopper/test_hopper_fp4_routes.py); it sits in tests/, which
pytest puts on sys.path for tests/conftest.py. Outputs are compared with the independent formats/ oracle."""

from __future__ import annotations

import triton

import formats
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input


def fp4_weight(fmt: str, N: int, K: int) -> formats.QuantizedTensor:
    """A ``fmt`` (nvfp4 / mxfp4) weight [N, K] from seeded random values (conftest.make_input, blocks
    of 16 with their own magnitudes), on the test device."""
    return formats.quantize(make_input((N, K), block=16) * 0.05, fmt, role="weight").to(DEVICE)


def check_fp4_output(y, x, qw, a16: bool, **opts) -> None:
    """y of a linear on x [M, K] and qw against formats.reference_linear (x quantized by the oracle
    unless weight-only; ``opts`` its activation options), within conftest.gemm_bound (exact
    products, fp32 sums, one rounding to the output dtype); M = 0 must give an empty [0, N]."""
    if x.shape[0] == 0:
        assert y.shape == (0, qw.shape[0])
        return
    xr = x.cpu() if a16 else formats.quantize(x.cpu(), qw.fmt, role="activation", **opts)
    ref = formats.reference_linear(xr, qw.to("cpu"), a16=a16, out_dtype=x.dtype)
    assert ref.abs().max() > 0
    assert_within_bound(y, ref, gemm_bound(xr, qw, None, x.dtype, ref))


def jit_names(*modules) -> set[str]:
    """The names of the Triton kernels (@triton.jit functions) the modules define."""
    return {name for m in modules for name, v in vars(m).items() if isinstance(v, triton.runtime.KernelInterface)}
