"""fp8_channel (per-channel weight scales, per-token activation scales) pinned to hand-worked numbers,
and properties at the e4m3 rounding ties and at the scale's edges (zero rows, tiny and huge rows,
NaN/Inf rows), against an independent enumeration of the e4m3 values.

Module: formats/fp8_channel.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import formats as F
from formats import validate as V
from formats.constants import AMAX_FLOOR

NAN, INF = float("nan"), float("inf")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# Every finite positive e4m3 value, from its bytes 0x01..0x7E (the decoder only reads bits: the
# encoder under test is not involved), and the byte of each.
E4M3_BYTES = torch.arange(1, 0x7F, dtype=torch.uint8)
E4M3_VALUES = E4M3_BYTES.view(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------------------------
# The 2x4 example, every number written out (docs/formats.md shows it)
# --------------------------------------------------------------------------------------------
X = [[1.0, -2.5, 5.25, 7.0],
     [0.5, -14.0, 3.3, 0.0]]
W = [[3.5, 0.0, -1.0, 0.5],
     [0.0, 0.0, 0.0, 0.0],
     [7.0, -7.0, 1.75, 0.0]]


def test_activation_scales_and_codes_by_hand():
    q = F.quantize(t(X), "fp8_channel", role="activation")
    # row 0: amax 7, sx = 7/448 = 1/64: x * 64 = 64, -160, 336, 448. 336 is halfway between the
    # e4m3 neighbours 320 (1.010b * 2^8) and 352 (1.011b * 2^8): ties to the even mantissa, 320.
    # row 1: amax 14, sx = 14/448 = 1/32: x * 32 = 16, -448, 105.6, 0. 105.6 lies between 104 and
    # 112 (spacing 8 in [64, 128)): nearest 104.
    assert q.scale.tolist() == [1 / 64, 1 / 32]
    assert q.data.float().tolist() == [[64.0, -160.0, 320.0, 448.0], [16.0, -448.0, 104.0, 0.0]]
    assert q.block_shape == (1, 4) and q.shape == (2, 4)
    # dequantized: 320 / 64 = 5 (5.25 lost a quarter), 104 / 32 = 3.25
    assert F.dequantize(q).tolist() == [[1.0, -2.5, 5.0, 7.0], [0.5, -14.0, 3.25, 0.0]]


def test_weight_scales_and_codes_by_hand():
    q = F.quantize(t(W), "fp8_channel")
    # row 0: amax 3.5, sw = 3.5/448 = 1/128: codes 448, 0, -128, 64 (exact)
    # row 1: all zero: amax floored at 2^-100, sw = 2^-100 / 448 (finite, > 0), codes 0
    # row 2: amax 7, sw = 1/64: codes 448, -448, 112, 0 (exact)
    floor_scale = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / 448
    assert torch.equal(q.scale, torch.stack([t(1 / 128), floor_scale, t(1 / 64)]))
    assert q.data.float().tolist() == [[448.0, 0.0, -128.0, 64.0], [0.0] * 4, [448.0, -448.0, 112.0, 0.0]]
    assert F.dequantize(q).tolist() == W


def test_tiny_gemm_by_hand():
    # y[m, n] = (sum_k xq[m, k] wq[n, k]) * sx[m] * sw[n], e.g. y[0, 0] = (64*448 + 0 - 320*128 +
    # 448*64) / 64 / 128 = 16384 / 8192 = 2; on dequantized values: 3.5 + 0 - 5 + 3.5.
    # y[0, 2] = 7 + 17.5 + 8.75 = 33.25; y[1, 0] = 1.75 - 3.25 = -1.5;
    # y[1, 2] = 3.5 + 98 + 5.6875 = 107.1875; the zero weight row gives 0 (plus its bias).
    w = F.quantize(t(W), "fp8_channel")
    y = F.reference_linear(t(X), w, t([0.5, -1.0, 0.0]), out_dtype=torch.float64)
    assert y.tolist() == [[2.5, -1.0, 33.25], [-1.0, -1.0, 107.1875]]
    # the same from the codes and the two scale vectors
    xq = F.quantize(t(X), "fp8_channel", role="activation")
    acc = xq.data.double() @ w.data.double().T
    assert torch.equal(acc * xq.scale.double()[:, None] * w.scale.double()[None, :],
                       F.reference_linear(xq, w, out_dtype=torch.float64))


def test_static_scale_is_one_scale_for_every_row_and_saturates():
    q = F.quantize(t([[1.0, -300.0], [0.25, 0.0]]), "fp8_channel", role="activation", scale=0.5)
    # a static (calibrated per-tensor) scale: every row's scale is 0.5; -300/0.5 = -600 saturates to -448
    assert q.scale.tolist() == [0.5, 0.5] and q.data.float().tolist() == [[2.0, -448.0], [0.5, 0.0]]


def test_all_zero_activation_row_gives_zero_codes_and_the_bias():
    x = torch.randn(3, 64)
    x[1] = 0.0
    q = F.quantize(x, "fp8_channel", role="activation")
    assert q.scale[1].item() == pytest.approx(AMAX_FLOOR / 448, rel=2 ** -23) and q.scale[1].item() > 0
    assert (q.data[1].view(torch.uint8) == 0).all()
    w = F.quantize(torch.randn(5, 64), "fp8_channel")
    b = torch.randn(5)
    y = F.reference_linear(x, w, b, out_dtype=torch.float32)
    assert torch.equal(y[1], b)  # 0 * sx * sw + bias, exactly: no NaN from the floored scale


# --------------------------------------------------------------------------------------------
# Non-finite rows (docs/formats.md, "Non-finite values")
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_activation_poisons_its_row_only(v):
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3))
    x[2, 50] = v
    q = F.quantize(x, "fp8_channel", role="activation")
    assert q.scale.isnan().tolist() == [False, False, True, False]
    assert (q.data.view(torch.uint8)[2] == 0x7F).all()  # every code of the row is NaN
    x0 = x.clone()
    x0[2] = 0.0
    q0 = F.quantize(x0, "fp8_channel", role="activation")
    keep = torch.tensor([0, 1, 3])
    assert torch.equal(q.data[keep].view(torch.uint8), q0.data[keep].view(torch.uint8))
    assert torch.equal(q.scale[keep], q0.scale[keep])
    w = F.quantize(torch.randn(8, 96), "fp8_channel")
    y = F.reference_linear(x.bfloat16(), w)
    assert (~torch.isfinite(y)).all(1).tolist() == [False, False, True, False]
    # static scale: only the element's code is NaN; its row still comes out NaN
    qs = F.quantize(x, "fp8_channel", role="activation", scale=0.05)
    assert (qs.data.view(torch.uint8) == 0x7F).nonzero().tolist() == [[2, 50]]
    ys = F.reference_linear(x.bfloat16(), w, scale=0.05)
    assert (~torch.isfinite(ys)).all(1).tolist() == [False, False, True, False]


def test_weight_with_nan_or_inf_is_refused():
    w = torch.randn(4, 32)
    w[1, 3] = INF
    with pytest.raises(ValueError, match="x contains NaN or Inf; quantizing a weight needs finite values"):
        F.quantize(w, "fp8_channel")


# --------------------------------------------------------------------------------------------
# Properties: ties and scale edges, against the enumeration of e4m3
# --------------------------------------------------------------------------------------------
def _expected_codes(v: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of float32 values v (|v| <= 448, no NaN) by search over E4M3_VALUES: the nearest
    value, ties to the even byte (the even mantissa), the sign copied; independent of encode_e4m3."""
    a = v.abs()
    vals = torch.cat([torch.zeros(1), E4M3_VALUES])
    byte = torch.cat([torch.zeros(1, dtype=torch.uint8), E4M3_BYTES])
    d = (a[..., None] - vals).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    even = cand & (byte % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1))
    out = byte[idx]
    return torch.where(torch.signbit(v), out | 0x80, out)


