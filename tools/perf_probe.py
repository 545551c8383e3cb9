"""Knob probe for docs/perf_notes.md (GPU only): fp8_tensor max_num_imprecise_acc and tile at 8192^3,
and the split-K factor at decode (M = 16, N = K = 8192). Prints one line per variant."""
import torch
import triton
from triton.testing import do_bench

import formats
from kernels_triton import fp8_tensor, nvfp4
from kernels_triton.hopper import _twopass
from kernels_triton._common import TileConfig

torch.manual_seed(0)
dev = "cuda"
N = K = 8192


def fp8_variant(M, cfg, imprecise):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05
    xq, wq = fp8_tensor.quantize_activation(x), formats.quantize(w, "fp8_tensor")
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), 1)

    def run():
        fp8_tensor._gemm_kernel[grid](xq.data, wq.data, xq.scale, wq.scale, y, y, y, M, N, K, K,
                                      K, 1, K, 1, N, 1, HAS_BIAS=False, DOT_FP8=True, RNE_BF16=False,
                                      BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=8,
                                      SPLIT_K=1, IMPRECISE_ACC=imprecise, num_warps=cfg.num_warps,
                                      num_stages=cfg.num_stages)
    run()
    ref = (xq.data.float() @ wq.data.float().T) * xq.scale * wq.scale
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    ms = do_bench(run, warmup=50, rep=300)
    print(f"fp8_tensor M={M} {cfg} imprecise={imprecise}: {2*M*N*K/ms/1e9:.0f} TF/s  max-rel {err:.2e}", flush=True)


for cfg in (TileConfig(128, 256, 128, num_warps=8, num_stages=3), TileConfig(128, 256, 128, num_warps=8, num_stages=4),
            TileConfig(128, 128, 128, num_warps=8, num_stages=3)):
    for imp in (128, 256):
        try:
            fp8_variant(8192, cfg, imp)
        except Exception as e:  # noqa: BLE001
            print("fp8 variant failed", cfg, imp, repr(e)[:200])

# decode split-K sweep, nvfp4 gemm alone
x = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05
wq = formats.quantize(w, "nvfp4")
xq = nvfp4.quantize_activation(x)
from kernels_triton import _fp4_gemm  # noqa: E402
for bn in (32, 64, 128):
    for split in (1, 4, 8, 16):
        for bk in (128, 256):
            cfg = TileConfig(16, bn, bk, GROUP_M=1, num_warps=4, num_stages=3, SPLIT_K=split)
            f = lambda: _fp4_gemm.launch_fp4_gemm(  # noqa: E731
                xq.data, xq.scale.view(torch.uint8), wq.data, wq.scale.view(torch.uint8), M=16, N=N, K=K, group=16,
                scale_e4m3=True, bias=None, out_dtype=torch.bfloat16, gx=xq.global_scale.reshape(1),
                gw=wq.global_scale.reshape(1), config=cfg)
            try:
                g = torch.cuda.CUDAGraph()
                f()
                with torch.cuda.graph(g):
                    f()
                ms = do_bench(g.replay, warmup=20, rep=200)
                print(f"nvfp4 decode {cfg}: {ms*1e3:.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001
                print("nvfp4 variant failed", cfg, repr(e)[:200])
