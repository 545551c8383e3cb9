"""``b12x-dual diff`` and the watchdog on MoE layers (dispatch.moe_check, dispatch.apps.diff_models' MoE
readers, replay files of version 3), on the CPU: the reference and the Triton lesson (interpreter).

Models: a tiny Qwen3-MoE made by transformers with random weights (hidden 64, 4 experts, top-2,
moe_intermediate 32, 2 layers; its experts quantized here), and the same family written as a
compressed-tensors NVFP4 checkpoint by compressed-tensors' own code (tests/vllm_engine/engine_env.py's
linearize_experts / ignore_routers and tests/dispatch/vllm_plugin/checkpoints.py's quantize_ct, as the
engine's MoE checkpoints are made). Faults (tests/faults.py) are real dispatch.moe.TritonMoE backends
with one defect: one block-scale byte of one expert's W2 or W13 in the prepared experts, or a run that
drops ``renormalize``. The bounds are formats.bounds.moe_bound (the whole call, each expert alone) and,
per step, gemm_bound / moe_activation_bound (derived in formats/bounds.py); every assertion on a
departure names what a broken step would change (layer, expert, step, block, exit status).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _moe_testlib import diff_moe_folder
from conftest import DEVICE
from dispatch.apps import diff
from dispatch.apps.cli import main

import faults

transformers = pytest.importorskip("transformers", reason="transformers builds the tiny Qwen3-MoE")

H_, I_, E_, TOP_K = 64, 32, 4, 2


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["diff", *map(str, argv), "--no-progress", "--plain", "--device", DEVICE])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _config(layers: int = 2):
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=H_, intermediate_size=128, moe_intermediate_size=I_, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E_, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        initializer_range=0.08)


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    """The tiny random Qwen3-MoE, saved by transformers (a transformers model folder)."""
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(_config()).eval()
    with torch.no_grad():  # router logits of order 1, so that the top-2 is not a tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
    out = tmp_path_factory.mktemp("qwen_moe") / "tf"
    model.save_pretrained(out)
    return out, model


def test_clean_moe_model_exits_0_in_forward_order_with_the_models_own_routing(qwen_moe, tmp_path, capsys):
    """Both MoE layers and one attention linear, selected by name, ``<name>.experts`` and a glob, run in the
    model's forward order; every implementation agrees with the oracle (exit 0); the routing diff used is
    transformers' own router's on the same inputs (Qwen3MoeTopKRouter: softmax, top-2; renormalized by
    the implementations because norm_topk_prob is set)."""
    folder, model = qwen_moe
    out, _ = diff_moe_folder(lambda *a: _run(capsys, *a), folder, model,
                             "layers.1.mlp.experts,*.0.mlp,layers.0.self_attn.q_proj", "layers.0.self_attn.q_proj",
                             tmp_path, E=E_, top_k=TOP_K, H=H_, I=I_)
    assert "MoE layers: error / bound of the call" in out and "formats/bounds.py moe_bound" in out


@pytest.mark.parametrize("tensor,stage", [("w2", "w2_gemm"), ("w13", "w13_gemm")])
def test_fault_in_one_experts_block_names_layer_expert_step_and_block(qwen_moe, tmp_path, capsys, tensor, stage):
    """One block-scale byte of expert e's W2 (row 5: output column 5, column tile 0) or W13 (row 40: the
    up half, column tile 0), K-block 1, flipped in triton's prepared experts: diff exits 1 and names the
    first layer in forward order, triton, expert e, the step (w2_gemm / w13_gemm: the step before it,
    the quantized input, is byte-identical), the first token routed to e, tile 0, and the prepared byte."""
    folder, _ = qwen_moe
    rc, _, _ = _run(capsys, folder, "--layers", "layers.0.mlp", "--tokens", "6", "--impls", "reference",
                    "--json", tmp_path / "clean.json")
    ids = torch.tensor(json.loads((tmp_path / "clean.json").read_text())["layers"][0]["routing"]["topk_ids"])
    e = int(ids[0, 0])
    row = 5 if tensor == "w2" else 40
    with faults.installed_moe(faults.FlippedExpertScale, "nvfp4", expert=e, tensor=tensor, n=row, kb=1):
        rc, out, _ = _run(capsys, folder, "--layers", "*.mlp", "--tokens", "6", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_DEPARTS
    first = data["first"]
    tokens = (ids == e).any(dim=1).nonzero().flatten().tolist()
    assert {k: first[k] for k in ("layer", "impl", "kind", "stage", "expert", "tile")} == {
        "layer": "layers.0.mlp", "impl": "triton", "kind": "moe", "stage": stage, "expert": e, "tile": 0}
    assert first["row"] in tokens and first["ratio"] > 1
    assert first["weight"] == {"expert": e, "tensor": tensor, "what": "scale", "row": row, "kblock": 1,
                               "columns": [16, 31]}
    res = data["layers"][0]["results"]["triton"]
    # every expert before e with tokens was run alone, in expert order, and agreed; e is the first that departs
    assert [ex["expert"] for ex in res["experts"]] == [k for k in range(e + 1) if bool((ids == k).any())]
    assert all(ex["ok"] for ex in res["experts"][:-1]) and not res["experts"][-1]["ok"]
    assert data["layers"][0]["results"]["reference"]["ok"]
    assert (f"first bad block: layer layers.0.mlp (M=6), triton: expert {e}: the {tensor.upper()} GEMM departs first: "
            f"token {first['row']}, column tile 0") in out
    assert f"prepared expert {e} {tensor.upper()} differs from the layer's at row {row}, K-block 1" in out


def test_a_backend_without_steps_is_named_down_to_the_expert(qwen_moe, tmp_path, capsys):
    """The same flipped W2 block scale in a backend that keeps its steps on chip (stages -> None, as
    hopper and cute): diff exits 1 and names the layer, the implementation and expert e, and no step."""
    folder, _ = qwen_moe
    rc, _, _ = _run(capsys, folder, "--layers", "layers.0.mlp", "--tokens", "6", "--impls", "reference",
                    "--json", tmp_path / "clean.json")
    ids = torch.tensor(json.loads((tmp_path / "clean.json").read_text())["layers"][0]["routing"]["topk_ids"])
    e = int(ids[0, 0])
    with faults.installed_moe(faults.FlippedExpertScaleOnChip, "nvfp4", expert=e, tensor="w2", n=5, kb=1):
        rc, out, _ = _run(capsys, folder, "--layers", "layers.0.mlp", "--tokens", "6", "--impls", "triton",
                          "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    res = data["layers"][0]["results"]["triton"]
    assert rc == diff.EXIT_DEPARTS and res["stages_exposed"] is False
    assert {k: data["first"][k] for k in ("layer", "impl", "kind", "stage", "expert", "tile")} == {
        "layer": "layers.0.mlp", "impl": "triton", "kind": "moe", "stage": "expert", "expert": e, "tile": 0}


def test_dropped_renormalize_is_the_weighted_combine(qwen_moe, tmp_path, capsys):
    """A run that ignores renormalize: every expert alone (weight 1) is right, so no expert is named; the
    call departs at the combine (the router weights do not sum to 1), in column tile 0; exit 1."""
    folder, _ = qwen_moe
    with faults.installed_moe(faults.DropsRenormalize, "nvfp4"):
        rc, out, _ = _run(capsys, folder, "--layers", "layers.0.mlp", "--tokens", "4", "--impls", "triton",
                          "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    first = data["first"]
    assert rc == diff.EXIT_DEPARTS
    assert (first["stage"], first["tile"]) == ("combine", 0) and "expert" not in first
    res = data["layers"][0]["results"]["triton"]
    assert res["experts"] and all(ex["ok"] for ex in res["experts"])
    assert res["combine"]["n_bad"] >= 1 and res["moe"]["n_bad"] >= 1
    assert f"the router-weighted combine of the experts' outputs departs first: token {first['row']}" in out


def test_steps_of_a_clean_expert_are_within_their_bounds(qwen_moe):
    """dispatch.moe_check.expert_steps on a correct triton expert: both quantized inputs byte-identical to
    formats.quantize's, both GEMMs and the activation within their bounds (each step judged on the
    implementation's own input), every step present in forward order."""
    from dispatch import moe as dmoe
    from dispatch import moe_check
    from dispatch.apps import diff_models as DM

    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "nvfp4", ["layers.1.mlp"]).layers
    lay = lay.to(DEVICE)
    x = torch.randn(5, H_, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    backend = dmoe.get("triton", "nvfp4")
    tokens = torch.arange(5)
    steps, first, inter = moe_check.expert_steps(backend, backend.prepare(lay.w13, lay.w2), lay, 3, x, tokens,
                                                 torch.device(DEVICE).type)
    assert [s["step"] for s in steps] == list(moe_check.STEPS) and first is None and inter.shape == (5, I_)
    for s in steps:
        assert s["quant"]["equal"] if "quant" in s else s["worst"] <= 1, s["step"]


def test_auto_tokens_cover_every_moe_route_here(qwen_moe):
    """The default Ms of an MoE layer hold 1, 17, 300 and every M at which an MoE implementation's route
    (kernels, tile) changes on this device: every M up to MAX_AUTO_M takes the route of the largest
    default at or below it."""
    from dispatch.apps import diff_models as DM

    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "nvfp4", ["layers.0.mlp"]).layers
    ms = diff.auto_tokens_moe(lay, torch.bfloat16, DEVICE)
    assert {1, 17, 300} <= set(ms)
    run, _ = diff.moe_backends_here(lay, 1, torch.bfloat16, DEVICE)
    dev = diff._device_info(DEVICE)
    for backend in run.values():
        key = lambda m: diff.route_key(backend.route(diff._moe_problem(lay, m, torch.bfloat16), dev))  # noqa: E731
        for m in range(1, diff.MAX_AUTO_M + 1, 13):
            assert key(m) == key(max(a for a in ms if a <= m)), (backend.impl, m)
    assert {"triton", "reference"} <= set(run)


