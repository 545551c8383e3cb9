"""Pin the element codecs to the OCP MX v1.0 definitions (5.3.2 E4M3, 5.3.3 E2M1, 5.4.1 E8M0)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from formats import codecs
from formats.constants import E2M1_VALUES


def e4m3_spec_value(code: int) -> float:
    """The value of an e4m3fn byte straight from the spec: bias 7, 3 mantissa bits, S.1111.111 = NaN."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e2m1_spec_value(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 0x3, code & 0x1
    mag = 0.5 * m if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


ALL_E4M3 = [e4m3_spec_value(c) for c in range(256)]
FINITE_E4M3 = sorted({v for v in ALL_E4M3 if not math.isnan(v)})


def test_all_256_e4m3_codes_decode_to_the_spec_value():
    got = codecs.decode_e4m3(torch.arange(256, dtype=torch.uint8)).tolist()
    for code, (g, want) in enumerate(zip(got, ALL_E4M3)):
        assert (math.isnan(g) and math.isnan(want)) or g == want, hex(code)
    assert max(FINITE_E4M3) == 448.0 and FINITE_E4M3[FINITE_E4M3.index(0.0) + 1] == 2.0**-9


def test_all_16_e2m1_codes_decode_to_the_spec_value():
    got = codecs.decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == [e2m1_spec_value(c) for c in range(16)]
    assert got[:8] == list(E2M1_VALUES)


def test_e8m0_decodes_powers_of_two_with_0x00_as_2_pow_minus_127_and_0xff_nan():
    got = codecs.decode_e8m0(torch.arange(256, dtype=torch.uint8))
    assert got[0].item() == 2.0**-127 and got[0].item() != 0.0
    assert got[127].item() == 1.0 and got[254].item() == 2.0**127 and got[128].item() == 2.0
    assert math.isnan(got[255].item())
    assert codecs.encode_e8m0(torch.tensor([-200, -127, 0, 5, 127, 300])).tolist() == [0, 0, 127, 132, 254, 254]


def test_every_e4m3_value_encodes_to_its_own_code():
    codes = [c for c in range(256) if not math.isnan(ALL_E4M3[c])]
    vals = torch.tensor([ALL_E4M3[c] for c in codes], dtype=torch.float32)
    # -0.0 encodes to 0x80 and +0.0 to 0x00: the sign is kept
    assert codecs.encode_e4m3(vals).view(torch.uint8).tolist() == codes


def test_e4m3_midpoints_round_to_the_even_mantissa():
    lo = torch.tensor(FINITE_E4M3[:-1])
    hi = torch.tensor(FINITE_E4M3[1:])
    mid = ((lo.double() + hi.double()) / 2).float()  # exact: e4m3 midpoints fit in float32
    got = codecs.encode_e4m3(mid).float()
    lo_code = codecs.encode_e4m3(lo).view(torch.uint8)
    hi_code = codecs.encode_e4m3(hi).view(torch.uint8)
    # for positive and negative pairs alike, the tie goes to the code whose mantissa LSB is 0
    want = torch.where((lo_code & 1) == 0, lo, hi)
    # (this includes the ties at +-2^-10, between zero (even code) and +-2^-9 (odd): they round to zero)
    assert torch.equal(got, want)
    # just off a tie, round to nearest
    up = torch.nextafter(mid, torch.full_like(mid, math.inf))
    down = torch.nextafter(mid, torch.full_like(mid, -math.inf))
    assert torch.equal(codecs.encode_e4m3(up).float(), hi)
    assert torch.equal(codecs.encode_e4m3(down).float(), lo)


def test_e4m3_hand_picked_ties_and_saturation():
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 464.0, 500.0, 1e30, -1e30, 440.0, -336.0])
    want = [1.0, 1.25, 0.0, 2.0**-8, 448.0, 448.0, 448.0, -448.0, 448.0, -320.0]
    # 1.0625 is halfway 1.0|1.125 -> even 1.0; 1.1875 halfway 1.125|1.25 -> 1.25; 2^-10 halfway
    # 0|2^-9 -> 0; 3*2^-10 halfway 2^-9|2^-8 -> 2^-8 (code 2, even); 464 would round up past 448 ->
    # saturates; 440 halfway 432|448 -> 448 (mantissa 110, even); -336 halfway -320|-352 -> -320.
    assert codecs.encode_e4m3(x).float().tolist() == want


def test_e2m1_ties_go_to_the_even_code_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.25, -5.0, -7.0])
    assert codecs.decode_e2m1(codecs.encode_e2m1(x)).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0, -6.0]
    near = torch.tensor([0.26, 0.74, 1.26, 1.74, 2.51, 3.49, 5.01, 4.99])
    assert codecs.decode_e2m1(codecs.encode_e2m1(near)).tolist() == [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 4.0]


def test_e2m1_keeps_the_sign_bit_and_codes_every_value():
    vals = torch.tensor([e2m1_spec_value(c) for c in range(16)])
    assert codecs.encode_e2m1(vals).tolist() == list(range(16))
    assert codecs.encode_e2m1(torch.tensor([-0.1, 0.1, -0.0])).tolist() == [8, 0, 8]


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF]], dtype=torch.uint8)
    packed = codecs.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(codecs.unpack_e2m1(packed), codes)


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32))
def test_e4m3_encoding_is_the_nearest_value(v):
    got = codecs.encode_e4m3(torch.tensor([v], dtype=torch.float32)).float().item()
    clamped = max(-448.0, min(448.0, v))
    best = min(abs(clamped - f) for f in FINITE_E4M3)
    assert abs(clamped - got) == best


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-20, max_value=20, allow_nan=False, width=32))
def test_e2m1_encoding_is_the_nearest_value(v):
    got = codecs.decode_e2m1(codecs.encode_e2m1(torch.tensor([v], dtype=torch.float32))).item()
    grid = list(E2M1_VALUES) + [-x for x in E2M1_VALUES]
    clamped = max(-6.0, min(6.0, v))
    assert abs(clamped - got) == min(abs(clamped - g) for g in grid)


def test_log2_helpers_are_exact_at_powers_of_two_and_between():
    v = torch.tensor([1.0, 1.5, 2.0, 3.0, 0.75, 2.0**-100, 448.0], dtype=torch.float32)
    assert codecs.floor_log2(v).tolist() == [0, 0, 1, 1, -1, -100, 8]
    assert codecs.ceil_log2(v).tolist() == [0, 1, 1, 2, 0, -100, 9]
    assert codecs.pow2_ceil(v).tolist() == [1.0, 2.0, 2.0, 4.0, 1.0, 2.0**-100, 512.0]


def test_encoders_reject_non_float32():
    with pytest.raises(ValueError, match="x must be a float32"):
        codecs.encode_e4m3(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="codes last dimension must be even"):
        codecs.pack_e2m1(torch.ones(3, dtype=torch.uint8))
