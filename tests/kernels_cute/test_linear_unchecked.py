"""kernels_cute.<fmt>.linear_unchecked: the trusted twin of linear that dispatch's bound call runs
(x, bias and options validated at the call's door): the same output, bit for bit, without the checks."""

from __future__ import annotations

import pytest
import torch

import formats
import kernels_cute

from conftest import device_name, make_input

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4")
# b12x's pack_weight (tensor FP8, MXFP8) needs a CUDA weight; these three prepare on a CPU.
PREPARE_ON_CPU = ("fp8_block", "nvfp4", "mxfp4")
IS_SM12X = torch.cuda.is_available() and torch.cuda.get_device_capability() in ((12, 0), (12, 1))
N, K = 256, 512


def _weight(fmt: str, device: str):
    g = torch.Generator().manual_seed(0)
    return formats.quantize((torch.randn(N, K, generator=g) * 0.05).to(device), fmt, role="weight")


@pytest.mark.parametrize("fmt", PREPARE_ON_CPU)
def test_the_unchecked_twin_skips_the_checks_that_linear_makes(fmt):
    # An empty call reaches no b12x kernel, so this runs anywhere: linear refuses float64 x by
    # name; linear_unchecked trusts its caller and returns the empty [0, N] output of x's dtype.
    mod = kernels_cute.module(fmt)
    prepared = mod.prepare_weight(_weight(fmt, "cpu"))
    x = torch.empty(0, K, dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        mod.linear(x, prepared)
    y = mod.linear_unchecked(x, prepared)
    assert y.shape == (0, N) and y.dtype == torch.float64


@pytest.mark.sm12x
@pytest.mark.skipif(not IS_SM12X, reason=f"b12x's GEMMs need an SM120/SM121 GPU; found {device_name()}")
@pytest.mark.parametrize("m", (1, 8, 128))
@pytest.mark.parametrize("variant", FORMATS + ("nvfp4_w4a16",))
def test_linear_unchecked_equals_linear_bit_for_bit(variant, m):
    fmt, a16 = variant.removesuffix("_w4a16"), variant.endswith("_w4a16")
    mod = kernels_cute.module(variant)
    prepared = mod.prepare_weight(_weight(fmt, "cuda"), a16=a16)
    gen = torch.Generator().manual_seed(m)
    x = make_input((m, K), torch.bfloat16, generator=gen, device="cuda")
    bias = torch.randn(N, generator=gen).to("cuda", torch.bfloat16)
    opts = {"a16": True} if a16 else {}
    assert torch.equal(mod.linear_unchecked(x, prepared, bias, **opts), mod.linear(x, prepared, bias, **opts))
