"""Programmatic dependent launch (kernels_triton/hopper/_pdl.py): the switch, the PTX, and on a GPU of
sm_90 or later that the whole decode linear of every format gives the same bits with PDL on as off,
eagerly and replayed from a CUDA graph (PDL changes when a grid starts, never what it computes:
every chain kernel waits for its predecessor before its first global access)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import formats
from conftest import device_name, make_input
import kernels_triton as kt
from dispatch.registry import VARIANTS
from kernels_triton import interpreting

from kernels_triton.hopper import _pdl

ROOT = Path(__file__).resolve().parents[3]


def test_pdl_never_applies_on_cpu_tensors():
    assert _pdl.pdl_launch("cpu") == {"USE_PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_bad_b12x_pdl_value_names_the_variable_the_value_and_the_allowed_set(monkeypatch, value):
    monkeypatch.setenv("B12X_PDL", value)
    with pytest.raises(ValueError, match=rf"B12X_PDL='{value}' is not allowed; allowed: 0 \(off\) or 1"):
        _pdl.pdl_enabled("cpu")


_PTX_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_triton.hopper import _twopass
sig = {"ws_ptr": "*fp32", "y_ptr": "*bf16", "s1_ptr": "*fp32", "s2_ptr": "*fp32", "bias_ptr": "*fp32",
       "M": "i32", "N": "i32", "stride_ym": "i32"}
consts = dict(SPLIT_K=2, ALPHA_MODE=1, HAS_BIAS=False, ROUND_BF16=False, BLOCK_M=16, BLOCK_N=256)
for use_pdl in (False, True):
    src = ASTSource(fn=_twopass.splitk_reduce_kernel, signature={**sig, **{k: "constexpr" for k in consts}, "USE_PDL": "constexpr"},
                    constexprs={**consts, "USE_PDL": use_pdl})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=use_pdl)).asm["ptx"]
    lines = [l.strip() for l in ptx.splitlines()]
    def at(word):
        return next((i for i, l in enumerate(lines) if word in l), -1)
    print(use_pdl, at("griddepcontrol.wait"), at("ld.global"), at("griddepcontrol.launch_dependents"), at("st.global"))
"""