@given(e=st.integers(-30, 30), picks=st.lists(st.integers(0, len(E4M3_VALUES) - 2), min_size=1, max_size=31),
       signs=st.lists(st.booleans(), min_size=32, max_size=32))
def test_ties_round_to_even_under_a_power_of_two_row_scale(e, picks, signs):
    # A row whose amax is 448 * 2^e has the exact scale 2^e; every other element is the midpoint of
    # two adjacent e4m3 values times 2^e, so x / scale is an exact tie.
    scale = 2.0 ** e
    mids = (E4M3_VALUES[torch.tensor(picks)] + E4M3_VALUES[torch.tensor(picks) + 1]) / 2
    row = torch.cat([torch.tensor([448.0]), mids]) * scale
    sgn = torch.tensor([-1.0 if s else 1.0 for s in signs[: row.numel()]])
    x = (row * sgn)[None, :]
    q = F.quantize(x, "fp8_channel", role="activation")
    assert q.scale.item() == scale
    assert torch.equal(q.data.view(torch.uint8)[0], _expected_codes(x[0] / scale))


@given(amax_exp=st.floats(-149, 127, allow_nan=False), mant=st.floats(1.0, 2.0, exclude_max=True),
       seed=st.integers(0, 2 ** 16))
def test_row_scale_edges(amax_exp, mant, seed):
    # Rows whose amax spans fp32 from the subnormals to near its maximum: the scale is
    # max(amax, 2^-100) / 448 (IEEE), finite and > 0; the amax element encodes to +-448 (x / s
    # rounds to 448 or saturates there) unless amax is below the floor, when every code is small.
    amax = mant * 2.0 ** amax_exp
    if not math.isfinite(amax) or amax > torch.finfo(torch.float32).max:
        return
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(1, 16, generator=g) * 2 - 1) * amax
    x[0, 5] = -amax if seed % 2 else amax
    x = x.float()
    a = x.abs().max()
    q = F.quantize(x, "fp8_channel")
    want = torch.maximum(a, torch.tensor(AMAX_FLOOR)) / torch.tensor(448.0)
    assert torch.equal(q.scale, want.reshape(1)) and bool(torch.isfinite(q.scale).all()) and q.scale.item() > 0
    codes = q.data.float()[0]
    if a >= AMAX_FLOOR:
        assert codes.abs().max().item() == 448.0
    else:
        # x / s = 448 a / 2^-100 < 448, then rounded to e4m3 (3 mantissa bits: at most 2^-4 up)
        assert codes.abs().max().item() <= 448.0 * float(a / AMAX_FLOOR) * (1 + 2.0 ** -4) + 2.0 ** -9
    assert not bool(codes.isnan().any())


# --------------------------------------------------------------------------------------------
# Validation: scales of the wrong length or value
# --------------------------------------------------------------------------------------------
def test_scale_shape_and_values_are_checked():
    w = F.quantize(torch.randn(6, 32), "fp8_channel")
    V.check_weight(w)
    V.check_scale_values(w)
    for bad in (w.scale[:-1], w.scale.reshape(6, 1), w.scale[:1].reshape(())):
        with pytest.raises(ValueError, match=r"qweight.scale must have shape \(6,\)"):
            V.check_weight(dataclasses.replace(w, scale=bad))
    with pytest.raises(ValueError, match=r"qweight.block_shape must be \(1, 32\)"):
        V.check_weight(dataclasses.replace(w, block_shape=None))
    for value in (0.0, -1.0, INF, NAN):
        s = w.scale.clone()
        s[4] = value
        with pytest.raises(ValueError, match="qweight.scale must be finite and > 0"):
            V.check_scale_values(dataclasses.replace(w, scale=s))
    with pytest.raises(ValueError, match="qweight.scale must be float32"):
        V.check_weight(dataclasses.replace(w, scale=w.scale.bfloat16()))
