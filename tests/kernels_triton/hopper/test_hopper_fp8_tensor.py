"""kernels_triton.hopper.fp8_tensor: its sm_90 decode tile (the route on a described H200, a pure
function: runs anywhere). Its routes and linear: test_hopper_e4m3_routes.py; its kernels:
test_fp8_decode.py, test_fp8_prefill.py, test_twopass.py."""

from kernels_triton import hopper
from kernels_triton.hopper._fp8_decode import TENSOR_DECODE_TILE, fp8_decode_config

FMT = "fp8_tensor"


def test_decode_tile_on_sm90():
    """The Hopper route's decode tile (kernels_triton.hopper.fp8_tensor, the H200's 132 SMs) is
    fp8_decode_config's with TENSOR_DECODE_TILE: 8 stages, split-K only while the 64-row tiles
    cover less than half the SMs. A pure function of the problem and the SM count: runs anywhere."""
    n_sms = 132
    for M, N, K in ((7, 200, 1024), (16, 128, 2048), (1, 8192, 8192), (16, 8192, 8192)):
        cfg = dict(hopper.module(FMT).route(M, N, K, capability=(9, 0), sm_count=n_sms).options)["config"]
        assert cfg == fp8_decode_config(M, N, K, n_sms, **TENSOR_DECODE_TILE)
        assert cfg.num_stages == 8
        tiles = -(-N // cfg.BLOCK_N)
        assert (cfg.SPLIT_K > 1) == (tiles < n_sms / 2), (M, N, K, cfg)
