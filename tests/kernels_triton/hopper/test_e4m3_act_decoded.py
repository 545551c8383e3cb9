"""The sm_90 mxfp8 decode linear with the activation dequantized by its quantizer
(kernels_triton/hopper/_e4m3_decode.py: act_decoded_kernel, launch_e4m3_decode_linear).

The scratch: un-permuted from the GEMM's fragment order it must equal formats' dequantize of
formats.quantize(x, "mxfp8", role="activation") bit for bit (code * 2^e is exact in bf16 and fp32 for
the scales the quantizer writes; the mxfp8 module docstring), NaN where the oracle has NaN.
The linear against the float64 oracle: conftest.gemm_bound's fp32 form (exact products, fp32
summation, one output rounding), and within that bound of launch_e4m3_decode on
quantize_activation(x), the codes path it replaces in mxfp8.linear."""

from __future__ import annotations

import pytest
import torch

import formats
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input
from kernels_triton.hopper import _e4m3_decode as dec
from kernels_triton import interpreting
from kernels_triton import mxfp8 as kmx
from kernels_triton.hopper._route import TileConfig


def _tile(bn: int, split: int, bk: int = 128) -> TileConfig:
    return TileConfig(16, bn, bk, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=split)


def _unpermute(p: torch.Tensor, bk: int) -> torch.Tensor:
    """The inverse of _fp4_decode.fragment_order on each bk-wide tile of p [M, K_pad] (K order back)."""
    M, kp = p.shape
    t = p.reshape(M, kp // bk, bk // 16, 2, 4, 2)  # per tile: column 16c + 8h + 2q + e holds K = (bk/4) q + 4c + 2h + e
    return t.permute(0, 1, 4, 2, 3, 5).reshape(M, kp)


@pytest.mark.parametrize("rule", ["ceil", "floor"])
@pytest.mark.parametrize("M,K,bk", [(1, 256, 128), (5, 320, 128), (16, 512, 256)])
def test_scratch_is_the_oracle_dequantized_activation(M, K, bk, rule):
    """K = 320: 2.5 tiles of 128 (zeros past K); rows with a NaN and an Inf make their blocks NaN."""
    x = make_input((M, K))
    if M > 1:
        x[1, 40], x[M - 1, K - 3] = float("nan"), float("-inf")
    ref = formats.dequantize(formats.quantize(x, "mxfp8", role="activation", scale_rule=rule)).cpu().double()
    kp = -(-K // bk) * bk
    p = torch.empty((M, kp), dtype=torch.float32 if interpreting() else torch.bfloat16, device=DEVICE)
    dec.act_decoded_kernel[(kp // bk,)](x, p, M, K, x.stride(0), x.stride(1), p.stride(0),
                                        FLOOR_RULE=rule == "floor", BLOCK_M=16, BLOCK_K=bk, num_warps=4)
    got = _unpermute(p.cpu().double(), bk)
    assert (ref != 0).sum() > M * K // 2  # most values are nonzero, so a zero scratch fails
    assert torch.equal(got[:, K:], torch.zeros(M, kp - K, dtype=torch.float64))
    assert torch.equal(got[:, :K].isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert torch.equal(got[:, :K][fin], ref[fin])
    if M > 1:
        assert ref[1, 32:64].isnan().all() and ref[M - 1, K - 32:].isnan().all()


# (M, N, K, BLOCK_N, split, out_dtype, rule): the K mask (320), a partial weight tile (40, 72),
# split-K with uneven ranges (320 in 3)
CASES = [
    (1, 72, 256, 64, 1, torch.float32, "ceil"),
    (5, 40, 320, 64, 3, torch.bfloat16, "floor"),
    (16, 72, 512, 128, 2, torch.float32, "ceil"),
    (16, 40, 320, 64, 1, torch.float16, "ceil"),
]


@pytest.mark.parametrize("M,N,K,bn,split,out_dtype,rule", CASES)
def test_linear_matches_the_code_path_and_the_oracle(M, N, K, bn, split, out_dtype, rule):
    x = make_input((M, 2 * K), torch.float16 if out_dtype == torch.float16 else torch.bfloat16)[:, ::2]  # K stride 2
    w = formats.quantize(make_input((N, K)) * 0.05, "mxfp8", role="weight")
    bias = make_input((N,), torch.float32, zero_blocks=False, outliers=False)
    cfg = _tile(bn, split)
    y = torch.empty(M, N, dtype=out_dtype, device=DEVICE)
    dec.launch_e4m3_decode_linear(x, w.data, w.scale, bias, y, floor_rule=rule == "floor", config=cfg)
    xq = kmx.quantize_activation(x, scale_rule=rule)
    y_codes = dec.launch_e4m3_decode(xq.data, xq.scale, w.data, w.scale, bias, torch.empty_like(y), config=cfg)
    ref = formats.reference_linear(formats.quantize(x, "mxfp8", role="activation", scale_rule=rule), w, bias,
                                   out_dtype=out_dtype)
    assert formats.reference_linear(xq, w, out_dtype=torch.float32).abs().max().item() > 0.1
    bound = gemm_bound(xq, w, bias, out_dtype, ref)
    assert_within_bound(y, ref, bound, "decoded-activation linear")
    assert_within_bound(y, y_codes, 2 * bound, "decoded-activation linear vs the codes path")  # both within bound of ref


def test_nan_row_stays_nan_and_alone():
    M, N, K = 4, 40, 256
    x = make_input((M, K))
    x[2, 100] = float("nan")
    w = formats.quantize(make_input((N, K)) * 0.05, "mxfp8", role="weight")
    y = torch.empty(M, N, device=DEVICE)
    dec.launch_e4m3_decode_linear(x, w.data, w.scale, None, y, config=_tile(64, 2))
    nan = y.isnan().cpu()
    assert nan[2].all() and not nan[[0, 1, 3]].any()


@pytest.mark.parametrize("M,K,word", [(17, 128, "M must be <= 16"), (4, 48, "positive multiple of 32")])
def test_bad_calls_are_refused_on_the_host(M, K, word):
    x = torch.ones(M, K, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(8, K, dtype=torch.uint8, device=DEVICE)
    sw = torch.zeros(8, max(1, K // 32), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=word):
        dec.launch_e4m3_decode_linear(x, w, sw, None, torch.empty(M, 8, device=DEVICE))
