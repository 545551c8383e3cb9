"""Checks shared by the tests of the e4m3 formats: the lessons' (tests/kernels_triton/test_fp8_tensor,
test_fp8_block, test_fp8_channel, test_mxfp8, ...) and the hopper modules' (tests/kernels_triton/hopper/),
so it sits in tests/, which pytest puts on sys.path for tests/conftest.py. Every check compares a
Triton result with the independent formats/ oracle."""

from __future__ import annotations

import pytest
import torch

import formats
from conftest import DEVICE, assert_within_bound, device_name, make_input, rel_err  # noqa: F401
from conftest import gemm_bound as _gemm_bound

# Tolerances on ||y - ref|| / ||ref||, ref = float64 product of the dequantized operands rounded
# once to the output dtype. The kernels accumulate exactly-representable products in fp32, so
# the error is the output rounding: bf16 (2^-9 relative per element) and fp16 (2^-12) give
# norm-wise ~1e-3 and ~2e-4 at most; the bounds are 4e-3 and 1e-3. fp32 output leaves
# only the fp32 accumulation (~1e-7 here).
TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-5}
# On a GPU, fp8_tensor and fp8_block dot the e4m3 tiles directly; Hopper's fp8 MMA keeps fewer
# accumulator bits than fp32 for the products inside one promotion interval (128 here), so fp32
# output there shows 1.2e-4 to 3.1e-4 (docs/results.md, the H200 runs). bf16/fp16 bounds unchanged.
FP8_DIRECT_DOT_FP32_TOL = 5e-4


def fp8_interval(fmt: str, M: int) -> int:
    """How many products the lesson GEMM sums on Hopper's fp8 MMA before an fp32 addition here (0:
    none, fp32 accumulation throughout): 128 for fp8_tensor / fp8_block on a GPU (their promotion
    interval); 0 for mxfp8, whose lesson kernel dots exact bf16 products in fp32."""
    if DEVICE != "cuda":
        return 0
    return 128 if fmt in ("fp8_tensor", "fp8_block", "fp8_channel") else 0


def fp8_decode_interval(fmt: str) -> int:
    """fp8_interval of _fp8_decode.launch_fp8_decode called directly (test_fp8_decode): 0 under the
    interpreter (fp32 decode), on a GPU 32 for MX scales (one partial per scale block), else 128."""
    if DEVICE != "cuda":
        return 0
    return 32 if fmt == "mxfp8" else 128


def fp8_mma(fmt: str, M: int) -> bool:
    """Whether the GEMM dots the e4m3 codes on Hopper's fp8 MMA here (fp8_interval above)."""
    return fp8_interval(fmt, M) > 0


def tolerance(out_dtype, fmt: str, M: int = 0) -> float:
    if out_dtype == torch.float32 and fp8_mma(fmt, M):
        return FP8_DIRECT_DOT_FP32_TOL
    return TOL[out_dtype]


def require_gpu():
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU; found {device_name()}")


def sm90_sm_count() -> int:
    """The SM count of the sm_90 GPU that the swapped decode kernel's tile tests need; skips,
    naming the device found, anywhere else."""
    require_gpu()
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        pytest.skip(f"the decode kernel is sm_90 only; found {device_name()} (sm_{cap[0]}{cap[1]})")
    return torch.cuda.get_device_properties(0).multi_processor_count


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (float scales compared bit for bit, not by value)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_quantization(q, o) -> None:
    """q (Triton) equals o (oracle): same container fields, codes and scales bit for bit."""
    assert (q.fmt, q.role, q.shape, q.block_shape, q.scale_layout) == (o.fmt, o.role, o.shape, o.block_shape, "linear")
    assert q.data.dtype == o.data.dtype and q.data.shape == o.data.shape
    assert q.scale.dtype == o.scale.dtype and q.scale.shape == o.scale.shape
    assert q.global_scale is None and o.global_scale is None
    assert q.data.device == o.data.device and q.scale.device == o.scale.device
    assert torch.equal(bits(q.data), bits(o.data)), "e4m3 codes differ from the oracle"
    assert torch.equal(bits(q.scale), bits(o.scale)), "scales differ from the oracle"


def check_quantize(mod, fmt: str, x: torch.Tensor, *, nonzero: bool = True, **opts):
    """Quantize x with the kernel and the oracle, assert bit equality; returns the oracle's result.
    ``nonzero``: also require some nonzero code, so that the comparison is not of zeros alone."""
    o = formats.quantize(x, fmt, role="activation", **opts)
    assert_same_quantization(mod.quantize_activation(x, **opts), o)
    if nonzero and o.data.numel() and bool((x != 0).any()):
        assert bool((bits(o.data) & 0x7F != 0).any()), "test input quantized to all zeros"
    return o


def make_weight(fmt: str, n: int, k: int, block: int, **opts):
    return formats.quantize(make_input((n, k), torch.bfloat16, block=block), fmt, role="weight", **opts)


def make_bias(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, dtype=torch.float32).to(dtype).to(DEVICE)


