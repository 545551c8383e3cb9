"""The six lessons (one per format) as lessons: one skeleton with one set of names in one order,
imports that stay inside the lessons' support (never kernels_triton.tuning, never hopper/), and the
tuned tiles that come in from outside through ``tile=`` / ``quant_tile=`` (kernels_triton.tuning)
and nowhere else.

The import and skeleton checks read the source (ast), so they hold whatever runs; the tile checks
run the kernels under the interpreter (or on the GPU there is) against the float64 oracle with the
bound of conftest.gemm_bound (exact products, fp32 sums, one rounding to the output dtype).

Modules: the six lessons (kernels_triton/fp8_tensor.py, fp8_channel.py, fp8_block.py, mxfp8.py,
nvfp4.py, mxfp4.py), their support kernels_triton/_common.py and kernels_triton/_codecs.py.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input

import formats
import kernels_triton
from formats import FORMAT_NAMES, spec
from kernels_triton import _codecs, _common, record_launches, tuning

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kernels_triton"
LESSONS = FORMAT_NAMES
# What a lesson may import from its own package: the codecs and the shared support, nothing else
# (no other lesson, not tuning, not hopper).
SUPPORT = {"_codecs", "_common"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _package_imports(path: Path) -> set[str]:
    """The kernels_triton modules a file imports (relative or absolute), as names under the package."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import ... / from . import x
                out |= {node.module} if node.module else {a.name for a in node.names}
            elif node.level == 0 and (node.module or "").startswith("kernels_triton"):
                rest = node.module.removeprefix("kernels_triton").lstrip(".")
                out |= {rest} if rest else {a.name for a in node.names}
            elif node.level > 1:
                out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("kernels_triton.") for a in node.names if a.name.startswith("kernels_triton")}
    return out


@pytest.mark.parametrize("fmt", LESSONS)
def test_lesson_imports_only_the_codecs_and_the_shared_support(fmt):
    """A lesson imports _codecs and _common of its package and nothing else of it: not tuning (the
    tuned tables come in as tile=), not hopper (sm_90 production code), not another lesson."""
    imported = _package_imports(PKG / f"{fmt}.py")
    assert imported <= SUPPORT, f"{fmt}.py imports {sorted(imported - SUPPORT)} of kernels_triton"


@pytest.mark.parametrize("name", sorted(SUPPORT))
def test_shared_support_imports_no_lesson_tuning_hopper_or_the_package(name):
    """The support a lesson reads imports only the codecs below it: not the package __init__ (which
    imports it back), not tuning, not hopper, not a lesson."""
    imported = _package_imports(PKG / f"{name}.py")
    assert imported <= {"_codecs"} - {name}, f"{name}.py imports {sorted(imported)}"


def test_the_import_check_sees_the_imports_it_forbids(tmp_path):
    """The parser above finds the forms a lesson could use to reach tuning or hopper."""
    src = tmp_path / "x.py"
    src.write_text("from .tuning import tiles\nfrom . import hopper\nimport kernels_triton.hopper.nvfp4\n"
                   "from kernels_triton._common import Route\nfrom ._codecs import encode_e2m1\n")
    assert _package_imports(src) == {"tuning", "hopper", "hopper.nvfp4", "_common", "_codecs"}


# The skeleton: every lesson defines these, top to bottom in this order (<fmt>_ is the format's name;
# the amax kernel only where the activation scale is per tensor; gemm_w4a16 / gemm_w8a16 only with a
# weight-only mode).
SKELETON = ("{fmt}_quantize_tile", "_amax_partials_kernel?", "_quantize_kernel", "{fmt}_dequantize_tile",
            "_portable_gemm_kernel", "_native_gemm_kernel", "tile_config", "_plan", "route", "_quantize",
            "_launch_gemm", "quantize_activation", "gemm", "gemm_w4a16?", "gemm_w8a16?", "linear",
            "linear_unchecked")
JIT_PUBLIC = ("{fmt}_quantize_tile", "{fmt}_dequantize_tile")


def _definitions(fmt: str) -> list[str]:
    return [n.name for n in _tree(PKG / f"{fmt}.py").body if isinstance(n, ast.FunctionDef)]


@pytest.mark.parametrize("fmt", LESSONS)
def test_every_lesson_has_the_skeleton_in_order(fmt):
    defs = _definitions(fmt)
    want = []
    for name in SKELETON:
        name = name.format(fmt=fmt)
        optional = name.endswith("?")
        name = name.rstrip("?")
        if optional and name not in defs:
            continue
        assert name in defs, f"{fmt}.py defines no {name}"
        want.append(name)
    assert [d for d in defs if d in want] == want, f"{fmt}.py: skeleton out of order: {defs}"
    # the optional pieces are there exactly where the format needs them: the amax kernel where the
    # activation has a dynamic per-tensor value (fp8_tensor's scale, nvfp4's global scale)
    q = formats.quantize(torch.ones(1, 128), fmt, role="activation")
    per_tensor = spec(fmt).activation_block is None or q.global_scale is not None
    assert ("_amax_partials_kernel" in defs) == per_tensor
    a16 = fmt in _common.A16_FORMATS
    assert ("gemm_w4a16" in defs, "gemm_w8a16" in defs) == (a16 and spec(fmt).element == "e2m1",
                                                             a16 and spec(fmt).element == "e4m3")
    mod = kernels_triton.module(fmt)
    for name in JIT_PUBLIC:
        assert isinstance(getattr(mod, name.format(fmt=fmt)), triton.runtime.KernelInterface), name


