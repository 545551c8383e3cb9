"""The two-kernel launch paths of every format (kernels_triton/hopper/_twopass.py), forced on small shapes
so that they run under the interpreter too: split-K (fp32 workspace + ordered reduction, the
epilogue in the reduction) and the decode pre-pass + plain GEMM. On a GPU the tile tables pick
them only for decode-sized M (split-K) and large M (pre-pass); here every format takes each path
on shapes with a K tail, a partial N tile and a bias, against the oracle at the usual tolerances.
The forced tile goes straight to the GEMM that launches these paths: the Hopper modules' (e4m3
formats: kernels_triton.hopper.<fmt>, whose split-K / pre-pass GEMM runs under the interpreter too)
and _fp4_gemm's (FP4)."""

from __future__ import annotations

import pytest
import torch

import formats
from _e4m3_testlib import make_bias, tolerance
from conftest import DEVICE, make_input, rel_err
from kernels_triton import _common, fp8_block, fp8_tensor, hopper, interpreting, module
from kernels_triton.hopper import _fp4_gemm, _twopass
from kernels_triton.hopper._route import TileConfig

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP4 = ("nvfp4", "mxfp4")
# (fmt, block_k, K): fp8_block needs BLOCK_K = 128; 3 or 5 K tiles leave uneven splits
CASES = [("fp8_tensor", 64, 320), ("fp8_block", 128, 640), ("mxfp8", 64, 320), ("nvfp4", 64, 320), ("mxfp4", 64, 320)]


def _lesson_gemm(fmt, xq, w, bias, out_dtype, cfg: TileConfig) -> torch.Tensor:
    """y [M, N] of fmt's split-K or pre-pass GEMM (as cfg says) launched with cfg."""
    M, N, K = xq.shape[0], w.shape[0], w.shape[1]
    if fmt in FP4:
        nv = fmt == "nvfp4"
        gx, gw = (xq.global_scale.reshape(1).float(), w.global_scale.reshape(1).float()) if nv else (None, None)
        return _fp4_gemm.launch_fp4_gemm(
            xq.data.contiguous(), xq.scale.contiguous().view(torch.uint8), w.data.contiguous(),
            w.scale.contiguous().view(torch.uint8), M=M, N=N, K=K, group=16 if nv else 32, scale_e4m3=nv,
            bias=bias, out_dtype=out_dtype, gx=gx, gw=gw, config=cfg)
    y = torch.empty((M, N), dtype=out_dtype, device=w.data.device)
    return hopper.module(fmt)._run_gemm("prepass" if cfg.PREPASS else "portable", cfg, xq, w, bias, y)


def _check(fmt, M, N, K, bias, out_dtype, cfg: TileConfig):
    w = formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")
    xq = formats.quantize(make_input((M, K)), fmt, role="activation")
    y = _lesson_gemm(fmt, xq, w, bias, out_dtype, cfg)
    ref = formats.reference_linear(xq, w, bias, out_dtype=out_dtype)
    assert y.shape == ref.shape and y.dtype == out_dtype
    err = rel_err(y, ref)
    assert err <= tolerance(out_dtype, fmt), f"{fmt}: rel err {err:.3e}"


@pytest.mark.parametrize("fmt,block_k,K", CASES)
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_matches_reference(fmt, block_k, K, split):
    cfg = TileConfig(16, 32, block_k, GROUP_M=1, num_warps=4, num_stages=1 if interpreting() else 3, SPLIT_K=split)
    n_split, k_per = _twopass.splitk_plan(K, cfg)
    assert n_split > 1 and k_per % block_k == 0
    _check(fmt, 5, 40, K, make_bias(40).to(DEVICE), BF16, cfg)
    _check(fmt, 17, 33, K, None, FP32, cfg)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("out_dtype", [BF16, FP16])
def test_prepass_matches_reference(fmt, out_dtype):
    cfg = TileConfig(32, 32, 64, GROUP_M=2, num_warps=4, num_stages=1 if interpreting() else 3, PREPASS=True)
    _check(fmt, 37, 48, 320, make_bias(48).to(DEVICE), out_dtype, cfg)


def test_prepass_w4a16_bf16():
    cfg = TileConfig(32, 32, 64, GROUP_M=2, num_warps=4, num_stages=1 if interpreting() else 3, PREPASS=True)
    w = formats.quantize(make_input((48, 256)) * 0.05, "mxfp4", role="weight")
    x = make_input((37, 256), BF16).to(DEVICE)
    y = _fp4_gemm.launch_fp4_gemm(x, None, w.data.contiguous(), w.scale.contiguous().view(torch.uint8), M=37, N=48,
                                  K=256, group=32, scale_e4m3=False, bias=None, out_dtype=BF16, a16=True, config=cfg)
    ref = (x.double() @ formats.dequantize(w, torch.float64).T).to(BF16)
    assert rel_err(y, ref) <= tolerance(BF16, "mxfp4")


def test_split_k_plan_covers_k_once():
    for K in (128, 320, 8192, 8192 + 64):
        for split in (1, 2, 3, 8, 64):
            n, per = _twopass.splitk_plan(K, TileConfig(16, 64, 64, SPLIT_K=split))
            covered = [k for s in range(n) for k in range(s * per, min(K, (s + 1) * per))]
            assert covered == list(range(K)) and per % 64 == 0


def test_tile_config_is_exposed():
    for fmt in ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4"):
        assert isinstance(module(fmt).tile_config(16, 8192, 8192), _common.TileConfig)
    assert fp8_tensor.tile_config(16, 64, 128).BLOCK_K and fp8_block.tile_config(1, 64, 128).BLOCK_K == 128