# ---------------------------------------------------------------------------------------------
# The watchdog and replay files of MoE calls
# ---------------------------------------------------------------------------------------------
def test_watchdog_replay_roundtrip_holds_the_routing_and_names_the_expert(qwen_moe, tmp_path, capsys, monkeypatch,
                                                                           caplog):
    """B12X_CHECK=1 on a BoundMoE served by a faulted triton: the call is checked against the oracle on its
    own routing, split by expert and step (one WARNING naming expert e and the W2 GEMM), one replay file (version 3) holding x, topk_ids, topk_weights, renormalize,
    the experts (byte for byte) and y; diff --replay with the fault present reproduces it and names the
    expert and step (exit 1); without it, the recorded output still departs, the rerun does not (exit 0)."""
    from dispatch import check, moe_check, replay
    from dispatch import moe as dmoe
    from dispatch.apps import diff_models as DM

    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "nvfp4", ["layers.0.mlp"]).layers
    x = torch.randn(6, H_, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEVICE)
    lay = lay.to(DEVICE)
    ids, w = moe_check.route_tokens(x, lay.router, TOP_K)
    e = int(ids[0, 1])
    monkeypatch.setenv("B12X_CHECK", "1")
    monkeypatch.setenv("B12X_CHECK_DIR", str(tmp_path / "replays"))
    monkeypatch.setenv("B12X_IMPL", "triton")
    check.reload()
    try:
        with faults.installed_moe(faults.FlippedExpertScale, "nvfp4", expert=e, n=9, kb=0):
            bound = dmoe.BoundMoE(lay.w13, lay.w2, name="model.layers.0.mlp")
            with caplog.at_level("WARNING", logger="dispatch.check"):
                y = bound(x, ids, w, renormalize=True)
                bound(x, ids, w, renormalize=True)  # a diverged layer is not checked again
            warnings = [r for r in caplog.records if "b12x-dual watchdog" in r.getMessage()]
            # the watchdog splits the departing call by expert and step (once: the layer is not sampled again)
            assert len(warnings) == 1 and f"layer model.layers.0.mlp on triton (nvfp4, M=6): expert {e}: the W2 GEMM " \
                                          "departs first" in warnings[0].getMessage()
            assert f"prepared expert {e} W2 differs from the layer's at row 9, K-block 0" in warnings[0].getMessage()
            assert check.WATCHDOG.diverged["model.layers.0.mlp"]["moe"]["n_bad"] >= 1
            (path,) = (tmp_path / "replays").glob("*.b12x-replay.safetensors")
            rp = replay.read(path)
            assert isinstance(rp, replay.MoEReplay) and rp.version == replay.VERSION == 3
            assert torch.equal(rp.topk_ids, ids.cpu()) and torch.equal(rp.topk_weights, w.cpu()) and rp.renormalize
            assert torch.equal(rp.x, x.cpu()) and torch.equal(rp.y, y.cpu())
            assert len(rp.layer.w13) == E_ and all(
                torch.equal(a.data.cpu(), b.data.cpu()) and torch.equal(a.scale.cpu(), b.scale.cpu())
                for a, b in zip(rp.layer.w13 + rp.layer.w2, lay.w13 + lay.w2))
            rc, out, _ = _run(capsys, "--replay", path, "--json", tmp_path / "r.json")
        data = json.loads((tmp_path / "r.json").read_text())
        assert rc == diff.EXIT_DEPARTS and data["replay"]["reproduces"] is True
        assert (data["first"]["expert"], data["first"]["stage"]) == (e, "w2_gemm")
        assert "reproduces here: YES" in out
        rc, out, _ = _run(capsys, "--replay", path)
        assert rc == diff.EXIT_OK and "reproduces here: no" in out
        assert f"recorded by the watchdog: expert {e}: the W2 GEMM departs first" in out
        assert "recorded output against the oracle here (formats.bounds.moe_bound, the recorded routing): the MoE " \
               "call's output departs first" in out
    finally:
        monkeypatch.delenv("B12X_CHECK")
        check.reload()


