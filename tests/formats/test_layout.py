"""Pin the swizzled 128x4 scale layout to the cuBLAS / b12x formula."""

import pytest
import torch

from formats import layout


def test_hand_computed_offsets():
    # (r, c, cols) -> (r//128 * ceil(cols/4) + c//4) * 512 + (r%32)*16 + ((r//32)%4)*4 + c%4
    assert layout.swizzled_offset(0, 0, 8) == 0
    assert layout.swizzled_offset(1, 0, 8) == 16
    assert layout.swizzled_offset(32, 0, 8) == 4
    assert layout.swizzled_offset(0, 1, 8) == 1
    assert layout.swizzled_offset(0, 4, 8) == 512
    assert layout.swizzled_offset(33, 5, 8) == 512 + 16 + 4 + 1
    assert layout.swizzled_offset(130, 6, 8) == (2 + 1) * 512 + 2 * 16 + 2
    assert layout.swizzled_offset(127, 3, 3) == 31 * 16 + 3 * 4 + 3


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (128, 4), (200, 10), (257, 8)])
def test_swizzle_places_every_byte_by_the_formula_and_round_trips(rows, cols):
    s = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    flat = layout.swizzle_128x4(s, pad_value=0xAB)
    assert flat.numel() == -(-rows // 128) * -(-cols // 4) * 512
    for r in range(0, rows, max(1, rows // 7)):
        for c in range(cols):
            assert flat[layout.swizzled_offset(r, c, cols)] == s[r, c]
    # every byte not holding a scale is padding
    assert (flat == 0xAB).sum() >= flat.numel() - rows * cols
    assert torch.equal(layout.unswizzle_128x4(flat, rows, cols), s)


def test_swizzle_keeps_float8_dtype():
    s = torch.rand(130, 6).to(torch.float8_e4m3fn)
    flat = layout.swizzle_128x4(s)
    assert flat.dtype == torch.float8_e4m3fn
    assert torch.equal(layout.unswizzle_128x4(flat, 130, 6).view(torch.uint8), s.view(torch.uint8))


def test_swizzle_matches_the_reshape_permute_definition():
    # the same layout written as cuBLAS documents it: pad to (128, 4) multiples, then
    # reshape(R/128, 4, 32, C/4, 4) -> permute(0, 3, 2, 1, 4)
    rows, cols = 256, 8
    s = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    want = s.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).flatten()
    assert torch.equal(layout.swizzle_128x4(s), want)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="scales must be 2-D"):
        layout.swizzle_128x4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-byte"):
        layout.swizzle_128x4(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="flat must be a 1-D"):
        layout.unswizzle_128x4(torch.zeros(100, dtype=torch.uint8), 4, 4)