def test_the_skeleton_check_catches_a_missing_or_misplaced_name(monkeypatch):
    """The order check fails on a lesson whose definitions are out of order or missing."""
    real = _definitions("mxfp4")
    swapped = list(real)
    i, j = swapped.index("route"), swapped.index("_plan")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    for broken in (swapped, [d for d in real if d != "linear_unchecked"]):
        monkeypatch.setattr(sys.modules[__name__], "_definitions", lambda fmt, b=broken: b)
        with pytest.raises(AssertionError):
            test_every_lesson_has_the_skeleton_in_order("mxfp4")


# ---------------------------------------------------------------------------------------------
# Tiles come in through tile= / quant_tile=
# ---------------------------------------------------------------------------------------------
SM12X = ((12, 0), (12, 1))


@pytest.mark.parametrize("cap", SM12X, ids=str)
@pytest.mark.parametrize("fmt", LESSONS)
def test_tuned_tiles_reach_the_route_on_described_sm12x_devices(fmt, cap):
    """On an SM12x (described) the route with tuning.tiles reports the SM12x table's tile of the
    path the lesson takes; without them it reports the lesson's own default (64 x 64)."""
    for M in (1, 16, 17, 64, 65, 300, 4096):
        t = tuning.tiles(fmt, M, 4096, 4096, capability=cap)
        path = kernels_triton.gemm_path(fmt, cap)[0]
        kind = ("e2m1" if spec(fmt).element == "e2m1" else "fp8_block" if fmt == "fp8_block" else "e4m3") \
            if path == "native" else ("e2m1_portable" if spec(fmt).element == "e2m1" else None)
        want = tuning.sm12x_config(kind, M) if kind else tuning.e4m3_portable_config(M, 64 if fmt == "mxfp8" else 128)
        mod = kernels_triton.module(fmt)
        assert mod.route(M, 4096, 4096, capability=cap, tile=t["tile"]).tile == str(want)
        assert mod.route(M, 4096, 4096, capability=cap).tile == str(mod.tile_config(M, 4096, 4096, None, cap))
        # the quantizer's BLOCK_K multiple: its scale block, or 32 where the scales span K (fp8_tensor,
        # fp8_channel)
        group = 32 if fmt in ("fp8_tensor", "fp8_channel") else spec(fmt).k_multiple
        if fmt in tuning.WHOLE_ROW_QUANTIZERS:  # a program owns whole rows: one row each at every M
            assert t["quant_tile"] == (1, tuning.QUANT_DECODE_ROW_BLOCK)
        else:
            assert t["quant_tile"] == tuning.quant_config(M, 4096, False, group)


def test_tuning_passes_nothing_for_the_interpreter_and_refuses_what_the_lesson_refuses():
    assert tuning.tiles("nvfp4", 16, 64, 64, capability=None) == {}
    with pytest.raises(ValueError, match="path must be None or one of"):
        tuning.tiles("mxfp4", 16, 64, 64, capability=(12, 0), path="fast")
    with pytest.raises(ValueError, match="W4A16"):
        tuning.tiles("fp8_tensor", 16, 64, 64, capability=(12, 0), a16=True)