def test_watchdog_off_never_checks_an_moe_call(qwen_moe, monkeypatch):
    """B12X_CHECK unset: BoundMoE calls never enter the checker (WATCHDOG is None)."""
    from dispatch import check, moe_check
    from dispatch import moe as dmoe
    from dispatch.apps import diff_models as DM

    monkeypatch.delenv("B12X_CHECK", raising=False)
    check.reload()
    assert check.WATCHDOG is None

    def boom(*a, **k):
        raise AssertionError("the watchdog ran with B12X_CHECK off")

    monkeypatch.setattr(moe_check, "after_moe_call", boom)
    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "nvfp4", ["layers.0.mlp"]).layers
    lay = lay.to(DEVICE)
    x = torch.randn(2, H_).bfloat16().to(DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    y = dmoe.BoundMoE(lay.w13, lay.w2, name="l")(x, ids, torch.full((2, 2), 0.5, device=DEVICE), watch=True)
    assert y.shape == (2, H_)


# ---------------------------------------------------------------------------------------------
# A compressed-tensors MoE checkpoint written by compressed-tensors' own code
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct_moe(tmp_path_factory):
    pytest.importorskip("compressed_tensors",
                        reason="compressed-tensors writes the checkpoint (pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt)")
    here = Path(__file__).resolve().parents[2]
    for sub in (here / "vllm_engine", here / "dispatch" / "vllm_plugin"):
        if str(sub) not in sys.path:
            sys.path.insert(0, str(sub))
    import checkpoints
    import engine_env

    torch.manual_seed(11)
    model = transformers.Qwen3MoeForCausalLM(_config(layers=1)).eval()
    engine_env.linearize_experts(model)  # llm-compressor's unfused experts: modules mlp.experts.<e>.<proj>
    mlp = model.model.layers[0].mlp
    float_weights = {"router": mlp.gate.weight.detach().float().clone(),
                     "gate_up": [(x.gate_proj.weight.detach().double().clone(),
                                  x.up_proj.weight.detach().double().clone()) for x in mlp.experts]}
    # (compressing replaces the weights in place)
    out = tmp_path_factory.mktemp("ct_moe") / "nvfp4"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    checkpoints.quantize_ct(model, ids, "NVFP4", out, ignore=["lm_head"], prefix="model.layers.",
                            fused=engine_env.MOE_FUSED)
    engine_env.ignore_routers(out, 1)
    return out, float_weights


def test_ct_moe_checkpoint_is_read_as_moe_layers(ct_moe, tmp_path, capsys):
    """The checkpoint's expert modules become one MoE layer (W13 = gate rows then up rows of each expert,
    W2 = down; per-expert static input global scales [E]); the router is the ignored float gate; diff of
    it exits 0."""
    import formats
    from dispatch.apps import diff_models as DM

    folder, ref = ct_moe
    m = DM.load_model(str(folder))
    moe = [lay for lay in m.layers if lay.name == "model.layers.0.mlp"]
    assert len(moe) == 1 and [lay.name for lay in m.layers].index("model.layers.0.mlp") == len(m.layers) - 1
    (lay,) = moe
    assert (lay.variant, lay.num_experts, lay.hidden, lay.intermediate, lay.top_k, lay.renormalize) == (
        "nvfp4", E_, H_, I_, TOP_K, True)
    assert lay.w13_act_opts["global_scale"].shape == (E_,) and lay.w2_act_opts["global_scale"].shape == (E_,)
    torch.testing.assert_close(lay.router, ref["router"])
    for e, (gate, up) in enumerate(ref["gate_up"]):
        w13 = formats.dequantize(lay.w13[e], torch.float64)
        assert (w13[:I_] - gate).abs().mean() < (w13[:I_] - up).abs().mean()  # gate rows first
        assert (w13[I_:] - up).abs().mean() < (w13[I_:] - gate).abs().mean()
    rc, out, _ = _run(capsys, folder, "--layers", "*.mlp", "--tokens", "4")
    assert rc == diff.EXIT_OK, out


def test_ct_moe_nan_scale_in_one_expert_is_named_with_layer_and_expert(ct_moe, tmp_path, capsys):
    """An NVFP4 block scale of expert 2's down_proj set to 0x7F (NaN) in a copy of the checkpoint: the
    converters refuse that expert, so the MoE layer is not run; the checkpoint stage names the layer,
    expert 2, the stored tensor and its index; exit 3 (the implementations agree on the rest)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = ct_moe
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (f,) = bad.glob("*.safetensors")
    t = load_file(str(f))
    key = "model.layers.0.mlp.experts.2.down_proj.weight_scale"
    t[key].view(torch.uint8)[9, 1] = 0x7F
    save_file(t, str(f), metadata={"format": "pt"})
    rc, out, _ = _run(capsys, bad, "--layers", "*.mlp,*.q_proj", "--tokens", "2", "--impls", "reference",
                      "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_CHECKPOINT
    (finding,) = data["checkpoint"]["findings"]
    assert (finding["layer"], finding["expert"], finding["tensor"], finding["kind"], finding["positions"]) == (
        "model.layers.0.mlp", 2, key, "nan_scale", [{"index": [9, 1]}])
    assert [r["layer"] for r in data["layers"]] == ["model.layers.0.self_attn.q_proj"]
    assert "the checkpoint is NOT sound: 1 finding(s) in 1 layer(s); first: layer model.layers.0.mlp" in out


def test_ct_moe_gate_and_up_global_scales_that_differ_are_named(ct_moe, tmp_path, capsys):
    """Expert 1's up_proj weight_global_scale doubled in a copy: its W13 would need two NVFP4 global
    scales; diff names the layer, the expert and why (exit 2, a MODEL it cannot read)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = ct_moe
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (f,) = bad.glob("*.safetensors")
    t = load_file(str(f))
    t["model.layers.0.mlp.experts.1.up_proj.weight_global_scale"] *= 2
    save_file(t, str(f), metadata={"format": "pt"})
    rc, _, err = _run(capsys, bad, "--layers", "*.mlp", "--tokens", "2", "--impls", "reference")
    assert rc == diff.EXIT_ARGS
    assert "MoE layer model.layers.0.mlp: expert 1: gate and up have different NVFP4 weight global scales" in err


def test_moe_replay_and_router_errors_are_named(qwen_moe, tmp_path, capsys):
    """An MoE replay file without its topk_ids: exit 2 naming the tensor; a router of another H and a top_k
    above the expert count: ValueErrors naming the argument and what is allowed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dispatch import moe_check, replay
    from dispatch.apps import diff_models as DM

    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "nvfp4", ["layers.0.mlp"]).layers
    x = torch.randn(3, H_).bfloat16()
    ids, w = moe_check.route_tokens(x, lay.router, TOP_K)
    path = replay.write_moe(tmp_path, layer=lay, impl="triton", x=x, topk_ids=ids, topk_weights=w)
    with safe_open(str(path), "pt") as f:
        md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != "topk_ids"}
    save_file(tensors, str(path), metadata=md)
    rc, _, err = _run(capsys, "--replay", path)
    assert rc == diff.EXIT_ARGS and "tensor 'topk_ids' is missing" in err
    with pytest.raises(ValueError, match=r"router must be \[E, H=32\], got \(4, 64\)"):
        moe_check.route_tokens(torch.zeros(2, 32), lay.router, TOP_K)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\] \(the expert count\), got 5"):
        moe_check.route_tokens(x, lay.router, 5)


def test_text_captures_the_moe_blocks_own_input(qwen_moe, tmp_path, capsys, monkeypatch):
    """--text on the transformers folder: the MoE block's real input (one row per token of the text, the
    hidden state after the attention and the norm) is captured by a hook on the block, routed by its
    router and diffed (exit 0); --save-inputs holds exactly what the block received in the forward."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder, model = qwen_moe
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, _ = _run(capsys, folder, "--layers", "layers.1.mlp", "--text", "w5 w9 w2 w7", "--impls", "reference",
                      "--json", tmp_path / "d.json", "--save-inputs", tmp_path / "x.safetensors")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_OK, out
    (r,) = data["layers"]
    assert (r["layer"], r["kind"], r["input"], r["M"]) == ("layers.1.mlp", "moe", "--text", 4)
    got = {}
    h = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0].reshape(-1, H_)))
    try:
        with torch.no_grad():
            model(torch.tensor([[6, 10, 3, 8]]))
    finally:
        h.remove()
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(str(tmp_path / "x.safetensors"))["layers.1.mlp"], got["x"].bfloat16())


