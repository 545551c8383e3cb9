"""Compile-only: every kernels_cute GEMM plan compiles for sm_120a (RTX PRO 6000, 188 SMs) and
sm_121a (GB10, 48 SMs) on a host without either GPU, and the cells supported() rejects are the
ones that do not.

How: kernels_cute._compile turns one subprocess per arch into a b12x compile worker (the one place
that uses b12x private API) and compiles the exact plans kernels_cute.<fmt>.linear uses. Both arch
processes run in parallel, into a temporary B12X_COMPILE_CACHE_DIR.

Grid: M in {1, 8, 128, 2048} x K in {4096, 7168} x N in {2048, 4096}, the five formats b12x
serves, plus the weight-only routes (nvfp4_w4a16, mxfp8_w8a16) at the corners. Plans are deduplicated (MXFP4 plans M <= 129 at
capacity 129 when K >= 4096). Set B12X_DUAL_COMPILE_GRID=corners to compile only M in {1, 2048},
K=4096/N=2048 and K=7168/N=4096.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("b12x", reason="b12x is not installed (pip install -e '.[dev]' brings b12x==1.5.1)")

import kernels_cute  # noqa: E402
from kernels_cute import _compile  # noqa: E402
from kernels_cute._common import b12x_import_error  # noqa: E402

if b12x_import_error():
    pytest.skip(b12x_import_error(), allow_module_level=True)

MS = (1, 8, 128, 2048)
KS = (4096, 7168)
NS = (2048, 4096)
CORNERS = os.environ.get("B12X_DUAL_COMPILE_GRID", "full") == "corners"
BUG_MESSAGE = "Expected source and destination tensors to have the same rank, but got 3 and 4"


from kernels_cute._common import split_variant  # noqa: E402

W4A4 = tuple(v for v in kernels_cute.SERVED if not split_variant(v)[1])
A16 = tuple(v for v in kernels_cute.SERVED if split_variant(v)[1])  # ("nvfp4_w4a16", "mxfp8_w8a16")


def _cells():
    corners = [(f, m, n, k) for f in A16 for m in (1, 2048) for n, k in ((2048, 4096), (4096, 7168))]
    if CORNERS:
        return [(f, m, n, k) for f in W4A4 for m in (1, 2048) for n, k in ((2048, 4096), (4096, 7168))] + corners
    return [(f, m, n, k) for f in W4A4 for m in MS for n in NS for k in KS] + corners


def _device(arch):
    t = _compile.TARGETS[arch]
    return SimpleNamespace(capability=t.capability, sm_count=t.sm_count, kind="cuda", name=t.name)


@pytest.fixture(scope="module")
def grid_result(tmp_path_factory):
    """Compile every distinct plan of the grid, plus b12x's own default MXFP4 plans for the small-M
    cells (the known-bad ones), for both arches at once. Returns (reports by key, walls, seconds)."""
    cells_by_arch = {}
    for arch in _compile.TARGETS:
        seen, cells = set(), []
        for fmt, m, n, k in _cells():
            mod = kernels_cute.module(fmt)
            if not kernels_cute.supported(fmt, m, n, k, _device(arch))[0]:
                continue
            key = (fmt, mod.cap_for(m, k), n, k, "ours")
            if key not in seen:
                seen.add(key)
                cells.append({"fmt": fmt, "M": m, "N": n, "K": k, "variant": "ours"})
            if fmt == "mxfp4" and m <= 128:
                key = (fmt, m, n, k, "b12x_default")
                if key not in seen:
                    seen.add(key)
                    cells.append({"fmt": fmt, "M": m, "N": n, "K": k, "variant": "b12x_default"})
        cells_by_arch[arch] = cells
    # Under pytest-xdist every worker builds this fixture; the first one compiles, the others wait
    # on a lock in the shared temp root and read its reports.
    # (a worker's basetemp is <session>/popen-gwN, so its parent is this session's; without xdist
    # the parent would be shared by every pytest session, so use the session's own basetemp)
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kernels-cute-compile"
    shared.mkdir(exist_ok=True)
    done = shared / ("corners.json" if CORNERS else "full.json")
    t0 = time.perf_counter()
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            saved = json.loads(done.read_text())
            reports = [_compile.CompileReport(**r) for r in saved["reports"]]
            walls = saved["walls"]
        else:
            reports, walls = _compile.compile_many(cells_by_arch, cache_dir=str(shared / "cache"))
            done.write_text(json.dumps({"reports": [asdict(r) for r in reports], "walls": walls}))
    seconds = time.perf_counter() - t0
    by_key = {}
    for r in reports:
        by_key[(r.arch, r.fmt, r.cap, r.N, r.K, r.variant)] = r
    n_ok = sum(r.ok for r in reports)
    print(f"\ncompile grid: {len(reports)} plans ({n_ok} compiled) in {seconds:.1f} s wall; per arch: {walls}")
    return by_key, walls, seconds


def test_private_b12x_api_is_present():
    """kernels_cute._compile needs these private b12x symbols; a b12x release that moves one
    breaks compile checks (not serving), and this test names it."""
    missing = _compile.check_private_api()
    assert not missing, f"b12x {kernels_cute.B12X_VERSION} private API moved: {missing}; update kernels_cute/_compile.py"


@pytest.mark.parametrize("arch", tuple(_compile.TARGETS))
@pytest.mark.parametrize("fmt,m,n,k", _cells())
def test_supported_cell_compiles_for_target(grid_result, arch, fmt, m, n, k):
    """supported() => our plan for this cell compiles, and the artifact targets ``arch``."""
    ok, why = kernels_cute.supported(fmt, m, n, k, _device(arch))
    assert ok, why
    by_key, _, _ = grid_result
    mod = kernels_cute.module(fmt)
    rep = by_key[(arch, fmt, mod.cap_for(m, k), n, k, "ours")]
    assert rep.ok, f"{fmt} M={m} N={n} K={k} (plan capacity {rep.cap}) failed for {arch}: {rep.error}"
    assert rep.targets and all(t == arch for t in rep.targets), f"artifact targets {rep.targets}, expected {arch}"
    if fmt == "mxfp4":
        assert rep.lowering.get("tile_k") == 128, f"MXFP4 must lower to tile_k=128, got {rep.lowering}"


@pytest.mark.parametrize("arch", tuple(_compile.TARGETS))
def test_b12x_default_mxfp4_plan_still_hits_the_tile_k_256_bug(grid_result, arch):
    """b12x's own plan for small-M MXFP4 at K >= 4096 fails exactly when it lowers to tile_k=256,
    with the known message. When this starts failing because they compile, b12x has fixed the bug:
    drop the capacity-129 workaround in kernels_cute/mxfp4.py (cap_for)."""
    by_key, _, _ = grid_result
    reps = [r for (a, *_rest, v), r in by_key.items() if a == arch and v == "b12x_default"]
    assert reps, "the grid has no small-M MXFP4 cell"
    for r in reps:
        if r.lowering.get("tile_k") == 256:
            assert not r.ok and BUG_MESSAGE in r.error, (
                f"b12x's default MXFP4 plan M={r.M} N={r.N} K={r.K} with tile_k=256 now gives ok={r.ok} "
                f"error={r.error!r}: b12x fixed the bug? drop kernels_cute.mxfp4.cap_for's workaround")
        else:
            assert r.ok, f"b12x default MXFP4 plan with {r.lowering} failed: {r.error}"
    assert any(not r.ok for r in reps), "no b12x default MXFP4 plan failed: the tile_k=256 bug may be fixed"


@pytest.mark.parametrize("fmt,n,k,needle", [
    ("nvfp4", 2048, 4160, "K % 128"), ("nvfp4", 2052, 4096, "N % 8"),
    ("mxfp4", 2048, 4224, "K % 256"), ("fp8_block", 2000, 4096, "N % 128"),
    ("fp8_tensor", 2048, 4100, "K % 128"), ("mxfp8", 2048, 4128, "K % 128"),
])
def test_unaligned_shapes_are_unsupported_with_a_reason(fmt, n, k, needle):
    ok, why = kernels_cute.supported(fmt, 8, n, k, _device("sm_120a"))
    assert not ok and needle in why, why


def test_nvfp4_w4a16_is_compile_checked():
    assert "nvfp4_w4a16" in A16 and any(c[0] == "nvfp4_w4a16" for c in _cells())


def test_mxfp8_w8a16_is_compile_checked():
    """b12x's blockscaled.w8a16 plan (BlockscaledQuery recipe mxfp8, activation_mode a16) is in the grid."""
    assert "mxfp8_w8a16" in A16 and any(c[0] == "mxfp8_w8a16" for c in _cells())
    ok, why = kernels_cute.supported("mxfp8_w8a16", 8, 4096, 4096, _device("sm_120a"), dtype=torch.float16)
    assert not ok and "bfloat16 activations only" in why


