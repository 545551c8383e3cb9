"""The sweep and bench harnesses run on a tiny grid (CPU interpreter here, GPU elsewhere): exit
status, JSON fields, and that a wrong implementation is caught. Nothing here is timed."""

from __future__ import annotations

import json
import os
import re

import torch

from dispatch.apps import _harness as H
from dispatch.apps import bench, bench_plan, bench_record, sweep

ON_CPU = not torch.cuda.is_available()

# A row or cell may leave an implementation out only with a reason that names why: the device found
# ("no CUDA device here", "NVIDIA H200 is sm_90"), a library that is missing or refuses (b12x,
# kernels_cute, kernels_triton), or an entry point the implementation does not have. Anything else,
# and every error, fails the test.
EXPLICIT_SKIP = re.compile(r"no CUDA device|on the CPU|sm_\d+|SM120/SM121|not installed|does not import|"
                           r"not in this installation|b12x|has no separate")
# torch._scaled_mm refuses some FP8 baseline shapes on some GPUs; bench records that as the baseline's
# error and lists it under "baselines" (docs/bench.md). Only there, and only on a GPU, is an error a row.
REFUSABLE_BASELINES = ("torch_fp8_tensor", "torch_fp8_block")


def bench_row_problems(res: dict) -> list[str]:
    """Every bench row that neither ran (us > 0) nor is an explicit skip, as one line each."""
    bad = []
    for r in res["results"]:
        what = f"{r['kind']} {r['name']} {r.get('variant')} {r['mode']} {r['shape']} M={r['M']}"
        if r.get("error"):
            refused = (r["kind"] == "baseline" and r["name"] in REFUSABLE_BASELINES and not ON_CPU
                       and f"{r['name']} unsupported" in res["baselines"])
            if not refused:
                bad.append(f"{what}: error {r['error']}")
        elif r.get("skipped") is not None:
            if not EXPLICIT_SKIP.search(str(r["skipped"])):
                bad.append(f"{what}: skipped without naming the device or library: {r['skipped']!r}")
        elif not (r.get("us") or 0) > 0:
            bad.append(f"{what}: neither timed nor skipped")
    return bad


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_sweep_small_subset_agrees_and_writes_json(tmp_path):
    out = tmp_path / "sweep.json"
    rc = sweep.main(["--grid", "small", "--formats", "fp8_block,nvfp4,mxfp4_w4a16", "--m", "1,3",
                     "--dtypes", "bf16,fp16", "--json", str(out), "--no-progress", "--plain"])
    assert rc == 0
    res = _load(out)
    for key in ("tool", "device", "versions", "grid", "args", "impls", "tolerances", "cells", "summary"):
        assert key in res
    assert res["summary"]["ok"] is True and res["summary"]["failed"] == 0
    assert res["tolerances"]["norm_rel"] == {"bf16": 4e-3, "fp16": 1e-3}
    cells = res["cells"]
    assert len(cells) == 3 * 2 * 2 * 2  # variants x M x dtypes x (N, K)
    assert {c["variant"] for c in cells} == {"fp8_block", "nvfp4", "mxfp4_w4a16"}
    for c in cells:
        for key in ("variant", "fmt", "a16", "M", "N", "K", "out_dtype", "ran", "skipped", "errors", "quant",
                    "pairs", "ok", "seconds"):
            assert key in c
        assert c["ran"][:2] == ["reference", "triton"]
        assert "cute" in c["skipped"] or "cute" in c["ran"]
        assert c["errors"] == {}, c["errors"]
        for name, why in c["skipped"].items():
            assert EXPLICIT_SKIP.search(why), f"{name} skipped without naming the device or library: {why!r}"
        pair = next(p for p in c["pairs"] if {p["a"], p["b"]} == {"triton", "reference"})
        for key in ("norm_rel", "max_rel", "mean_rel", "cosine", "tol_norm_rel", "ok"):
            assert key in pair
        assert pair["ok"] and 0 < pair["norm_rel"] <= pair["tol_norm_rel"]
        if c["a16"]:
            assert c["fmt"] == "mxfp4" and c["quant"] == {}  # W4A16: no activation quantization
        else:
            q = c["quant"]["triton"]
            assert q["ok"] and q["data_equal"] and q["scale_equal"] and q["mismatched_bytes"] == 0


def _triton_based(name, *, linear_factor=1.0, corrupt_scale=False) -> H.Impl:
    tri = H.triton_impl()

    def linear(x, prepared, qweight, bias, a16):
        return tri.linear(x, prepared, qweight, bias, a16) * linear_factor

    def quantize(x, fmt):
        q = tri.quantize(x, fmt)
        if corrupt_scale:
            from dataclasses import replace

            s = q.scale.clone()
            s.reshape(-1).view(torch.uint8)[:1] ^= 1  # flip one bit of the first scale byte
            q = replace(q, scale=s)
        return q

    return H.Impl(name, linear, quantize=quantize, support=tri.support)