@pytest.mark.parametrize("fmt", LESSONS)
def test_a_given_tile_is_the_one_launched_and_reported(fmt):
    """linear with tile= (16 x 32, several programs and K steps) and quant_tile= (16 rows per program)
    launches the route's kernels, reports that tile, and matches the oracle within the bound."""
    M, N, K = 37, 72, 256
    tile = _common.TileConfig(16, 32, 128, GROUP_M=2, num_warps=4, num_stages=1)
    mod = kernels_triton.module(fmt)
    qw = formats.quantize(make_input((N, K), block=32) * 0.05, fmt, role="weight").to(DEVICE)
    x = make_input((M, K), torch.bfloat16, block=32)
    cap = _common.device_capability(qw.device)
    r = mod.route(M, N, K, capability=cap, tile=tile)
    assert r.tile == str(tile)
    with record_launches() as log:
        y = mod.linear(x, qw, tile=tile, quant_tile=(16, 128))
    assert tuple(log) == r.kernels
    xq = formats.quantize(x.cpu(), fmt, role="activation")
    ref = formats.reference_linear(xq, qw.to("cpu"), out_dtype=x.dtype)
    assert ref.abs().max() > 0
    assert_within_bound(y, ref, gemm_bound(xq, qw, None, x.dtype, ref))
    # the quantizer runs the given tile: one Triton refuses (3 rows) fails inside it, by linear too
    for call in (lambda: mod.quantize_activation(x, quant_tile=(3, 128)), lambda: mod.linear(x, qw, quant_tile=(3, 128))):
        with pytest.raises(Exception) as err:
            call()
        # the interpreter says it in the error; a GPU's compiler wraps it (CompilationError, its cause)
        chain, e = [], err.value
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        assert any("power of 2" in m for m in chain), chain
    # and its tile does not change a code
    q_small = mod.quantize_activation(x, quant_tile=(16, 128))
    q_default = mod.quantize_activation(x)
    assert torch.equal(q_small.data.view(torch.uint8), q_default.data.view(torch.uint8))
    assert torch.equal(q_small.scale.reshape(-1).view(torch.uint8), q_default.scale.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt", LESSONS)
def test_linear_unchecked_is_linear_without_its_checks(fmt):
    """The trusted entry computes what quantize_activation then gemm compute, bit for bit (the same
    kernels, tiles and order), and so does linear; the checks are linear's own (a bias of the wrong
    length is named there)."""
    mod = kernels_triton.module(fmt)
    N, K = 40, 128
    qw = formats.quantize(make_input((N, K), block=32) * 0.05, fmt, role="weight").to(DEVICE)
    x = make_input((3, 2, K), torch.bfloat16, block=32)
    bias = torch.randn(N, device=DEVICE)
    two_step = mod.gemm(mod.quantize_activation(x), qw, bias, out_dtype=x.dtype).reshape(3, 2, N)
    assert two_step.abs().max() > 0
    assert torch.equal(mod.linear_unchecked(x, qw, bias), two_step)
    assert torch.equal(mod.linear(x, qw, bias), two_step)
    with pytest.raises(ValueError, match="bias"):
        mod.linear(x, qw, torch.zeros(N + 1, device=DEVICE))


def test_route_text_names_the_interpreters_dot_scaled_only_where_one_runs():
    """On the CPU the routes run the portable kernels: their reason says so and does not mention
    dot_scaled's e4m3-scale decoding, which only a refused native NVFP4 call is told about."""
    for fmt in LESSONS:
        r = kernels_triton.module(fmt).route(4, 64, 128)
        assert "_portable_gemm_kernel" in r.kernels and "dot_scaled" not in r.why, r.describe()
    with pytest.raises(ValueError, match="decodes e4m3 scales as E8M0"):
        kernels_triton.module("nvfp4").route(4, 64, 128, path="native")


@pytest.mark.parametrize("fmt", LESSONS)
def test_linear_validates_x_once(fmt, monkeypatch):
    """One linear call checks x once (formats.validate.check_activation): the quantizer and the GEMM
    it calls are the unchecked steps, not the public quantize_activation / gemm."""
    import formats.validate as V

    calls = []
    real = V.check_activation
    monkeypatch.setattr(V, "check_activation", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    mod = kernels_triton.module(fmt)
    qw = formats.quantize(make_input((24, 128), block=32) * 0.05, fmt, role="weight").to(DEVICE)
    mod.linear(make_input((5, 128), torch.bfloat16, block=32), qw)
    assert len(calls) == 1


@triton.jit
def _round_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(y_ptr + offs, _codecs.round_to_bf16_rne(tl.load(x_ptr + offs, mask=ok)), mask=ok)


def test_round_to_bf16_rne_is_torchs_cast_and_keeps_every_nan():
    """_codecs.round_to_bf16_rne against torch's fp32 -> bf16 cast (RNE) on ties, the largest finite
    values (rounding to Inf), Inf, subnormals and random values; and NaN stays NaN for every NaN bit
    pattern, the GPU's 0x7FFFFFFF included, which the carry of the add turns into -0.0 without the
    NaN guard (found on the H200: a weight-only MoE row of NaN came out finite)."""
    g = torch.Generator().manual_seed(7)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000,
                         0xFF800000, 0x00008000, 0x00018000, 0x80000001], dtype=torch.int64)
    finite = torch.cat([bits.to(torch.int32).view(torch.float32),
                        torch.randn(200, generator=g) * 2.0 ** torch.randint(-60, 60, (200,), generator=g)])
    nans = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0xFFC00000, 0x7FFF8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([finite, nans]).to(DEVICE)
    y = torch.empty_like(x)
    _round_bf16_kernel[(1,)](x, y, x.numel(), BLOCK=256)
    y = y.cpu()
    assert torch.equal(y[:finite.numel()], finite.to(torch.bfloat16).float())
    assert torch.isnan(y[finite.numel():]).all()