def test_checkpoint_stage_names_a_nan_code_in_one_experts_w2(qwen_moe):
    """An e4m3 weight code of expert 2's W2 (fp8_channel experts) set to 0x7F (NaN) at row 3, column 10:
    the checkpoint stage names the layer, expert 2, the tensor experts.2.w2.data and the position, and the
    oracle's NaN output (every token routed to expert 2 reads W2 row 3: output column 3); not sound."""
    from dispatch import moe_check
    from dispatch.apps import diff_models as DM

    folder, _ = qwen_moe
    (lay,) = DM.load_model(str(folder), "fp8_channel", ["layers.0.mlp"]).layers
    lay.w2[2].data.view(torch.uint8)[3, 10] = 0x7F
    x = torch.randn(8, H_, generator=torch.Generator().manual_seed(2)).bfloat16()
    ckpt = diff.checkpoint_stage([lay], {lay.name: [(x, "random")]}, {}, "cpu")
    assert ckpt["sound"] is False
    code, oracle = ckpt["findings"]
    assert (code["layer"], code["expert"], code["tensor"], code["kind"], code["positions"][0]["row"],
            code["positions"][0]["column"]) == ("layers.0.mlp", 2, "experts.2.w2.data", "nan_code", 3, 10)
    ids, _ = moe_check.route_tokens(x, lay.router, TOP_K)
    routed = sorted(set((ids == 2).any(dim=1).nonzero().flatten().tolist()))
    assert (oracle["kind"], oracle["count"]) == ("nonfinite_output", len(routed)) and routed
    assert [(p["row"], p["column"]) for p in oracle["positions"]] == [(t, 3) for t in routed][:8]
