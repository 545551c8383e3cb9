"""A bias that is a strided view (e.g. a column of a matrix) is read element by element correctly."""

import pytest
import torch

import formats
import kernels_triton
from conftest import DEVICE, make_input, rel_err


@pytest.mark.parametrize("variant", ["fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "mxfp4_w4a16"])
def test_strided_bias_matches_the_reference(variant):
    fmt, a16 = ("mxfp4", True) if variant == "mxfp4_w4a16" else (variant, False)
    n, k = 40, 256
    w = formats.quantize(make_input((n, k), torch.float32, device="cpu"), fmt).to(DEVICE)
    x = make_input((8, k), torch.bfloat16)
    bias = (torch.randn(n, 3, device=DEVICE) * 4)[:, 1]  # stride 3: not contiguous
    assert not bias.is_contiguous()
    opts = {"a16": True} if a16 else {}
    y = kernels_triton.linear(x, w, bias, **opts)
    ref = formats.reference_linear(x.cpu(), w.to("cpu"), bias.cpu(), a16=a16)
    assert rel_err(y.cpu(), ref) <= 4e-3
