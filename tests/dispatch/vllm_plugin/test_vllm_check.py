"""The numerics watchdog (B12X_CHECK) inside real vLLM 0.33.0 layers on the CPU.

A real compressed-tensors NVFP4 checkpoint (checkpoints.py) is loaded into vLLM's QKVParallelLinear
with B12X_IMPL=triton; the fault is a real Triton backend with a flipped block-scale byte in its
prepared weight (tests/faults.py), registered for the test. The watchdog recomputes the call with
the oracle on the weight as loaded and names the layer (vLLM's prefix), the implementation and the
first bad block, and writes a replay file that reproduces the fault on this CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from _vllm_env import ckpt, ckpt_root, dist, forward, impl, loaded  # noqa: F401
from conftest import make_input
from dispatch import check, replay
from dispatch.apps import diff
from dispatch.vllm_plugin import ops

import faults

LAYER = "encoder.layer.0.attention.self.qkv"


@pytest.fixture
def watchdog(monkeypatch, tmp_path):
    def on(value: str):
        monkeypatch.setenv(check.ENV_CHECK, value)
        monkeypatch.setenv(check.ENV_DIR, str(tmp_path))
        return check.reload()

    yield on
    monkeypatch.delenv(check.ENV_CHECK, raising=False)
    check.reload()


def test_plugin_watchdog_finds_the_fault(dist, ckpt, impl, watchdog, caplog, tmp_path):
    impl("triton")
    wd = watchdog("every:1")
    # q, k, v fused: N = 3 x 384; the flipped scale is in row 500 (k's rows), K-block 2
    with faults.installed(faults.FlippedWeightScale, "nvfp4", n=500, kb=2):
        layers, _ = loaded(ckpt("ct_nvfp4"), ("qkv",))
        st = ops.state(layers["qkv"].b12x_dual_handle)
        assert st.chosen.impl == "triton" and st.qweight is not None
        x = make_input((3, 384), torch.bfloat16, device="cpu")
        with caplog.at_level(logging.WARNING, "dispatch.check"):
            forward(layers["qkv"], x)
        msgs = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
        assert len(msgs) == 1 and LAYER in msgs[0] and "triton" in msgs[0]
        rep = wd.diverged[LAYER]
        assert rep["first"]["stage"] == "gemm" and rep["first"]["row"] == 0 and rep["first"]["tile"] == 500 // 128
        again = diff.run_replay(rep["replay"], device="cpu")
        assert again["replay"]["reproduces"] is True and again["first"]["tile"] == 500 // 128
    rp = replay.read(rep["replay"])
    assert rp.layer == LAYER and rp.variant == "nvfp4" and "global_scale" in rp.act_opts
    clean = diff.run_replay(rep["replay"], device="cpu")
    assert clean["replay"]["reproduces"] is False and not clean["replay"]["recorded_output"]["ok"]


def test_plugin_watchdog_off_keeps_nothing_and_checks_nothing(dist, ckpt, impl, monkeypatch):
    """B12X_CHECK unset: no weight copy kept for the oracle, and the op never calls the checker."""
    impl("triton")
    monkeypatch.delenv(check.ENV_CHECK, raising=False)
    assert check.reload() is None

    def boom(*a, **k):
        raise AssertionError("the checker was called with B12X_CHECK off")

    monkeypatch.setattr(check, "check_call", boom)
    monkeypatch.setattr(check.Watchdog, "after_call", boom)
    layers, _ = loaded(ckpt("ct_mxfp8"), ("o",))
    st = ops.state(layers["o"].b12x_dual_handle)
    assert st.qweight is None
    y = forward(layers["o"], make_input((2, 384), torch.bfloat16, device="cpu"))
    assert torch.isfinite(y).all()
