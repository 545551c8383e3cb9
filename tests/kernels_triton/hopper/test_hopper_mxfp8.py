"""kernels_triton.hopper.mxfp8: the host checks of the MX decode launch, the decode tile of both
decode kernels on a described H200 and the decode_kernel knob (pure functions and host checks: run
anywhere). Its routes and linear: test_hopper_e4m3_routes.py; its kernels: test_e4m3_decode.py,
test_e4m3_act_decoded.py, test_fp8_decode.py."""

import re

import pytest
import torch

import formats
from _e4m3_testlib import make_weight
from conftest import make_input
from kernels_triton import hopper
from kernels_triton.hopper._e4m3_decode import decode_tile
from kernels_triton.hopper._fp8_decode import MX_DECODE_TILE, MX_SCALE, fp8_decode_config, launch_fp8_decode

FMT = "mxfp8"
BLOCK = 32
BF16 = torch.bfloat16


def test_decode_launch_refuses_tiles_it_cannot_run():
    # host checks, made before any launch (so they run on the CPU too): the MX K loop reads one
    # step's scale bytes as one integer and has no K mask
    K = 320
    xq = formats.quantize(make_input((4, K)), FMT, role="activation")
    w = make_weight(FMT, 8, K, BLOCK)
    y = torch.empty(4, 8, dtype=BF16, device=w.data.device)
    for bk, word in ((128, "dividing K"), (256, "BLOCK_K in (32, 64, 128)")):
        with pytest.raises(ValueError, match=re.escape(word)):
            launch_fp8_decode(xq.data, w.data, xq.scale, w.scale, None, y, scale_k=MX_SCALE,
                              config=fp8_decode_config(4, 8, K, bk=bk))


def test_decode_tile_on_sm90():
    # the Hopper route (kernels_triton.hopper.mxfp8) at M <= 16 on the H200's 132 SMs, for both
    # decode kernels: the fp8 kernel's K step is the widest of 128 / 64 / 32 dividing K, the bf16
    # kernel's always 128 (a K mask for the rest), split-K while every split keeps >= 4 steps
    # (_e4m3_decode.decode_tile). A pure function of the problem and the SM count: runs anywhere.
    n_sms = 132
    fp8 = (((16, 1, 544), 32, 4), ((5, 72, 320), 64, 1), ((7, 200, 1024), 128, 2), ((16, 128, 2048), 128, 4))
    bf16 = (((16, 1, 544), 128, 1), ((5, 72, 320), 128, 1), ((7, 200, 1024), 128, 2), ((16, 128, 2048), 128, 4))
    for kernel, rows in (("bf16", bf16), ("fp8", fp8)):
        for (M, N, K), bk, split in rows:
            r = hopper.module(FMT).route(M, N, K, capability=(9, 0), sm_count=n_sms, decode_kernel=kernel)
            cfg = dict(r.options)["config"]
            want = (decode_tile(M, N, K, n_sms) if kernel == "bf16"
                    else fp8_decode_config(M, N, K, n_sms, **MX_DECODE_TILE, bk=bk))
            assert cfg == want
            assert (cfg.BLOCK_K, cfg.SPLIT_K) == (bk, split)


def test_decode_kernel_knob_is_checked():
    # the Hopper decode kernel is an argument (route, gemm, linear, tile_config), checked on the
    # host before anything else (every device)
    H = hopper.module(FMT)
    assert H.DECODE_KERNELS == ("bf16", "fp8")
    with pytest.raises(ValueError, match=re.escape("decode_kernel must be one of ('bf16', 'fp8'), got 'fast'")):
        H.route(4, 64, 256, capability=(9, 0), sm_count=132, decode_kernel="fast")
