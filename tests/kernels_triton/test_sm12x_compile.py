"""Compile-only, no GPU: every GEMM configuration the SM12x tile tables can select compiles for
sm_120a and sm_121a, its PTX holds the native block-scaled MMA of its format (and not the bf16 or
plain-fp8 fallback), and ptxas' report fits the part (shared memory <= 101,376 B per block, no
spills, registers x threads <= 65,536).

How: tools/sm12x_compile.py compiles the builds in a subprocess (TRITON_INTERPRET=0, two worker
processes, a fresh Triton cache so ptxas reports). One xdist worker compiles, the others wait on
a file lock and read the same records; the records are also kept in pytest's cache under a key of
the kernel sources and the Triton version, so a second run with unchanged kernels compiles nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

import kernels_triton
from formats import FORMAT_NAMES, spec
from kernels_triton import tuning  # the SM12x tile tables

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "sm12x_compile.py"
_spec = importlib.util.spec_from_file_location("sm12x_compile", TOOL)
sm12x_compile = importlib.util.module_from_spec(_spec)
sys.modules["sm12x_compile"] = sm12x_compile  # dataclasses look their module up there
_spec.loader.exec_module(sm12x_compile)

# The Triton that CI runs: .ci/run installs torch==2.13.0, which pins triton 3.9. The SM12x tables
# are sized and resource-checked against its code generation (its shared-memory allocation and
# register use); an older Triton allocates and spills differently (Triton 3.6 spills 4 B in the
# W4A16 portable medium tile), so the resource checks hold only from this version on.
CI_TRITON = (3, 9)
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
if TRITON_VERSION < CI_TRITON:
    pytest.skip(f"Triton {triton.__version__} is older than the Triton CI pins ({CI_TRITON[0]}.{CI_TRITON[1]}, with "
                "torch 2.13.0): the SM12x tile tables are resource-checked against that version's code generation",
                allow_module_level=True)

BUILDS = sm12x_compile.builds()
ARCHS = tuple(f"sm_{a}a" for a in sm12x_compile.ARCHES)


def _key() -> str:
    h = hashlib.sha256(triton.__version__.encode())
    for p in sorted((ROOT / "kernels_triton").glob("*.py")) + [TOOL]:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def records(request, tmp_path_factory) -> dict:
    key = _key()
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cached = None if cache is None else cache.get(f"sm12x_compile/{key}", None)
    if cached is None:
        shared = tmp_path_factory.getbasetemp().parent  # one directory for all xdist workers
        out = shared / f"sm12x_compile_{key}.json"
        with open(shared / "sm12x_compile.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                env = {**os.environ, "TRITON_INTERPRET": "0"}
                proc = subprocess.run([sys.executable, str(TOOL), "--json", str(out), "--jobs", "2"],
                                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
                if not out.exists():
                    pytest.fail(f"tools/sm12x_compile.py wrote no records (rc {proc.returncode}):\n"
                                f"{proc.stderr[-3000:]}")
            cached = json.loads(out.read_text())
        if cache is not None:
            cache.set(f"sm12x_compile/{key}", cached)
    return {(r["name"], r["arch"]): r for r in cached}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [b.name for b in BUILDS])
def test_build_compiles_to_the_native_mma_and_fits(records, name, arch):
    r = records[(name, arch)]
    cap = (12, int(arch[5]))
    if r["path"] == "native" and kernels_triton.gemm_path(r["fmt"], cap)[0] != "native":
        pytest.skip(kernels_triton.gemm_path(r["fmt"], cap)[1])  # an older Triton: the policy says portable
    assert "error" not in r, r.get("error")
    assert r["target"] == arch, f"PTX .target is {r['target']}, expected {arch}"
    assert not r["missing"], f"PTX lacks {r['missing']}; it has {r['mma']}"
    assert not r["forbidden"], f"PTX falls back to {r['forbidden']}"
    assert r.get("pdl_wait_first", True), "griddepcontrol.wait comes after a global access in the PTX"
    assert r["shared"] <= sm12x_compile.SMEM_LIMIT, f"{r['shared']} B of shared memory per block"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, \
        f"{r['spill_stores']} B spill stores / {r['spill_loads']} B spill loads at {r['registers']} registers"
    assert r["registers"] * r["threads"] <= sm12x_compile.REGS_PER_SM, f"{r['registers']} registers x {r['threads']}"


def test_every_format_and_table_row_is_built():
    """The build list covers each format's native kernel for every row of its table, the W4A16
    kernel of each FP4 format for every row of the portable FP4 table, and mxfp8's W8A16 kernel
    (bf16 and fp16 x) for every row of the e4m3_portable table."""
    have = {(b.fmt, b.path, b.row) for b in BUILDS}
    for fmt in FORMAT_NAMES:
        kinds = ["e2m1"] if spec(fmt).element == "e2m1" else ["e4m3"]
        if fmt == "fp8_block":
            kinds.append("fp8_block")
        for kind in kinds:
            for row in tuning.sm12x_entries(kind):
                assert (fmt, "native", row) in have, (fmt, kind, row)
        if spec(fmt).element == "e2m1":
            for row in tuning.sm12x_entries("e2m1_portable"):
                assert (fmt, "portable", row) in have, (fmt, row)
    names = {b.name for b in BUILDS}
    for row in tuning.sm12x_entries("e4m3_portable"):
        assert {f"mxfp8 W8A16 {act} portable {row}" for act in ("bf16", "fp16")} <= names, row


@pytest.mark.parametrize("kind", tuning.KINDS)
def test_selection_stays_inside_the_compiled_entries(kind):
    """sm12x_config picks only tiles that are compiled above, for decode to prefill M and every SM
    count, and each fits the shared memory even with all num_stages operand buffers."""
    entries = {str(c) for c in tuning.sm12x_entries(kind).values()}
    for sms in tuning.SM12X_SM_COUNTS:
        for m in (1, 7, 16, 17, 64, 65, 128, 129, 256, 257, 4096):
            for n, k in ((2048, 4096), (4096, 7168), (8192, 8192), (576, 2048)):
                cfg = tuning.sm12x_config(kind, m, n, k, sms)
                assert str(cfg) in entries, (kind, m, n, k, sms, str(cfg))
                # operand bytes per element: e4m3 1, packed e2m1 1/2, the portable kernels' bf16
                # activation 2; all num_stages buffers
                a_b, b_b = {"e4m3": (1, 1), "fp8_block": (1, 1), "e2m1": (0.5, 0.5), "e2m1_portable": (2, 0.5),
                            "e4m3_portable": (2, 1)}[kind]
                est = cfg.num_stages * (cfg.BLOCK_M * a_b + cfg.BLOCK_N * b_b) * cfg.BLOCK_K
                assert est <= tuning.SM12X_SMEM_PER_BLOCK, (kind, str(cfg), est)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_lesson_default_tiles_are_compiled_entries(fmt, arch):
    """A lesson called without tile= on SM12x launches its one default tile: that tile is a row of
    the table this file compiles for its kernel (native for every format, and the weight-only
    portable kernel of the FP4 formats and mxfp8), so the default is compile- and resource-checked
    too; so is every tile tuning.tiles gives mxfp8 W8A16 there."""
    cap = (12, int(arch[5]))
    mod = kernels_triton.module(fmt)
    fp4 = spec(fmt).element == "e2m1"
    native_kind = "e2m1" if fp4 else "e4m3"
    assert str(mod.tile_config(64, 4096, 4096, "native", cap)) in {str(c) for c in tuning.sm12x_entries(native_kind).values()}
    if fp4 or fmt == "mxfp8":
        entries = {str(c) for c in tuning.sm12x_entries("e2m1_portable" if fp4 else "e4m3_portable").values()}
        assert str(mod.tile_config(64, 4096, 4096, capability=cap, a16=True)) in entries
        for m in (1, 16, 17, 64, 65, 4096):
            assert str(tuning.tiles(fmt, m, 4096, 4096, capability=cap, a16=True)["tile"]) in entries, m


def test_moe_kernels_are_built():
    """kernels_triton.moe's kernels are in the build list as SM12x launches them: the grouped GEMM for
    W13 (gated) and W2 of every format natively, of the weight-only variants portably (TF32), at each
    BLOCK_M its GPU tile takes (16, 32, 64), the activation quantizer of both GEMM inputs, and the amax
    kernel per block and per row (fp8_channel's per-token scale)."""
    from kernels_triton import moe

    names = {b.name for b in BUILDS}
    for fmt, a16 in [(f, False) for f in moe.FORMATS] + [(f, True) for f in moe.A16_FORMATS]:
        kind = "weight-only portable" if a16 else "native"
        for gemm, M in (("W13", 4096), ("W13", 512), ("W13", 64), ("W2", 4096), ("W2", 64)):
            assert f"moe {fmt} {kind} {gemm} M={M}" in names
        if not a16:
            assert {f"moe {fmt} quantize x", f"moe {fmt} quantize intermediate"} <= names
    assert {"moe amax x", "moe amax intermediate", "moe amax rows x", "moe amax rows intermediate"} <= names
    assert {moe.tile_config(M, 128, 8, 4096, 1536, "mxfp4", "native", (12, 0)).BLOCK_M for M in (64, 512, 4096)} \
        == {16, 32, 64}
