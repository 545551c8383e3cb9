"""The dynamic per-tensor scales (fp8_tensor's sx, nvfp4's g) of a small x are taken inside the
quantize kernel (one launch) instead of from stage-1 partials (two launches): both routes must give
the oracle's codes and scales bit for bit, NaN/Inf rows included (the non-finite rule)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_input

import formats as F
import kernels_triton as kt
from kernels_triton import _common


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.int32)


def _same(a, b):
    for field in ("data", "scale", "global_scale"):
        x, y = getattr(a, field), getattr(b, field)
        if x is None:
            assert y is None
            continue
        x, y = x.cpu(), y.cpu()
        if x.dtype == torch.float32:  # a NaN's payload is not part of the rule (docs/formats.md)
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), field
        else:
            assert torch.equal(_bits(x), _bits(y)), field


@pytest.mark.parametrize("fmt", ["fp8_tensor", "nvfp4"])
@pytest.mark.parametrize("m,k", [(1, 8192), (2, 4096), (3, 512), (16, 1024)])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_amax_in_the_quantize_kernel_equals_the_two_launch_route(monkeypatch, fmt, m, k, poison):
    assert m * k <= _common.AMAX_IN_PROGRAM_MAX  # these shapes take the one-launch route
    x = make_input((m, k), torch.bfloat16, block=16)
    if poison is not None:
        x[m // 2, k // 3] = poison
    one = kt.quantize_activation(x, fmt)
    monkeypatch.setattr(_common, "AMAX_IN_PROGRAM_MAX", 0)  # every size through stage 1
    two = kt.quantize_activation(x, fmt)
    _same(one, two)
    _same(one, F.quantize(x.cpu(), fmt, role="activation"))
    scale = one.scale if fmt == "fp8_tensor" else one.global_scale
    assert bool(scale.isnan()) == (poison is not None)  # per-tensor: one NaN/Inf poisons the scale


def test_the_one_launch_route_is_for_small_tensors_only():
    assert _common.amax_in_program_tile(2, 8192) is not None
    assert _common.amax_in_program_tile(16, 8192) is None  # 131072 elements: stage-1 partials
    bm, bk = _common.amax_in_program_tile(1, 8192)
    assert bm * bk <= _common.AMAX_TILE_ELEMENTS and bk >= 16
    bm, bk = _common.amax_in_program_tile(16384, 1)  # tall and thin: the row tile is capped
    assert bm * bk <= _common.AMAX_TILE_ELEMENTS
