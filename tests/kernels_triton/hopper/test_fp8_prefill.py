"""kernels_triton.hopper._fp8_prefill (the sm_90 TMA prefill kernel of fp8_tensor and fp8_block) against
the formats/ oracle. The kernel runs under the interpreter on the CPU (host tensor descriptors,
codes decoded to fp32) with small tiles, and on a GPU with the shipped tiles; its sm_90 build is
checked on the CPU (tools/probes/h200_prefill_probe.py --compile: TMA copies in the PTX, two CTAs per SM
by shared memory, no spills)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import formats
from _e4m3_testlib import check_gemm, gemm_bound, make_bias, make_weight, sm90_sm_count
from conftest import DEVICE, assert_within_bound, make_input
from kernels_triton import fp8_block, fp8_tensor, hopper
from kernels_triton import interpreting
from kernels_triton.hopper._route import TileConfig
from kernels_triton.hopper._fp8_prefill import (BLOCK_PREFILL_TILE, TENSOR_PREFILL_TILE, launch_fp8_prefill,
                                         fp8_prefill_applies, tma_ok)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOOL = Path(__file__).resolve().parents[3] / "tools" / "probes" / "h200_prefill_probe.py"
# small tiles under the interpreter (a program costs ms of Python there); the shipped ones on a GPU
SMALL = {0: TileConfig(32, 32, 64, GROUP_M=2), 128: TileConfig(32, 64, 128, GROUP_M=2)}


def _tile(scale_k):
    return SMALL[scale_k] if interpreting() else None


def _operands(fmt, M, N, K):
    w = make_weight(fmt, N, K, 32)
    xq = formats.quantize(make_input((M, K)), fmt, role="activation")
    return xq, w


# (fmt, M, N, K, bias, out_dtype): M and N tails (not multiples of the tile), fp8_tensor K tails
# (K % BLOCK_K != 0: the descriptors read zeros past K), several K steps, every output dtype
CASES = [
    ("fp8_tensor", 70, 50, 208, True, BF16),
    ("fp8_tensor", 33, 70, 272, False, FP32),
    ("fp8_block", 70, 200, 384, True, FP16),
    ("fp8_block", 40, 64, 256, False, FP32),
]


@pytest.mark.parametrize("fmt,M,N,K,has_bias,out_dtype", CASES)
def test_prefill_kernel_matches_oracle(fmt, M, N, K, has_bias, out_dtype):
    scale_k = 128 if fmt == "fp8_block" else 0
    if not interpreting():  # GPU: the shipped tiles, with M above one tile and a partial last one
        M, N = M + 300, N + 100
    xq, w = _operands(fmt, M, N, K)
    bias = make_bias(N) if has_bias else None
    y = torch.empty((M, N), dtype=out_dtype, device=DEVICE)
    launch_fp8_prefill(xq.data, w.data, xq.scale, w.scale, bias, y, scale_k=scale_k, config=_tile(scale_k))
    ref = formats.reference_linear(xq, w, bias, out_dtype=out_dtype)
    assert ref.abs().max().item() > 0, "reference is all zeros: the comparison could not fail"
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, out_dtype, ref), f"{fmt} prefill")


def test_prefill_applies_the_block_scales():
    # The comparison can fail: doubling one weight block's scales moves that block's columns only.
    xq, w = _operands("fp8_block", 40, 256, 256)
    s = w.scale.clone()
    s[1] *= 2
    w2 = dataclasses.replace(w, scale=s)
    y = torch.empty((40, 256), dtype=FP32, device=DEVICE)
    launch_fp8_prefill(xq.data, w2.data, xq.scale, w2.scale, None, y, scale_k=128, config=_tile(128))
    before = formats.reference_linear(xq, w, out_dtype=FP32)
    ref = formats.reference_linear(xq, w2, out_dtype=FP32)
    assert_within_bound(y, ref, gemm_bound(xq, w2, None, FP32, ref), "fp8_block prefill")
    off = (y.double().cpu() - before.double().cpu()).abs() > gemm_bound(xq, w, None, FP32, before)
    assert not off[:, :128].any() and off[:, 128:].double().mean() > 0.5  # most elements moved


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose base is one byte past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    v = flat[1:1 + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def test_tma_rule_and_errors():
    xq, w = _operands("fp8_tensor", 8, 16, 64)
    assert tma_ok(xq.data) and tma_ok(w.data)
    assert not tma_ok(_misaligned(xq.data))
    assert not tma_ok(formats.quantize(make_input((8, 200)), "fp8_tensor", role="activation").data)  # 200 B rows
    y = torch.empty((8, 16), dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="scale_k"):
        launch_fp8_prefill(xq.data, w.data, xq.scale, w.scale, None, y, scale_k=32)
    with pytest.raises(ValueError, match="x must be 2-D with unit column stride"):
        launch_fp8_prefill(_misaligned(xq.data), w.data, xq.scale, w.scale, None, y)
    with pytest.raises(ValueError, match="split-K"):
        launch_fp8_prefill(xq.data, w.data, xq.scale, w.scale, None, y, config=TileConfig(64, 64, 64, SPLIT_K=2))
    bq, bw = _operands("fp8_block", 8, 16, 128)
    with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
        launch_fp8_prefill(bq.data, bw.data, bq.scale, bw.scale, None, y, scale_k=128,
                           config=TileConfig(64, 256, 128))


@pytest.mark.parametrize("mod,fmt", [(fp8_tensor, "fp8_tensor"), (fp8_block, "fp8_block")])
def test_gemm_falls_back_on_a_misaligned_operand(mod, fmt):
    # at prefill M on sm_90 this is the lesson kernel (fp8_prefill_applies is False); elsewhere the
    # usual route: the result is the oracle's either way
    xq, w = _operands(fmt, 300, 72, 256)
    xm = dataclasses.replace(xq, data=_misaligned(xq.data))
    assert not fp8_prefill_applies(xm.data, w.data, w.data.device)
    check_gemm(mod, xm, w, make_bias(72), BF16)


def test_prefill_tile_on_sm90():
    """The Hopper route at M > 256 (kernels_triton.hopper, a pure function: checked anywhere) takes the
    TMA kernel with its tiles; fp8_tensor with K not a multiple of 16 keeps the fp8 tl.dot GEMM's
    8-warp, 4-stage tile (TMA needs 16-byte rows). On sm_90, fp8_prefill_applies agrees."""
    def cfg(fmt, M, N, K):
        r = hopper.module(fmt).route(M, N, K, capability=(9, 0), sm_count=132)
        return r.kernels[-1], dict(r.options)["config"]
    assert cfg("fp8_tensor", 4096, 8192, 8192) == ("fp8_prefill_kernel", TENSOR_PREFILL_TILE)
    assert cfg("fp8_block", 4096, 8192, 8192) == ("fp8_prefill_kernel", BLOCK_PREFILL_TILE)
    assert cfg("fp8_tensor", 257, 200, 200) == ("_gemm_kernel", TileConfig(128, 128, 128, GROUP_M=8, num_warps=8,
                                                                            num_stages=4))
    sm90_sm_count()
    xq, w = _operands("fp8_tensor", 300, 64, 256)
    assert fp8_prefill_applies(xq.data, w.data, w.data.device)


@pytest.mark.slow
def test_sm90_build_uses_tma_and_fits_two_ctas_per_sm(tmp_path):
    from _sm90_build import run_sm90_build

    out = tmp_path / "compile.json"
    run_sm90_build([TOOL, "--compile", "--json", out], tmp_path)
    rows = {r["tile"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {f"fp8_tensor {TENSOR_PREFILL_TILE}", f"fp8_block {BLOCK_PREFILL_TILE}"}
    for name, r in rows.items():
        assert r["tma_copies"] > 0, f"{name}: no cp.async.bulk.tensor in the PTX"
        # fp8_tensor's 128 x 128 tile sits at the 255-register limit: Triton 3.9 builds it with no
        # stack, Triton 3.6 (the H200) with 120 bytes of it, and that build ran at 1054 TFLOP/s
        # (docs/perf_notes.md, row 23); a larger spill would be a new build to measure
        assert r["stack_bytes"] <= 128 and r["local_bytes"] == 0, f"{name}: spills ({r})"
        # 228 KB of shared memory per SM, 1 KB of it reserved per CTA: two CTAs must fit
        assert 2 * (r["shared_bytes"] + 1024) <= 228 * 1024, f"{name}: {r['shared_bytes']} B leave one CTA per SM"
        # two CTAs of 128 threads in the 64 K registers of an SM
        assert r["registers"] * 128 * 2 <= 65536, f"{name}: {r['registers']} registers per thread"
