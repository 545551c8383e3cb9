"""The swapped FP8 decode kernel (kernels_triton/hopper/_fp8_decode.py) called directly through
launch_fp8_decode, against the formats/ oracle: per-tensor, block and MX scales (SCALE_K 0 / 128 /
32), MX K steps of 128 / 64 / 32, split-K 1 and > 1 through ``config``, a bias, the e4m3 NaN code.
(The E8M0 bytes 0x00 / 0xFF: test_mxfp8.test_gemm_nan_and_extreme_scales_in_decode_rows.)

gemm takes this kernel only for M <= 16 on sm_90. Here it runs under the interpreter on the CPU,
the codes decoded to fp32 (every product exact, summed in fp32: conftest.gemm_bound with
fp8_interval 0), and on an sm_90 GPU, where the fp8 wgmma sums runs of min(128, SCALE_K or BLOCK_K)
products before an fp32 addition (the promotion interval or the scale block: fp8_interval)."""

from __future__ import annotations

import re

import pytest
import torch

import formats
from _e4m3_testlib import fp8_decode_interval
from conftest import DEVICE, assert_within_bound, device_name, gemm_bound, make_input
from kernels_triton import interpreting
from kernels_triton.hopper._route import TileConfig
from kernels_triton.hopper._fp8_decode import (FP8_BLOCK_SCALE, MX_SCALE, TENSOR_SCALE, hopper_config, launch_fp8_decode,
                                        mx_block_k)

FMT = {TENSOR_SCALE: "fp8_tensor", FP8_BLOCK_SCALE: "fp8_block", MX_SCALE: "mxfp8"}
GROUP = {TENSOR_SCALE: 32, FP8_BLOCK_SCALE: 128, MX_SCALE: 32}  # make_input's zero-block width


