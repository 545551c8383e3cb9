"""kernels_triton.hopper.fp8_block: its sm_90 decode tile with split-K (the route on a described H200,
a pure function: runs anywhere). Its routes and linear: test_hopper_e4m3_routes.py; its kernels:
test_fp8_decode.py, test_fp8_prefill.py, test_twopass.py."""

from kernels_triton import hopper
from kernels_triton.hopper._fp8_decode import fp8_decode_config

FMT = "fp8_block"


def test_decode_tile_on_sm90():
    # the Hopper route (kernels_triton.hopper.fp8_block) at M <= 16, K >= 1024 takes the swapped
    # kernel with split-K on the H200's 132 SMs (a pure function: runs anywhere)
    n_sms = 132
    for (M, N, K), split in (((7, 200, 1024), 2), ((16, 128, 2048), 4), ((1, 200, 1024), 2)):
        r = hopper.module(FMT).route(M, N, K, capability=(9, 0), sm_count=n_sms)
        assert dict(r.options)["config"] == fp8_decode_config(M, N, K, n_sms)
        assert dict(r.options)["config"].SPLIT_K == split and r.split_k == split