def test_fp8_channel_is_a_named_gap():
    """b12x 1.5.1 has no per-channel FP8 GEMM: the cell is refused with the reason, no plan exists."""
    assert "fp8_channel" not in kernels_cute.SERVED
    ok, why = kernels_cute.supported("fp8_channel", 8, 4096, 4096, _device("sm_120a"))
    assert not ok and "no per-channel FP8 GEMM" in why


def test_mxfp4_w4a16_and_non_sm12x_are_unsupported():
    ok, why = kernels_cute.supported("mxfp4_w4a16", 8, 4096, 4096, _device("sm_120a"))
    assert not ok and "no W4A16 kernel for MXFP4" in why
    h200 = SimpleNamespace(capability=(9, 0), sm_count=132, kind="cuda", name="H200")
    ok, why = kernels_cute.supported("nvfp4", 8, 4096, 4096, h200)
    assert not ok and "SM120/SM121" in why and re.search(r"\(9, 0\)", why)


def test_compile_check_single_cell_reports_target(tmp_path):
    """The public single-cell entry point (one subprocess) works and reports the target."""
    rep = _compile.compile_check("nvfp4", 8, 2048, 4096, "sm_121a", cache_dir=str(tmp_path))
    assert rep.ok, rep.error
    assert rep.targets == ["sm_121a"]