def gemm_bound(xq, qweight, bias, out_dtype, ref):
    """conftest.gemm_bound, with the fp8 MMA's accumulation where the kernel dots e4m3 codes (fp8_mma)."""
    return _gemm_bound(xq, qweight, bias, out_dtype, ref, fp8_interval=fp8_interval(qweight.fmt, xq.rows))


def check_gemm(mod, xq, qweight, bias, out_dtype):
    """mod.gemm on the oracle's operands vs formats.reference_linear on the same operands, element by
    element within gemm_bound."""
    y = mod.gemm(xq, qweight, bias, out_dtype=out_dtype)
    ref = formats.reference_linear(xq, qweight, bias, out_dtype=out_dtype)
    assert y.shape == ref.shape == (xq.rows, qweight.rows)
    assert y.dtype == out_dtype and y.device == ref.device
    if y.numel():
        assert ref.abs().max().item() > 0, "reference is all zeros: the comparison could not fail"
        assert_within_bound(y, ref, gemm_bound(xq, qweight, bias, out_dtype, ref), "gemm")
    return y


def check_linear(mod, x, qweight, bias, **opts):
    """mod.linear end to end vs formats.reference_linear(x, qweight, bias, **opts)."""
    y = mod.linear(x, qweight, bias, **opts)
    ref = formats.reference_linear(x, qweight, bias, **opts)
    assert y.shape == (*x.shape[:-1], qweight.rows) and y.dtype == x.dtype
    if y.numel():
        assert ref.abs().max().item() > 0
        # the activation quantization equals the oracle's bit for bit (tested apart), so the GEMM
        # bound applies to the oracle's quantized x
        act = {k: v for k, v in opts.items() if k != "path"}
        xq = formats.quantize(x.cpu(), qweight.fmt, role="activation", **act)
        ref2 = ref.reshape(-1, qweight.rows)
        assert_within_bound(y.reshape(-1, qweight.rows), ref2,
                            gemm_bound(xq, qweight, bias, x.dtype, ref2), "linear")
    return y


def strided_views(m: int, k: int, dtype, block: int):
    """Two non-contiguous [m, k] activations: every other column of [m, 2k], and a transpose."""
    every_other = make_input((m, 2 * k), dtype, block=block)[:, ::2]
    transposed = make_input((k, m), dtype, block=block, zero_blocks=False).t()
    assert not every_other.is_contiguous() and not transposed.is_contiguous()
    return every_other, transposed


def special_values(m: int, k: int, dtype, block: int) -> torch.Tensor:
    """Rows that stress the encoders: all zeros (with -0.0), tiny (bf16/fp16 subnormal scale),
    huge, mixed huge and tiny in one block, and ordinary values, repeated to m rows."""
    tiny = 1e-7 if dtype == torch.float16 else 1e-38
    huge = 2e4 if dtype == torch.float16 else 1e36  # |base| <= 3 keeps fp16 finite
    base = torch.randn(k).clamp(-3.0, 3.0)
    rows = [
        torch.zeros(k),
        -torch.zeros(k),
        base * tiny,
        base * huge,
        torch.where(torch.arange(k) % block == 0, base * huge / 8, base * tiny * 100),
        base,
    ]
    x = torch.stack([rows[i % len(rows)] for i in range(m)])
    return x.to(dtype).to(DEVICE)


def error_calls(mod, fmt: str, k: int, k_multiple: int, other_fmt: str):
    """(name, call, word the ValueError message must contain) for each argument error."""
    w = make_weight(fmt, 8, k, 32)
    x = make_input((4, k), torch.bfloat16, zero_blocks=False)
    xq = formats.quantize(x, fmt, role="activation")
    wrong_fmt = make_weight(other_fmt, 8, 128, 32)
    calls = [
        ("x_dtype", lambda: mod.linear(x.float(), w), "x must be bfloat16"),
        ("x_k_mismatch", lambda: mod.linear(make_input((4, k + 128)), w), "x.shape[-1]"),
        ("x_device", lambda: mod.linear(torch.empty(4, k, dtype=torch.bfloat16, device="meta"), w), "x must be on"),
        ("quantize_x_dtype", lambda: mod.quantize_activation(x.to(torch.int32)), "x must be"),
        ("bias_shape", lambda: mod.linear(x, w, torch.zeros(9, device=DEVICE)), "bias"),
        ("weight_format", lambda: mod.linear(make_input((4, 128)), wrong_fmt), "qweight"),
        ("weight_role", lambda: mod.linear(x, xq), "qweight"),
        ("gemm_xq_role", lambda: mod.gemm(w, w), "xq"),
        ("gemm_k_mismatch", lambda: mod.gemm(formats.quantize(make_input((4, k + 128)), fmt, role="activation"), w), "xq"),
        ("gemm_out_dtype", lambda: mod.gemm(xq, w, out_dtype=torch.int32), "out_dtype"),
        ("gemm_bias_dtype", lambda: mod.gemm(xq, w, torch.zeros(8, dtype=torch.int32, device=DEVICE)), "bias"),
    ]
    if k_multiple > 1:
        bad_k = k_multiple + k_multiple // 2
        calls.append(("x_k_not_multiple", lambda: mod.quantize_activation(make_input((4, bad_k))),
                      f"multiple of {k_multiple}"))
    return calls