def test_sweep_reports_a_wrong_output(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = sweep.main(["--grid", "small", "--formats", "fp8_tensor", "--m", "3", "--dtypes", "bf16",
                     "--impls", "reference,triton", "--json", str(out), "--no-progress", "--plain"],
                    extra_impls={"broken": _triton_based("broken", linear_factor=1.01)})
    assert rc == 1
    res = _load(out)
    assert res["summary"]["ok"] is False and res["summary"]["failed"] == len(res["cells"]) == 2
    for c in res["cells"]:
        bad = [p for p in c["pairs"] if not p["ok"]]
        assert bad and all("broken" in (p["a"], p["b"]) for p in bad)
        assert all(p["norm_rel"] > 5e-3 for p in bad)  # 1% off
        assert next(p for p in c["pairs"] if {p["a"], p["b"]} == {"triton", "reference"})["ok"]
    assert "DISAGREE" in capsys.readouterr().out


def test_sweep_reports_activation_bits_that_differ(tmp_path):
    out = tmp_path / "sweep.json"
    rc = sweep.main(["--grid", "small", "--formats", "nvfp4", "--m", "1", "--dtypes", "bf16",
                     "--impls", "reference", "--json", str(out), "--no-progress", "--plain"],
                    extra_impls={"badscale": _triton_based("badscale", corrupt_scale=True)})
    assert rc == 1
    for c in _load(out)["cells"]:
        q = c["quant"]["badscale"]
        assert q["ok"] is False and q["data_equal"] is True and q["scale_equal"] is False
        assert q["mismatched_bytes"] == 1


def test_bench_tiny_grid_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench.main(["--shapes", "tiny", "--m", "1", "--formats", "fp8_tensor,mxfp4_w4a16", "--check",
                     "--json", str(out), "--plot", str(png), "--no-progress", "--plain"])
    assert rc == 0
    res = _load(out)
    for key in ("tool", "device", "versions", "cpu_interpreter", "ceilings", "args", "shapes", "baselines",
                "results", "skipped", "targets", "seconds"):
        assert key in res
    if ON_CPU:
        assert res["cpu_interpreter"] is True and "NOT performance numbers" in res["note"]
        assert "NOT performance numbers" in capsys.readouterr().out
    rows = res["results"]
    base = {r["name"]: r for r in rows if r["kind"] == "baseline"}
    assert set(base) == set(bench_plan.BASELINES)
    assert base["torch_bf16"]["us"] > 0
    timed = [r for r in rows if r["kind"] == "impl" and r["name"] == "triton"]
    assert {(r["variant"], r["mode"]) for r in timed} == {
        ("fp8_tensor", "linear"), ("fp8_tensor", "gemm"), ("mxfp4_w4a16", "linear")}
    for r in timed:
        for key in ("shape", "model", "M", "N", "K", "us", "us_p20", "us_p80", "method", "flops", "bytes",
                    "tflops", "gbps", "roofline_share", "speedup_vs", "check", "n_sets"):
            assert key in r, key
        assert r["us"] > 0 and r["flops"] == 2 * r["M"] * r["N"] * r["K"] and r["bytes"] > 0
        assert "torch_bf16" in r["speedup_vs"]
        assert r["check"]["ok"] and r["check"]["norm_rel"] <= 4e-3
    # every row ran or is an explicit skip (cute here: the device found); no row carries an error
    assert bench_row_problems(res) == []
    cute = [r for r in rows if r["name"] == "cute"]
    assert len(cute) == 3 and all(r.get("us") or r.get("skipped") for r in cute)
    assert len(res["targets"]) == len(bench_record.TARGETS)
    if H._have("matplotlib"):
        assert png.exists() and png.stat().st_size > 0
    # the summary mode reads the file back
    assert bench.main(["--summarize", str(out), "--plain"]) == 0


def test_bench_reports_an_implementation_that_raises(tmp_path):
    """The strict row check is not vacuous: an implementation that raises gives error rows, bench
    exits 1, and bench_row_problems names them."""
    def linear(x, prepared, qweight, bias, a16):
        raise RuntimeError("deliberately broken")

    out = tmp_path / "bench.json"
    rc = bench.main(["--shapes", "tiny", "--m", "1", "--formats", "fp8_tensor", "--impls", "triton",
                     "--baselines", "torch_bf16", "--json", str(out), "--no-progress", "--plain"],
                    extra_impls={"raises": H.Impl("raises", linear)})
    assert rc == 1
    problems = bench_row_problems(_load(out))
    assert len(problems) == 1 and "impl raises fp8_tensor linear" in problems[0]
    assert "deliberately broken" in problems[0]
    # its GEMM-alone row is an explicit skip: it has no separate quantize and GEMM
    row = next(r for r in _load(out)["results"] if r["name"] == "raises" and r["mode"] == "gemm")
    assert "has no separate" in row["skipped"]


def test_bench_shape_table_and_plan():
    ids = [s.id for s in bench_plan.select_shapes("default", gpu=True, quick=False)]
    assert ids[0] == "square" and "llama3.1-8b:gate_up" in ids and "deepseek-v3:q_a_kv_a" in ids
    s = bench_plan.SHAPE_BY_ID["qwen3-32b:gate_up"]
    assert (s.N, s.K) == (51200, 5120)
    assert [x.id for x in bench_plan.select_shapes("llama3.1-8b", gpu=True, quick=False)] == [
        "llama3.1-8b:qkv", "llama3.1-8b:gate_up", "llama3.1-8b:down"]
    assert bench_plan.select_shapes("96x256", gpu=True, quick=False)[0].N == 96
    plan = bench_plan.plan(bench_plan.select_shapes("default", gpu=True, quick=False), None, gpu=True, quick=False)
    assert plan[:3] == [(bench_plan.SHAPE_BY_ID["square"], m) for m in (16, 4096, 8192)]
    assert len(plan) == 10 * 5 + 1
    assert os.path.basename(bench.__file__) == "bench.py"


def test_output_without_rich_or_tqdm(monkeypatch, capsys):
    """The H200 image may lack rich/tqdm: tables and progress fall back to plain text."""
    monkeypatch.setattr(H, "HAVE_RICH", False)
    monkeypatch.setattr(H, "HAVE_TQDM", False)
    with H.Progress(4, "sweep") as bar:
        for i in range(4):
            bar.advance(f"cell {i}")
    H.print_table("t", ["a", "bb"], [[1, "x"], [22, None]])
    out, err = capsys.readouterr()
    assert "sweep: 4/4 (100%)" in err
    assert "a   bb" in out and "22" in out
