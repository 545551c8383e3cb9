"""TP = 2 (two processes over gloo on the CPU machine) equals TP = 1: column shards gathered back
bit for bit, row-parallel outputs reduced within the rounding of the partial sums."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _vllm_env import HERE, ckpt, ckpt_root, dist, forward, loaded  # noqa: F401
from conftest import rel_err
import harness

KINDS = ["ct_nvfp4", "ct_nvfp4a16", "modelopt_nvfp4", "ct_fp8", "ct_fp8_block", "deepseek_fp8_block", "ct_mxfp4",
         "ct_mxfp8"]
# RowParallelLinear at TP = 2: each rank's partial product is rounded to bf16 and the all-reduce
# rounds their sum again. With random inputs each partial is about ||y|| / sqrt(2), so the norm-wise
# error is about 2^-9 / sqrt(3) * (2 * 0.71 + 1) ||y|| ~ 2.7e-3 ||y||; 4e-3 covers it.
ROW_TOL = 4e-3


@pytest.fixture(scope="module")
def tp2(ckpt, tmp_path_factory):
    for kind in KINDS:
        ckpt(kind)
    root = ckpt(KINDS[0]).parent
    out = tmp_path_factory.mktemp("tp2")
    env = {**os.environ, "B12X_IMPL": "reference"}
    run = subprocess.run([sys.executable, str(HERE / "tp_worker.py"), str(out), str(root), *KINDS],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return [torch.load(out / f"r{r}.pt") for r in range(2)]


def _gather_qkv(shards):
    """Per-rank [q_r, k_r, v_r] (each N/2 of its part) -> TP = 1's [q, k, v]."""
    parts = [s.split(s.shape[-1] // 3, dim=-1) for s in shards]
    return torch.cat([torch.cat([p[i] for p in parts], -1) for i in range(3)], -1)


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_tp1(kind, tp2, dist, ckpt, monkeypatch):
    import tp_worker

    monkeypatch.setenv("B12X_IMPL", "reference")
    col = tp_worker.col_layer(kind)
    layers, _ = loaded(ckpt(kind), (col, "down"))
    x, x2 = tp_worker.inputs()
    r0, r1 = tp2[0][kind], tp2[1][kind]
    assert r0["kernel"].startswith("B12xDual") and r1["kernel"] == r0["kernel"]
    gathered = _gather_qkv([r0["col"], r1["col"]]) if col == "qkv" else torch.cat([r0["col"], r1["col"]], -1)
    assert torch.equal(gathered, forward(layers[col], x))
    y1 = forward(layers["down"], x2)
    assert torch.equal(r0["down"], r1["down"])  # the all-reduce leaves both ranks the same
    err = rel_err(r0["down"], y1)
    assert 0 <= err <= ROW_TOL, f"{kind}: TP=2 row-parallel vs TP=1 rel err {err:.2e}"


def test_tp2_shard_k_refused_naming_k(tp2):
    """Block FP8 with 2880 input features at TP = 2: the shard's K = 1440 is named (by our
    can_implement, or by vLLM's own block-shape validation where it comes first); a q/k/v shard of
    192 rows is refused by vLLM's validation, naming the 192."""
    for r in tp2:
        assert "1440" in r["refused"] and "128" in r["refused"], r["refused"]
        assert "192" in r["refused_qkv"] and "128" in r["refused_qkv"], r["refused_qkv"]
