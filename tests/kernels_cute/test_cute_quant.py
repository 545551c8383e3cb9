"""kernels_cute.quant (our CuTe DSL activation quantizers) against the formats oracle and Triton.

Two halves:

1. Compile-only, no GPU (CI): every quantizer program compiles for sm_120a and sm_121a (and sm_90a,
   the H200 the GPU half runs on), in one fresh subprocess with b12x made unimportable and
   CUTE_DSL_ARCH set to a different target (the explicit ``--gpu-arch`` option must win). The PTX
   must name the target, keep every IEEE division ``div.rn.f32`` (no ``div.approx``, ``div.full``,
   ``rcp.approx``), flush nothing (no ``.ftz``) and encode e4m3/e2m1 with the bit-arithmetic codecs
   (no ``cvt`` to e4m3/e2m1, which is what keeps the kernels off SM89+/SM100+ instructions).
2. On a CUDA GPU (marker ``gpu``; the H200 has no SM120 instruction to offer, and needs none): codes,
   scales and global scales equal the oracle's (run on a CPU copy, the specification; see
   tests/kernels_triton/test_nvfp4.py for why CPU) AND the Triton quantizers', bit for bit, on the
   Triton issue's grid: M in {0, 1, 3, 16, 100, 257}, K at one block, several blocks and a
   non-power-of-two multiple, bf16/fp16, each format option, strided and 3-D inputs, inputs with
   outliers and all-zero blocks, an all-zero tensor (MXFP8: E8M0 byte 19, the amax floor's);
   swizzled scales equal formats.swizzle_128x4 of the oracle's (padding included), and the
   kernels_cute adapters' quantize_activation equals the oracle in the layout their GEMM reads.

Modules: kernels_cute/quant/fp8_tensor.py, kernels_cute/quant/fp8_block.py, kernels_cute/quant/mxfp8.py,
kernels_cute/quant/nvfp4.py, kernels_cute/quant/mxfp4.py, kernels_cute/quant/_codecs.py, kernels_cute/quant/_launch.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, device_name, make_input

import formats

ROOT = Path(__file__).resolve().parents[2]
HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
BF16, FP16 = torch.bfloat16, torch.float16

needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
on_gpu = pytest.mark.skipif(
    DEVICE != "cuda" or not HAVE_CUTE,
    reason=f"needs a CUDA GPU and CuTe DSL; found {device_name()}, CuTe DSL "
           f"{'installed' if HAVE_CUTE else 'not installed'}")


# =============================================================================================
# 1. Compile-only (CPU, CI)
# =============================================================================================
COMPILE_ARCHES = ("sm_120a", "sm_121a", "sm_90a")

_COMPILE_SCRIPT = r"""
import json, os, sys, time
sys.modules["b12x"] = None  # any "import b12x" below raises: the quantizers must not need it
t0 = time.time()
from kernels_cute.quant import compile_all
stats = {"import_s": time.time() - t0}
out = sys.argv[1]
for arch in sys.argv[2:]:  # the target is the --gpu-arch option, so one process serves every arch
    t1 = time.time()
    progs = compile_all(arch, keep_ptx=True)
    stats[arch] = {"compile_s": time.time() - t1, "programs": len(progs)}
    os.makedirs(os.path.join(out, arch))
    for name, fn in progs.items():
        with open(os.path.join(out, arch, name + ".ptx"), "w") as f:
            f.write(fn.__ptx__)