def test_sm90_ptx_waits_before_the_first_load_and_releases_before_the_stores():
    """Compile-only (no GPU): splitk_reduce_kernel for sm_90 with USE_PDL holds griddepcontrol.wait
    before its first global load and launch_dependents before its store; without it, neither."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r.split()[0]: [int(v) for v in r.split()[1:]] for r in out.stdout.splitlines() if r[:4] in ("True", "Fals")}
    wait, load, release, store = rows["True"]
    assert 0 <= wait < load and 0 <= release < store, rows
    assert rows["False"][0] == -1 and rows["False"][2] == -1, rows


# ---------------------------------------------------------------------------------------------
# GPU: PDL on and off give the same bits, eagerly and from a CUDA graph
# ---------------------------------------------------------------------------------------------
_CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() and not interpreting() else None
needs_pdl_gpu = pytest.mark.skipif(_CAP is None or _CAP[0] < 9,
                                   reason=f"PDL needs a CUDA GPU of sm_90 or later; found {device_name()}")

# (variant, format, linear(x, w)): the whole decode linear of every variant of the registry; on
# sm_90 the e4m3 formats' production linear is kernels_triton.hopper's (the lessons take no PDL)
_HOPPER_FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "fp8_channel")


def _linear(v):
    if v.fmt in _HOPPER_FORMATS and _CAP is not None and tuple(_CAP) == (9, 0):
        from kernels_triton import hopper
        return hopper.module(v.fmt).linear
    return (lambda x, w: kt.linear(x, w, a16=True)) if v.a16 else kt.linear


LINEARS = [(v.name, v.fmt, _linear(v)) for v in VARIANTS.values()]


def _run(fn, monkeypatch, pdl: str, graph: bool) -> torch.Tensor:
    monkeypatch.setenv("B12X_PDL", pdl)
    if not graph:
        return fn().clone()
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return y.clone()


@needs_pdl_gpu
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("name,fmt,linear", LINEARS, ids=[n for n, _, _ in LINEARS])
def test_decode_linear_is_bit_identical_with_pdl_on_and_off(monkeypatch, name, fmt, linear, M):
    N, K = 1024, 2048  # split-K in every format's decode GEMM (the reduction joins the chain)
    w = formats.quantize(make_input((N, K)) * 0.05, fmt, role="weight")
    # two linears back to back, the second reading the first's output: a kernel that started
    # before its predecessor's writes landed would read stale values
    x = make_input((M, K))
    w2 = formats.quantize(make_input((K, N)) * 0.05, fmt, role="weight")  # [K, N]: reads y [M, N]

    def chain():
        return linear(linear(x, w), w2)

    ref = _run(chain, monkeypatch, "0", graph=False)
    assert torch.isfinite(ref).all()
    for graph in (False, True):
        y = _run(chain, monkeypatch, "1", graph)
        assert torch.equal(y, ref), f"{name} M={M} graph={graph}: max |diff| {(y.float() - ref.float()).abs().max()}"


def _pdl_kernels():
    """Every Triton kernel of kernels_triton that takes USE_PDL (what pdl_launch launches)."""
    import importlib
    import pkgutil

    import triton

    import kernels_triton
    import kernels_triton.hopper

    found = {}
    for pkg, prefix in ((kernels_triton, ""), (kernels_triton.hopper, "hopper.")):
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name == "_pdl" or info.ispkg:  # the helpers themselves take USE_PDL
                continue
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for name, obj in vars(mod).items():
                # JITFunction on a GPU, InterpretedFunction under the interpreter: both KernelInterface
                if isinstance(obj, triton.runtime.jit.KernelInterface) and "USE_PDL" in getattr(obj, "arg_names", ()) \
                        and obj.fn.__module__ == mod.__name__:
                    found[f"{prefix}{info.name}.{name}"] = obj
    return found


PDL_KERNELS = _pdl_kernels()


def test_the_decode_chain_kernels_take_part():
    names = set(PDL_KERNELS)
    for k in ("hopper._fp8_decode.fp8_decode_gemm_kernel", "hopper._fp4_decode.fp4_decode_gemm_kernel",
              "hopper._fp4_decode.act_planes_kernel", "hopper._e4m3_decode.act_decoded_kernel",
              "hopper._twopass.splitk_reduce_kernel", "hopper.fp8_tensor._quantize_kernel",
              "hopper._nvfp4_quant._quantize_kernel", "hopper.mxfp4._quantize_kernel",
              "hopper.fp8_channel._row_amax_kernel", "hopper.fp8_channel._quantize_kernel"):
        assert k in names, (k, sorted(names))
    assert len(names) >= 10, sorted(names)


@pytest.mark.parametrize("name", sorted(PDL_KERNELS))
def test_every_pdl_kernel_waits_before_its_first_global_access_in_the_source(name):
    """Source order (the rule of kernels_triton/hopper/_pdl.py): the pdl_wait line comes before every
    tl.load / tl.store / atomic in the kernel body, so no access overlaps the predecessor's writes.
    (The PTX check above confirms the compiled order for one kernel.)"""
    import inspect

    src = inspect.getsource(PDL_KERNELS[name].fn).splitlines()
    body = src[next(i for i, l in enumerate(src) if l.rstrip().endswith("):")) + 1:]
    wait = next((i for i, l in enumerate(body) if "pdl_wait(USE_PDL)" in l), None)
    assert wait is not None, f"{name} has no pdl_wait(USE_PDL)"
    access = [i for i, l in enumerate(body) if any(w in l for w in ("tl.load(", "tl.store(", "tl.atomic_"))]
    assert not access or wait < access[0], f"{name}: line {access[0]} accesses memory before pdl_wait (line {wait})"
