"""The W4A4 decode linears' branch (hopper.nvfp4._linear_decode, hopper.mxfp4._linear_decode: the
quantizer writes the decode GEMM's planes, then hopper._fp4_decode's GEMM) against the formats oracle.

hopper.nvfp4.linear / hopper.mxfp4.linear take that branch at M <= 16 on sm_90 (the route), so here
the branch's function is called directly (under the interpreter it runs the same host code and
kernels in plain-op form). Its activation codes, scales and g equal formats.quantize's bit for bit
(test_fp4_act_planes: the planes equal the chain's), the products are exact and only the fp32
sums round, then the bf16 output: conftest.gemm_bound on the oracle's quantized activation."""

from __future__ import annotations

import pytest
import torch

import formats
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input
from kernels_triton.hopper import mxfp4, nvfp4

SHAPES = [(1, 72, 256), (5, 40, 320), (16, 72, 512)]  # M = 1 / 16: the domain's ends; K = 320: a K tail


def _weight(fmt, N, K):
    return formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")


def _check(y, x, qw, bias, **opts):
    xq = formats.quantize(x.cpu(), qw.fmt, role="activation", **opts)
    ref = formats.reference_linear(xq, qw.to("cpu"), None if bias is None else bias.cpu(), out_dtype=x.dtype)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert ref.abs().max().item() > 0.1  # far from zero: a zero output fails
    assert_within_bound(y, ref, gemm_bound(xq, qw, bias, x.dtype, ref), f"{qw.fmt} decode linear vs oracle")


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
def test_mxfp4_linear_decode_matches_the_oracle(M, N, K, scale_rule):
    x = make_input((M, 2 * K))[:, ::2]  # K stride 2: the branch takes linear's reshaped x as it is
    qw = _weight("mxfp4", N, K)
    bias = make_input((N,), zero_blocks=False) if M != 16 else None
    _check(mxfp4._linear_decode(x, qw, bias, scale_rule), x, qw, bias, scale_rule=scale_rule)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("gs", ["dynamic", "float", "tensor"])
def test_nvfp4_linear_decode_matches_the_oracle(M, N, K, gs):
    """The global scale dynamic, static as a Python float and static as a one-element tensor (read on
    the device, never on the host)."""
    x = make_input((M, K), torch.float16 if M == 5 else torch.bfloat16, block=16)
    qw = _weight("nvfp4", N, K)
    bias = make_input((N,), zero_blocks=False) if M != 16 else None
    g = {"dynamic": None, "float": 16.0, "tensor": torch.tensor(16.0, device=DEVICE)}[gs]
    y = nvfp4._linear_decode(x, qw, bias, g)
    _check(y, x, qw, bias, **({} if g is None else {"global_scale": 16.0}))


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("inf"), float("nan")])
def test_nvfp4_linear_decode_bad_global_scale(bad):
    """A bad static g: as a tensor it is not read on the host, so the quantizer makes it NaN and every
    output is NaN (never finite numbers); as a Python number it is refused by name."""
    M, N, K = 3, 40, 256
    x = make_input((M, K), block=16)
    qw = _weight("nvfp4", N, K)
    y = nvfp4._linear_decode(x, qw, None, torch.tensor(bad, device=DEVICE))
    assert y.shape == (M, N) and y.isnan().all()
    with pytest.raises(ValueError, match=r"global_scale must be one finite positive number"):
        nvfp4._linear_decode(x, qw, None, bad)