print(json.dumps(stats))
"""

# PTX that must not appear: approximate or flushing arithmetic, and hardware fp8/fp4 conversions
FORBIDDEN_PTX = ("div.approx", "div.full", "rcp.approx", ".ftz", "e2m1x2", "cvt.rn.satfinite.e4m3x2",
                 "cvt.rn.e4m3x2")


@pytest.fixture(scope="module")
def compiled_ptx(tmp_path_factory):
    """{arch: {program name: PTX text}}, compiled in one fresh GPU-less subprocess."""
    if not HAVE_CUTE:
        pytest.skip("nvidia-cutlass-dsl (CuTe DSL) is not installed")
    root = tmp_path_factory.mktemp("cute_quant_ptx")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_100a", CUTE_DSL_DUMP_DIR=str(root),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    p = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(root), *COMPILE_ARCHES], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"compiling the quantizers failed:\n{p.stderr[-4000:]}"
    stats = json.loads(p.stdout.strip().splitlines()[-1])
    result = {}
    for arch in COMPILE_ARCHES:
        print(f"[cute quant] {arch}: {stats[arch]['programs']} programs in {stats[arch]['compile_s']:.1f} s")
        result[arch] = {f.stem: f.read_text() for f in (root / arch).glob("*.ptx")}
        assert len(result[arch]) == stats[arch]["programs"]
    print(f"[cute quant] import {stats['import_s']:.1f} s; wall {time.time() - start:.1f} s")
    return result


@needs_cute
@pytest.mark.parametrize("arch", COMPILE_ARCHES)
def test_every_quantizer_compiles_for_the_named_target(compiled_ptx, arch):
    progs = compiled_ptx[arch]
    # 2 amax + 5 formats x 2 dtypes + 8 option variants (kernels_cute.quant.compile_all)
    assert len(progs) == 20, sorted(progs)
    for name, ptx in progs.items():
        assert f".target {arch}" in ptx, f"{name}: PTX does not target {arch} (CUTE_DSL_ARCH=sm_100a must not win)"


@needs_cute
@pytest.mark.parametrize("arch", COMPILE_ARCHES)
def test_ptx_divides_exactly_and_uses_no_fp8_fp4_conversion(compiled_ptx, arch):
    for name, ptx in compiled_ptx[arch].items():
        for bad in FORBIDDEN_PTX:
            assert bad not in ptx, f"{name} ({arch}): PTX contains {bad!r}"
        if not name.startswith(("amax", "mxfp4_floor", "mxfp8_floor")):  # these divide as formats.base.ieee_div
            assert "div.rn.f32" in ptx, f"{name} ({arch}): no div.rn.f32 in the PTX"


# =============================================================================================
# 2. On a CUDA GPU: bit for bit against the oracle and Triton
# =============================================================================================
MS = (0, 1, 3, 16, 100, 257)
# K: one block, several blocks, a non-power-of-two multiple (fp8_tensor: any K; 1000 ends in a
# partial 128-column chunk)
KS = {"fp8_tensor": (128, 512, 1000), "fp8_block": (128, 512, 640), "mxfp8": (32, 256, 224),
      "mxfp4": (32, 256, 224), "nvfp4": (16, 256, 208)}
BLOCK = {"fp8_tensor": 128, "fp8_block": 128, "mxfp8": 32, "mxfp4": 32, "nvfp4": 16}  # zero-block width of the inputs
OPTS = {
    "fp8_tensor": ({}, {"scale": 0.0371}),
    "fp8_block": ({}, {"ue8m0": True}),
    "mxfp8": ({}, {"scale_rule": "floor"}),
    "mxfp4": ({}, {"scale_rule": "floor"}),
    "nvfp4": ({}, {"global_scale": 100.0}),
}
GRID = [(fmt, m, k, dtype, i) for fmt in KS for m in MS for k in KS[fmt] for dtype in (BF16, FP16)
        for i in range(len(OPTS[fmt]))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(q, ref, what: str) -> None:
    """q and ref (QuantizedTensor) hold the same codes, scales and global scale, bit for bit."""
    assert (q.fmt, q.role, q.shape, q.block_shape, q.scale_layout) == \
        (ref.fmt, ref.role, ref.shape, ref.block_shape, ref.scale_layout), what
    for field in ("data", "scale", "global_scale"):
        a, b = getattr(q, field), getattr(ref, field)
        if b is None:
            assert a is None, f"{what}: {field} should be None"
            continue
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), \
            f"{what}: {field} {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{what}: {field} differs"


def oracle(x, fmt, **opts):
    return formats.quantize(x.cpu(), fmt, role="activation", **opts)


def triton_q(x, fmt, **opts):
    return importlib.import_module(f"kernels_triton.{fmt}").quantize_activation(x, **opts)


def cute_q(x, fmt, **opts):
    from kernels_cute.quant import quantize_activation_cute

    return quantize_activation_cute(x, fmt, **opts)


def check_all_three(x, fmt, what, **opts):
    q = cute_q(x, fmt, **opts)
    assert q.data.device == x.device
    assert_same_bits(q, oracle(x, fmt, **opts), f"{what}: cute vs oracle")
    assert_same_bits(q, triton_q(x, fmt, **opts), f"{what}: cute vs triton")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt,m,k,dtype,opt", GRID)
def test_equals_oracle_and_triton_bit_for_bit(fmt, m, k, dtype, opt):
    opts = OPTS[fmt][opt]
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt} {m} {k} {dtype} {opt}".encode()))
    x = make_input((m, k), dtype, block=BLOCK[fmt], generator=g)
    check_all_three(x, fmt, f"{fmt} M={m} K={k} {dtype} {opts}", **opts)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", list(KS))
def test_strided_and_3d_inputs(fmt):
    k = KS[fmt][-1]
    g = torch.Generator().manual_seed(7)
    wide = make_input((100, 2 * k), BF16, block=BLOCK[fmt], generator=g)
    check_all_three(wide[:, k:], fmt, f"{fmt} row stride 2K")  # row stride 2K
    xt = make_input((k, 100), FP16, block=BLOCK[fmt], generator=g).t()  # column stride 100
    check_all_three(xt, fmt, f"{fmt} transposed")
    x3 = make_input((2, 50, k), BF16, block=BLOCK[fmt], generator=g)
    check_all_three(x3, fmt, f"{fmt} 3-D")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", list(KS))
def test_all_zero_tensor_gets_the_amax_floor(fmt):
    x = torch.zeros((3, KS[fmt][1]), dtype=BF16, device=DEVICE)
    check_all_three(x, fmt, f"{fmt} zeros")
    if fmt in ("mxfp8", "mxfp4"):
        # e = ceil(log2(2^-100 / max_elem)): -108 for 448 (byte 19), -102 for 6 (byte 25); b12x's
        # own MXFP8 quantizer writes byte 0 here (test_contract.py)
        byte = {"mxfp8": 19, "mxfp4": 25}[fmt]
        assert bool((cute_q(x, fmt).scale == byte).all())


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("g", [0.0, -1.0, float("inf"), float("nan")], ids=["zero", "negative", "inf", "nan"])
def test_bad_static_global_scale_tensor_becomes_nan_as_in_triton(g):
    """A tensor g is not read on the host; the kernel records NaN as the g it used (the codes are 0
    and the scales the NaN code 0x7F), so the GEMM's alpha = 1 / g_x is NaN, never 0 (g = Inf)."""
    x = make_input((5, 64), BF16, block=16, generator=torch.Generator().manual_seed(11))
    q = cute_q(x, "nvfp4", global_scale=torch.tensor(g, device=DEVICE))
    assert bool(q.global_scale.isnan())
    assert_same_bits(q, triton_q(x, "nvfp4", global_scale=torch.tensor(g, device=DEVICE)), f"g={g}: cute vs triton")
    assert bool(cute_q(x[:0], "nvfp4", global_scale=torch.tensor(g, device=DEVICE)).global_scale.isnan())  # no launch


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt,opts", [("mxfp8", {}), ("mxfp8", {"scale_rule": "floor"}),
                                      ("mxfp4", {}), ("mxfp4", {"scale_rule": "floor"}),
                                      ("nvfp4", {}), ("nvfp4", {"global_scale": 100.0})])
