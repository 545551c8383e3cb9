"""The MoE parts of the applications: ``b12x-dual explain`` (dispatch/apps/explain.py, with --moe),
``info --moe``, the MoE sweep (dispatch/apps/sweep_moe.py) and the MoE bench layers
(dispatch/apps/bench_moe.py). Tiny shapes: the interpreter runs every kernel on a CPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import DEVICE

import formats
from dispatch import moe as dm
from dispatch import policy
from dispatch.apps import bench, bench_moe, cli, explain, sweep, sweep_moe


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    dm.clear_cache()
    yield
    dm.clear_cache()


def test_explain_moe_on_the_command_line(capsys):
    assert cli.main(["explain", "--moe", "--experts", "128", "--top-k", "8", "--hidden", "2880", "--intermediate",
                     "2880", "--format", "mxfp4", "-m", "16", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    if dm.hopper_moe_on():  # the sm_90 MoE's gate (dispatch.moe.HOPPER_MOE_GPU_RAN) is on: hopper serves
        assert "MoE mxfp4 decode M=16 E=128 top_k=8 H=2880 I=2880 silu (M bucket 16, asked): auto -> hopper" in out
    else:
        assert "MoE mxfp4 decode M=16 E=128 top_k=8 H=2880 I=2880 silu (M bucket 16, asked): auto -> triton" in out
        assert f"hopper: no: hopper has no MoE kernel for mxfp4: {dm.HOPPER_UNRUN}" in out
    assert explain.main(["--moe", "--format", "nvfp4"]) == 2
    assert "missing --experts, --top-k, --hidden, --intermediate" in capsys.readouterr().err
    assert explain.main(["--format", "nvfp4", "-m", "16", "--device", "gb10", "--impl", "triton"]) == 0
    assert "nvfp4 M=16 N=4096 K=4096: use_impl()=triton -> triton" in capsys.readouterr().out


def test_info_moe_shows_every_variant(capsys):
    assert cli.main(["info", "--device", "h200", "--moe", "--experts", "32", "--top-k", "4", "--hidden", "2880",
                     "--intermediate", "2880", "--activation", "swigluoai"]) == 0
    out = capsys.readouterr().out
    moe_part = out.split("auto's choice for an MoE layer", 1)[1]
    assert "(E=32, top_k=4, H=2880, I=2880, swigluoai)" in moe_part
    for v in ("nvfp4", "mxfp4_w4a16", "fp8_block"):
        assert v in moe_part
    assert "no sm_90 MoE kernels for this variant" in moe_part and "_grouped_gemm_kernel" in moe_part  # fp8_block


def test_the_moe_sweep_agrees_with_the_oracle_and_catches_a_wrong_backend(monkeypatch):
    r = sweep_moe.run_moe_sweep(variants=["nvfp4", "mxfp8_w8a16", "fp8_channel"], ms=[3], progress=False,
                                device=DEVICE)
    cells = {c["variant"]: c for c in r["cells"]}
    runs_here = dm.verdict(dm.entries()[("triton", "nvfp4")], dm.MoEProblem("nvfp4", 4, 2, 128, 128, 3),
                           sweep_moe.H.running_device(DEVICE))[0]
    problem, dev = dm.MoEProblem("nvfp4", 4, 2, 128, 128, 3), sweep_moe.H.running_device(DEVICE)
    # the kernel implementations of the MoE table that serve nvfp4 here (hopper on sm_90 too)
    serve_here = {i for (i, v), e in dm.entries().items() if v == "nvfp4" and i != "reference"
                  and dm.verdict(e, problem, dev)[0]}
    if runs_here:
        assert r["summary"]["ok"] and set(cells["nvfp4"]["ran"]) == serve_here
        for impl in serve_here:
            assert cells["nvfp4"]["diffs"][impl]["norm_rel"] <= sweep_moe.TOL_NORM_MOE
        # fp8_channel (per-token activation scales) is served by the lesson too, within the same bound
        assert cells["fp8_channel"]["ran"] == ["triton"], cells["fp8_channel"]
        assert cells["fp8_channel"]["diffs"]["triton"]["norm_rel"] <= sweep_moe.TOL_NORM_MOE
    if not dm.hopper_moe_on():
        assert dm.HOPPER_UNRUN in cells["nvfp4"]["skipped"]["hopper"]

    class GateUpSwapped(dm.TritonMoE):  # a plausible bug: silu on the up half
        def run(self, x, prepared, topk_ids, topk_weights, **kw):
            return super().run(x, prepared, topk_ids, topk_weights, **{**kw, "activation": "swigluoai"})

    if not runs_here:
        pytest.skip(f"the triton MoE cell does not run here: {cells['nvfp4']['skipped'].get('triton')}")
    dm.entries()
    monkeypatch.setitem(dm._TABLE, ("triton", "nvfp4"), GateUpSwapped("nvfp4"))
    bad = sweep_moe.run_moe_cell("nvfp4", 3, 4, 2, 128, 128, "silu", torch.bfloat16, ("triton",), seed=1,
                                 device=DEVICE)
    assert bad["status"] == "FAIL" and bad["diffs"]["triton"]["norm_rel"] > 0.1


def test_sweep_command_runs_the_moe_matrix(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    rc = sweep.main(["--moe", "--grid", "small", "--formats", "mxfp4", "--m", "1", "--dtypes", "bf16", "--no-progress",
                     "--plain", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "sweep MoE: 1 cells" in out
    assert json.loads(path.read_text())["moe"]["cells"][0]["variant"] == "mxfp4"


def test_split_shapes():
    assert bench_moe.split_shapes("moe") == (None, [bench_moe.MOE_SHAPE_BY_ID["gpt-oss-20b:moe"],
                                                    bench_moe.MOE_SHAPE_BY_ID["qwen3-30b-a3b:moe"]])
    dense, moe = bench_moe.split_shapes("square,qwen3-30b-a3b,tiny-moe")
    assert dense == "square" and [s.id for s in moe] == ["qwen3-30b-a3b:moe", "tiny-moe"]
    dense, moe = bench_moe.split_shapes("all")
    assert dense == "all" and len(moe) == 2
    s = bench_moe.MOE_SHAPE_BY_ID["gpt-oss-20b:moe"]
    assert (s.E, s.top_k, s.H, s.I, s.activation, s.variant) == (32, 4, 2880, 2880, "swigluoai", "mxfp4_w4a16")
    s = bench_moe.MOE_SHAPE_BY_ID["qwen3-30b-a3b:moe"]
    assert (s.E, s.top_k, s.H, s.I, s.activation, s.variant) == (128, 8, 2048, 768, "silu", "nvfp4")


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_the_bf16_baseline_computes_the_layer(activation):
    E, k, Hd, I, M = 4, 2, 64, 32, 7
    w13 = (torch.randn(E, 2 * I, Hd) / math.sqrt(Hd)).bfloat16().to(DEVICE)
    w2 = (torch.randn(E, Hd, I) / math.sqrt(I)).bfloat16().to(DEVICE)
    x = torch.randn(M, Hd).bfloat16().to(DEVICE)
    ids = torch.rand(M, E).argsort(dim=1)[:, :k].to(torch.int32).to(DEVICE)
    wt = torch.rand(M, k).to(DEVICE)
    ref = torch.zeros(M, Hd, dtype=torch.float64, device=DEVICE)
    for t in range(M):
        for j in range(k):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            ref[t] += wt[t, j].double() * (w2[e].double() @ formats.moe_activation(h, activation))
    # h, the activation's output and each expert's o are rounded to bf16 (2^-9 relative each), the
    # activation evaluated in bf16 (a few more), y rounded once: 8 x 2^-9 = 2^-6 of the norm covers them
    tol = 2.0 ** -6
    grouped = bench_moe._grouped_mm_runs(DEVICE) is None
    for g in {grouped, False}:
        y = bench_moe.bf16_moe(x, w13, w2, ids, wt, activation, g)
        assert y.dtype == torch.bfloat16
        assert (y.double() - ref).norm() <= tol * ref.norm(), f"grouped={g}"


def test_bench_times_the_tiny_moe_layer(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = bench.main(["--shapes", "tiny-moe", "--check", "--no-progress", "--plain", "--json", str(path),
                     "--m", "2", "--warmup-ms", "1", "--rep-ms", "5"])
    out = capsys.readouterr().out
    assert rc == 0 and "torch_bf16_moe" in out
    rows = json.loads(path.read_text())["moe"]["results"]
    assert rows[0]["kind"] == "moe_baseline" and rows[0]["us"] > 0
    by_impl = {r["name"]: r for r in rows[1:]}
    assert set(by_impl) == set(bench_moe.MOE_BENCH_IMPLS)
    if not dm.hopper_moe_on():
        assert "written, not yet run on a GPU" in by_impl["hopper"]["skipped"]
    ran = [r for r in by_impl.values() if "skipped" not in r]
    assert ran, "no MoE implementation ran here"
    for r in ran:
        assert r["us"] > 0 and r["check"]["ok"], r
    if "triton" in [r["name"] for r in ran]:
        assert "_grouped_gemm_kernel" in by_impl["triton"]["route"]
