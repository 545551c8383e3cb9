"""Property tests: every activation quantizer (Triton; CuTe DSL on a CUDA GPU with CuTe DSL)
equals the formats/ oracle bit for bit, over random shapes, strides, dtypes, options and values:
ties at the element format's rounding midpoints, subnormals of the input dtype, all-zero blocks,
block maxima at and around each format's largest code, huge and tiny magnitudes, and NaN/Inf (the
non-finite rule). Hypothesis draws the structure and a seed; torch builds the tensor from the seed
(drawing every element through Hypothesis would cost more than the kernel under the interpreter).

Profiles (tests/conftest.py): "ci" (default) 100 derandomized examples per format and quantizer
(500 Triton cases in CI); HYPOTHESIS_PROFILE=h200 runs 10,000 per format (docs/results.md has
the figures).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import DEVICE, device_name
from hypothesis import given
from hypothesis import strategies as st

import formats as F
import kernels_triton as kt

FORMATS = F.FORMAT_NAMES
BLOCK = {f: max(1, F.spec(f).k_multiple) for f in FORMATS}
BLOCK["fp8_tensor"] = 32  # no block structure; 32 keeps the value classes' groups meaningful
BLOCK["fp8_channel"] = 32  # one scale per row: 32-element groups of value classes inside each row
ELEM_MAX = {"e4m3": 448.0, "e2m1": 6.0}
# rounding midpoints of the element formats (in units of the scale): e2m1 between its 8 magnitudes;
# e4m3 (n + 1/2) * 2^j with n in 8..15 lies halfway between two 4-significant-bit numbers
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
QUANTIZERS = ["triton", "cute"]


def _opts(fmt, draw_bool, draw_float):
    if fmt in ("fp8_tensor", "fp8_channel"):
        return {"scale": draw_float} if draw_bool else {}
    if fmt == "fp8_block":
        return {"ue8m0": draw_bool}
    if fmt in ("mxfp8", "mxfp4"):
        return {"scale_rule": "floor" if draw_bool else "ceil"}
    return {"global_scale": draw_float * 1e4} if draw_bool else {}


def _values(fmt, m, k, dtype, seed, classes):
    """A [m, k] float32 tensor whose blocks each take one value class (by the seed)."""
    g = torch.Generator().manual_seed(seed)
    b = BLOCK[fmt]
    nb = k // b
    elem_max = ELEM_MAX[F.spec(fmt).element]
    tiny = torch.finfo(dtype).smallest_normal * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    x = torch.randn(m, nb, b, generator=g)
    kind = torch.tensor(classes, dtype=torch.long)[torch.randint(0, len(classes), (m, nb), generator=g)]
    e = torch.randint(-30, 30, (m, nb, 1), generator=g).float()
    for c in range(8):
        sel = kind == c
        if not bool(sel.any()):
            continue
        n = int(sel.sum())
        if c == 0:  # normal values at a random binade
            v = torch.randn(n, b, generator=g) * 2.0 ** e[sel]
        elif c == 1:  # e2m1 midpoints times a power of two, with the block max at 6 * 2^e
            v = E2M1_MIDPOINTS[torch.randint(0, 7, (n, b), generator=g)] * 2.0 ** e[sel]
            v[:, 0] = 6.0 * 2.0 ** e[sel][:, 0]
        elif c == 2:  # e4m3 midpoints (n + 1/2) * 2^j, block max at 448 * 2^e
            v = (torch.randint(8, 16, (n, b), generator=g) + 0.5) * 2.0 ** (e[sel] - 8)
            v[:, 0] = 448.0 * 2.0 ** e[sel][:, 0]
        elif c == 3:  # subnormals of the input dtype
            v = torch.randint(-64, 64, (n, b), generator=g).float() * tiny
        elif c == 4:  # an all-zero block
            v = torch.zeros(n, b)
        elif c == 5:  # block max just above / at / below the element max times a power of two
            f = torch.tensor([1.0 - 2.0 ** -8, 1.0, 1.0 + 2.0 ** -7])[torch.randint(0, 3, (n, 1), generator=g)]
            v = torch.randn(n, b, generator=g).clamp(-1, 1) * elem_max * 2.0 ** e[sel]
            v[:, :1] = elem_max * f * 2.0 ** e[sel][:, :1]
        elif c == 6:  # huge: near the input dtype's largest value
            v = torch.rand(n, b, generator=g) * torch.finfo(dtype).max * 0.99
        else:  # one non-finite element
            v = torch.randn(n, b, generator=g)
            v[torch.arange(n), torch.randint(0, b, (n,), generator=g)] = \
                torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.randint(0, 3, (n,), generator=g)]
        x[sel] = v
    return x.reshape(m, k)


def _layout(x, how):
    """x [m, k] as a bf16/fp16 tensor of the same values with another memory layout."""
    if how == "transposed":  # stride (1, m)
        return x.t().contiguous().t()
    if how == "sliced":  # row stride 2k, column stride 2
        buf = torch.zeros(x.shape[0], 2, x.shape[1] * 2, dtype=x.dtype, device=x.device)
        buf[:, 0, ::2] = x
        return buf[:, 0, ::2]
    if how == "3d" and x.shape[0] % 2 == 0:
        return x.reshape(2, x.shape[0] // 2, x.shape[1])
    return x


def _bits(t):
    """The raw bits; an fp32 NaN's payload is not part of the rule (GPUs write 0x7FFFFFFF, CPUs
    0x7FC00000), so every fp32 NaN compares as 0x7FC00000. 1-byte codes are compared exactly."""
    if t.dtype != torch.float32:
        return t.view(torch.uint8)
    return torch.where(t.isnan(), torch.tensor(0x7FC00000, dtype=torch.int32, device=t.device), t.view(torch.int32))


def _same_bits(q, r, what):
    assert q.shape == r.shape, what
    for field in ("data", "scale", "global_scale"):
        a, b = getattr(q, field), getattr(r, field)
        if b is None:
            assert a is None, what
            continue
        assert torch.equal(_bits(a.reshape(b.shape)).cpu(), _bits(b)), f"{what}: {field} differs"


CLASSES = st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("fmt", FORMATS)
@given(data=st.data())
def test_quantizer_equals_oracle_bit_for_bit(fmt, quantizer, data):
    if quantizer == "cute" and (DEVICE != "cuda" or not HAVE_CUTE):
        pytest.skip(f"the CuTe DSL quantizers run on a CUDA GPU with CuTe DSL; found {device_name()}, "
                    f"CuTe DSL {'installed' if HAVE_CUTE else 'not installed'}")
    if quantizer == "cute" and fmt == "fp8_channel":
        pytest.skip("kernels_cute has no fp8_channel quantizer: b12x 1.5.1 has no per-channel FP8 GEMM for it to feed")
    b = F.spec(fmt).k_multiple
    m = data.draw(st.integers(1, 9), label="M")
    k = b * data.draw(st.integers(1, max(1, 256 // b) if b > 1 else 300), label="K blocks")
    if fmt in ("fp8_tensor", "fp8_channel"):
        k = 32 * max(1, k // 32)
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="dtype")
    layout = data.draw(st.sampled_from(["contiguous", "transposed", "sliced", "3d"]), label="layout")
    classes = data.draw(CLASSES, label="value classes")
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="seed")
    opts = _opts(fmt, data.draw(st.booleans(), label="option"),
                 data.draw(st.floats(1e-3, 1e3), label="static scale"))
    x = _layout(_values(fmt, m, k, dtype, seed, classes).to(dtype).to(DEVICE), layout)
    ref = F.quantize(x.cpu(), fmt, role="activation", **opts)
    if quantizer == "triton":
        q = kt.quantize_activation(x, fmt, **opts)
    else:
        from kernels_cute.quant import quantize_activation_cute

        q = quantize_activation_cute(x, fmt, **opts)
    _same_bits(q, ref, f"{quantizer} {fmt} M={m} K={k} {dtype} {layout} classes={classes} seed={seed} {opts}")