@pytest.mark.parametrize("m", (1, 100, 257))
def test_swizzled_scales_equal_the_oracle_swizzled(fmt, opts, m):
    k = KS[fmt][-1]
    x = make_input((m, k), BF16, block=BLOCK[fmt], generator=torch.Generator().manual_seed(m))
    q = cute_q(x, fmt, swizzled=True, **opts)
    ref = oracle(x, fmt, **opts)
    assert q.scale_layout == "swizzled_128x4"
    assert torch.equal(_bits(q.data), _bits(ref.data))
    assert torch.equal(_bits(q.scale), _bits(formats.swizzle_128x4(ref.scale))), "swizzled scales (or padding) differ"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", list(KS))
@pytest.mark.parametrize("m", (1, 257))
def test_kernels_cute_adapter_quantizes_as_the_oracle_in_the_gemm_layout(fmt, m):
    """kernels_cute.<fmt>.quantize_activation == the oracle, scales swizzled where the b12x GEMM
    reads them swizzled (mxfp8 / nvfp4 / mxfp4); this path imports no b12x."""
    mod = importlib.import_module(f"kernels_cute.{fmt}")
    k = 256 if fmt != "fp8_tensor" else 1000
    x = make_input((m, k), FP16, block=BLOCK[fmt], generator=torch.Generator().manual_seed(3))
    ref = oracle(x, fmt)
    if fmt in ("mxfp8", "nvfp4", "mxfp4"):
        ref = dataclasses.replace(ref, scale=formats.swizzle_128x4(ref.scale), scale_layout="swizzled_128x4")
    assert_same_bits(mod.quantize_activation(x), ref, f"kernels_cute.{fmt} adapter")


# =============================================================================================
# Argument checks (any machine with CuTe DSL; they raise before anything is launched)
# =============================================================================================
@needs_cute
@pytest.mark.parametrize("call,match", [
    (lambda q: q(torch.zeros(2, 128, dtype=BF16), "fp4"), "fmt must be one of"),
    (lambda q: q(torch.zeros(2, 128, dtype=BF16), "nvfp4", scale=1.0), "unknown"),
    (lambda q: q(torch.zeros(2, 128, dtype=torch.float32), "nvfp4"), "bfloat16 or float16"),
    (lambda q: q(torch.zeros(2, 100, dtype=BF16), "fp8_block"), "multiple of 128"),
    (lambda q: q(torch.zeros(2, 48, dtype=BF16), "mxfp8"), "multiple of 32"),
    (lambda q: q(torch.zeros(2, 128, dtype=BF16), "mxfp4", scale_rule="round"), "scale_rule"),
    (lambda q: q(torch.zeros(2, 128, dtype=BF16), "mxfp8", scale_rule="round"), "scale_rule"),
    (lambda q: q(torch.zeros(2, 128, dtype=BF16), "nvfp4"), "CUDA"),
])
def test_bad_arguments_raise_value_error(call, match):
    from kernels_cute.quant import quantize_activation_cute

    with pytest.raises(ValueError, match=match):
        call(quantize_activation_cute)