@pytest.fixture(autouse=True)
def _cpu_or_sm90():
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the decode kernel is sm_90 only (its fp8 accumulation bound is Hopper's); found {device_name()}")


def _tile(bn: int, bk: int, split: int) -> TileConfig:
    return TileConfig(16, bn, bk, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=split)


def _operands(scale_k: int, M: int, N: int, K: int):
    fmt = FMT[scale_k]
    w = formats.quantize(make_input((N, K), block=GROUP[scale_k]), fmt, role="weight")
    xq = formats.quantize(make_input((M, K), block=GROUP[scale_k]), fmt, role="activation")
    return xq, w


def _launch(xq, w, bias, cfg, scale_k, out_dtype=torch.float32):
    y = torch.empty(xq.rows, w.rows, dtype=out_dtype, device=w.data.device)
    return launch_fp8_decode(xq.data.contiguous(), w.data.contiguous(), xq.scale, w.scale, bias, y,
                             scale_k=scale_k, config=cfg)


def _bound(xq, w, bias, out_dtype, ref, scale_k):
    # the tiles here have BLOCK_K = 128 for per-tensor scales, so the runs are those of fp8_interval
    return gemm_bound(xq, w, bias, out_dtype, ref, fp8_interval=fp8_decode_interval(FMT[scale_k]))


# (scale_k, M, N, K, BLOCK_N, BLOCK_K, split, out_dtype). Per-tensor: K = 320 is 2.5 steps (the K
# mask). Block: N = 200 puts tile 2 in the second 128-row weight scale block and leaves a partial
# tile. MX: each K step width with K a multiple of it (no K mask there), 128 rows (MX_DECODE_TILE)
# and 64; splits that leave one step per program (K = 256, split 2) and uneven ranges (320 / 64 in 2).
CASES = [
    (TENSOR_SCALE, 5, 72, 320, 64, 128, 1, torch.float32),
    (TENSOR_SCALE, 16, 72, 320, 64, 128, 2, torch.bfloat16),
    (FP8_BLOCK_SCALE, 3, 200, 512, 64, 128, 1, torch.float32),
    (FP8_BLOCK_SCALE, 16, 200, 512, 64, 128, 3, torch.float16),
    (MX_SCALE, 7, 72, 256, 128, 128, 1, torch.float32),
    (MX_SCALE, 7, 72, 256, 128, 128, 2, torch.bfloat16),
    (MX_SCALE, 4, 40, 320, 64, 64, 1, torch.float32),
    (MX_SCALE, 16, 40, 320, 64, 64, 2, torch.float32),
    (MX_SCALE, 9, 40, 96, 64, 32, 1, torch.float16),
    (MX_SCALE, 1, 40, 96, 64, 32, 3, torch.float32),
]


@pytest.mark.parametrize("scale_k,M,N,K,bn,bk,split,out_dtype", CASES)
def test_decode_kernel_matches_oracle(scale_k, M, N, K, bn, bk, split, out_dtype):
    xq, w = _operands(scale_k, M, N, K)
    bias = make_input((N,), torch.float32, zero_blocks=False, outliers=False)
    cfg = _tile(bn, bk, split)
    y = _launch(xq, w, bias, cfg, scale_k, out_dtype)
    ref = formats.reference_linear(xq, w, bias, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    # without the bias the GEMM itself must be far from zero, or a kernel adding the bias alone passes
    assert formats.reference_linear(xq, w, out_dtype=torch.float32).abs().max().item() > 1.0
    assert_within_bound(y, ref, _bound(xq, w, bias, out_dtype, ref, scale_k), "decode")


@pytest.mark.parametrize("scale_k,bk", [(TENSOR_SCALE, 128), (FP8_BLOCK_SCALE, 128), (MX_SCALE, 64)])
def test_decode_kernel_e4m3_nan_codes(scale_k, bk):
    # the NaN code 0x7F in activation row 2 and 0xFF (-NaN) in weight row 7: exactly row 2 and column
    # 7 of y are NaN (the interpreter's own fp8 dot would read them as +-480), the rest matches
    M, N, K = 5, 40, 256
    xq, w = _operands(scale_k, M, N, K)
    xq.data.view(torch.uint8)[2, 37] = 0x7F
    w.data.view(torch.uint8)[7, 200] = 0xFF
    cfg = _tile(64, bk, 2)
    y = _launch(xq, w, None, cfg, scale_k)
    ref = formats.reference_linear(xq, w, out_dtype=torch.float32)
    nan = torch.zeros(M, N, dtype=torch.bool)
    nan[2], nan[:, 7] = True, True
    assert torch.equal(y.isnan().cpu(), nan) and torch.equal(ref.isnan().cpu(), nan)
    rows, cols = [i for i in range(M) if i != 2], [j for j in range(N) if j != 7]
    keep = lambda t: t.cpu()[rows][:, cols]  # noqa: E731
    assert_within_bound(keep(y), keep(ref), keep(_bound(xq, w, None, torch.float32, ref, scale_k)), "decode")


def test_decode_launch_refuses_an_unknown_scale_kind():
    # 64 would otherwise run the fp8_block arithmetic on whatever scales it was given
    xq, w = _operands(FP8_BLOCK_SCALE, 4, 8, 128)
    y = torch.empty(4, 8, device=w.data.device)
    for call in (lambda: launch_fp8_decode(xq.data, w.data, xq.scale, w.scale, None, y, scale_k=64),
                 lambda: hopper_config(4, 8, 128, w.data.device, scale_k=64)):
        with pytest.raises(ValueError, match=re.escape("scale_k must be one of (0, 128, 32)") + ".*got 64"):
            call()


@pytest.mark.parametrize("K", [48, 0, -32])
def test_mx_block_k_refuses_k_off_the_scale_blocks(K):
    # the wording of formats.validate's K check for mxfp8 ("a positive multiple of 32")
    with pytest.raises(ValueError, match=re.escape(f"mxfp8 needs K to be a positive multiple of 32, got K={K}")):
        mx_block_k(K)


@pytest.mark.parametrize("K,bk", [(32, 32), (96, 32), (64, 64), (320, 64), (128, 128), (1024, 128)])
def test_mx_block_k_takes_the_widest_step_dividing_k(K, bk):
    assert mx_block_k(K) == bk
