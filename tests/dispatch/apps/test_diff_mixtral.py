"""``b12x-dual diff`` on Mixtral: its MoE layers read as MoE layers (not dense linears) with Mixtral's
routing (softmax over the experts, top-k, the top-k weights always renormalized to sum 1), on the CPU.

Models: a tiny random Mixtral made by transformers (hidden 64, 4 experts, top-2, intermediate 32, 2
layers): its transformers folder (transformers 5.20 holds the experts as 3-D parameters,
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], and a ``MixtralTopKRouter``
without ``norm_topk_prob``); and the same family as a compressed-tensors NVFP4 checkpoint with
Mixtral's checkpoint naming (``model.layers.<i>.block_sparse_moe.experts.<e>.w1/w2/w3``, router
``block_sparse_moe.gate.weight``), written by compressed-tensors' own code through the project's
helper (tests/dispatch/vllm_plugin/checkpoints.py quantize_ct) after the experts are unfused into
per-expert linears, as llm-compressor does. The numbers are checked against the float64 oracle
(formats.reference_moe) with formats.bounds.moe_bound; the fault is tests/faults.py's
FlippedExpertScale (one block-scale byte of one expert's W2 in triton's prepared experts).
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

transformers = pytest.importorskip("transformers", reason="transformers builds the tiny Mixtral")
if not hasattr(transformers.models.mixtral.modeling_mixtral, "MixtralTopKRouter"):
    pytest.skip(f"transformers {transformers.__version__} keeps Mixtral's experts as modules (these tests read "
                "transformers 5's 3-D experts and MixtralTopKRouter)", allow_module_level=True)

H_, I_, E_, TOP_K = 64, 32, 4, 2


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["diff", *map(str, argv), "--no-progress", "--plain", "--device", DEVICE])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _mixtral(seed: int, layers: int = 2):
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=H_, intermediate_size=I_, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=E_, num_experts_per_tok=TOP_K,
        max_position_embeddings=64, initializer_range=0.08, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # router logits of order 1, so that the top-2 is not a tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def mixtral_tf(tmp_path_factory):
    """The tiny random Mixtral, saved by transformers (a transformers model folder)."""
    model = _mixtral(5)
    out = tmp_path_factory.mktemp("mixtral") / "tf"
    model.save_pretrained(out)
    return out, model


def test_transformers_mixtral_moe_blocks_are_moe_layers_with_mixtrals_routing(mixtral_tf, tmp_path, capsys):
    """Both MoE blocks are read as MoE layers (E, top_k, H, I; not as dense linears: no ``experts`` linear is
    listed), renormalize read from MixtralTopKRouter's own output (True: it has no norm_topk_prob); the
    routing diff used is the router's own on the same inputs, renormalized; every implementation agrees
    with the oracle (exit 0)."""
    folder, model = mixtral_tf
    out, data = diff_moe_folder(lambda *a: _run(capsys, *a), folder, model, "*.mlp,layers.0.self_attn.o_proj",
                              "layers.0.self_attn.o_proj", tmp_path, E=E_, top_k=TOP_K, H=H_, I=I_)
    assert data["notes"] == ["routers: MixtralTopKRouter: softmax top-2, renormalized to sum 1 (read from its own "
                             "output)"]
    assert "note: routers: MixtralTopKRouter" in out


def test_router_semantics_are_read_from_the_routers_output():
    """router_renormalizes: Mixtral's router renormalizes; Qwen3-MoE's follows norm_topk_prob (both values);
    a router that scales its top-k weights (as DeepSeek's routed_scaling_factor) or adds a bias to the
    logits is refused by name (diff's routing would not be the model's), and so is one whose output
    cannot tell renormalized weights from plain ones (top_k = E)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from dispatch.apps import diff_models as DM

    mix = _mixtral(1, layers=1).model.layers[0].mlp.gate
    assert DM.router_renormalizes("m", mix, TOP_K) is True
    for norm in (False, True):
        cfg = transformers.Qwen3MoeConfig(hidden_size=H_, num_experts=E_, num_experts_per_tok=TOP_K,
                                          norm_topk_prob=norm)
        q = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(q.weight, 0.0, 0.3)
        assert DM.router_renormalizes("q", q, TOP_K) is norm

    class Scaled(MixtralTopKRouter):
        def forward(self, x):
            logits, w, idx = super().forward(x)
            return logits, 2.5 * w, idx

    class Biased(MixtralTopKRouter):
        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight) + torch.arange(self.num_experts, dtype=x.dtype)
            w, idx = torch.topk(torch.softmax(logits.float(), -1), self.top_k, dim=-1)
            return logits, w / w.sum(-1, keepdim=True), idx

    cfg = transformers.MixtralConfig(hidden_size=H_, num_local_experts=E_, num_experts_per_tok=TOP_K)
    for cls, match in ((Scaled, "neither by their softmax probabilities nor"), (Biased, "selects other experts")):
        r = cls(cfg)
        r.weight.data.copy_(mix.weight.data)
        with pytest.raises(ValueError, match=rf"MoE layer x: router {cls.__name__} .*{match}"):
            DM.router_renormalizes("x", r, TOP_K)
    # top_k = E: the weights sum to 1 with or without renormalizing, so the output cannot tell
    every = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=H_, num_local_experts=E_,
                                                         num_experts_per_tok=E_))
    every.weight.data.copy_(mix.weight.data)
    with pytest.raises(ValueError, match=r"MoE layer e: router MixtralTopKRouter: its top-\d+ softmax weights sum to "
                                         r"1 on every probe row"):
        DM.router_renormalizes("e", every, E_)


# ---------------------------------------------------------------------------------------------
# A compressed-tensors Mixtral checkpoint: block_sparse_moe.experts.<e>.w1 / w2 / w3
# ---------------------------------------------------------------------------------------------
class _Expert(torch.nn.Module):
    """One Mixtral expert as the original checkpoints name it: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, act):
        super().__init__()
        self.w1 = torch.nn.Linear(H_, I_, bias=False)
        self.w3 = torch.nn.Linear(H_, I_, bias=False)
        self.w2 = torch.nn.Linear(I_, H_, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class _LinearExperts(torch.nn.ModuleList):
    """MixtralExperts unfused into one _Expert per expert (llm-compressor's linearized experts), same
    forward signature; every token runs through every expert so each input observer sees the batch."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            y = expert(hidden_states)
            token, slot = torch.where(top_k_index == e)
            out.index_add_(0, token, (y[token] * top_k_weights[token, slot, None]).to(out.dtype))
        return out


@pytest.fixture(scope="module")
def ct_mixtral(tmp_path_factory):
    """The tiny Mixtral (2 layers) as a compressed-tensors NVFP4 checkpoint with Mixtral's naming, and its
    float router and experts."""
    pytest.importorskip("compressed_tensors",
                        reason="compressed-tensors writes the checkpoint (pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt)")
    here = Path(__file__).resolve().parents[1] / "vllm_plugin"
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    import checkpoints
    from safetensors.torch import load_file, save_file

    model = _mixtral(11)
    for layer in model.model.layers:
        fused = layer.mlp.experts
        experts = _LinearExperts([_Expert(fused.act_fn) for _ in range(E_)])
        with torch.no_grad():
            for e, x in enumerate(experts):
                x.w1.weight.copy_(fused.gate_up_proj[e, :I_])  # gate rows first, then up
                x.w3.weight.copy_(fused.gate_up_proj[e, I_:])
                x.w2.weight.copy_(fused.down_proj[e])
        layer.mlp.experts = experts
    mlp = model.model.layers[0].mlp
    ref = {"router": mlp.gate.weight.detach().float().clone(), "w1": [x.w1.weight.detach().double().clone()
                                                                     for x in mlp.experts]}
    tmp = tmp_path_factory.mktemp("ct_mixtral")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    checkpoints.quantize_ct(model, ids, "NVFP4", tmp / "ct", ignore=["lm_head"], prefix="model.layers.",
                            fused=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("w1", "w3")))
    # Mixtral's checkpoint naming: the MoE block is block_sparse_moe (transformers 5 renames it mlp on
    # load); the router stays unquantized (ignored), as llm-compressor's MoE recipes leave it
    out = tmp / "nvfp4"
    out.mkdir()
    (f,) = (tmp / "ct").glob("*.safetensors")
    t = {k.replace(".mlp.", ".block_sparse_moe."): v.contiguous() for k, v in load_file(str(f)).items()}
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp / "ct" / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head"] + [f"model.layers.{i}.block_sparse_moe.gate" for i in (0, 1)]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in t
    assert "model.layers.0.block_sparse_moe.gate.weight" in t and not any(".mlp." in k for k in t)
    return out, ref


def test_ct_mixtral_checkpoint_is_read_as_an_moe_layer(ct_mixtral, capsys):
    """block_sparse_moe.experts.<e>.w1/w3/w2 of each layer become one MoE layer model.layers.<i>.block_sparse_moe
    (W13 = w1 rows then w3 rows, W2 = w2), after that layer's attention and before the next layer's in
    forward order (the module order of transformers' Mixtral, whose ``mlp`` the checkpoint calls
    block_sparse_moe: transformers' own renaming, conversion_mapping); layer 0's router is the
    float block_sparse_moe.gate.weight, renormalized as MixtralTopKRouter does (read from the router
    transformers builds, holding the checkpoint's weight); no expert linear is listed as a dense layer;
    diff of it exits 0."""
    import formats
    from dispatch.apps import diff_models as DM
    from dispatch.moe_check import MoELayer

    folder, ref = ct_mixtral
    m = DM.load_model(str(folder))
    name = "model.layers.0.block_sparse_moe"
    assert [lay.name for lay in m.layers if isinstance(lay, MoELayer)] == [name, "model.layers.1.block_sparse_moe"]
    assert not [lay.name for lay in m.layers if "experts" in lay.name]
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert [lay.name for lay in m.layers] == [f"model.layers.{i}.{p}" for i in (0, 1) for p in (
        *(f"self_attn.{a}" for a in attn), "block_sparse_moe")]
    assert m.order.startswith("the model's module order")
    lay = m.layers[4]
    assert (lay.variant, lay.num_experts, lay.hidden, lay.intermediate, lay.top_k, lay.renormalize) == (
        "nvfp4", E_, H_, I_, TOP_K, True)
    assert m.notes == ["routers: MixtralTopKRouter: softmax top-2, renormalized to sum 1 (read from its own output)"]
    torch.testing.assert_close(lay.router, ref["router"])
    for e, w1 in enumerate(ref["w1"]):
        w13 = formats.dequantize(lay.w13[e], torch.float64)
        assert (w13[:I_] - w1).abs().mean() < (w13[I_:] - w1).abs().mean()  # w1 (gate) rows first
    rc, out, _ = _run(capsys, folder, "--layers", "*.block_sparse_moe", "--tokens", "4")
    assert rc == diff.EXIT_OK, out
    assert "MoE layers: error / bound of the call" in out


def test_ct_mixtral_fault_names_the_first_wrong_expert(ct_mixtral, tmp_path, capsys):
    """One block-scale byte of expert e's W2 (row 5, K-block 1) flipped in triton's prepared experts: diff
    exits 1 and names model.layers.0.block_sparse_moe, triton, expert e (the first routed token's first
    expert), the W2 GEMM and column tile 0; the reference agrees with the oracle."""
    folder, _ = ct_mixtral
    rc, _, _ = _run(capsys, folder, "--layers", "*.block_sparse_moe", "--tokens", "6", "--impls", "reference",
                    "--json", tmp_path / "clean.json")
    clean = json.loads((tmp_path / "clean.json").read_text())["layers"][0]
    assert rc == diff.EXIT_OK and clean["layer"] == "model.layers.0.block_sparse_moe"
    assert clean["routing"]["renormalize"] is True
    ids = torch.tensor(clean["routing"]["topk_ids"])
    e = int(ids[0, 0])
    with faults.installed_moe(faults.FlippedExpertScale, "nvfp4", expert=e, tensor="w2", n=5, kb=1):
        rc, out, _ = _run(capsys, folder, "--layers", "*.block_sparse_moe", "--tokens", "6", "--json",
                          tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_DEPARTS, out
    assert {k: data["first"][k] for k in ("layer", "impl", "kind", "stage", "expert", "tile")} == {
        "layer": "model.layers.0.block_sparse_moe", "impl": "triton", "kind": "moe", "stage": "w2_gemm",
        "expert": e, "tile": 0}
    assert data["first"]["row"] in (ids == e).any(dim=1).nonzero().flatten().tolist()
    assert data["layers"][0]["results"]["reference"]["ok"]


def test_dense_expert_containers_are_said_to_be_read_as_dense():
    """transformers 5.20 keeps SwitchTransformers' experts as an nn.ModuleDict of per-expert MLPs: diff
    does not read them as an MoE layer and says so, naming each container."""
    from dispatch.apps import diff_models as DM

    cfg = transformers.SwitchTransformersConfig(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_decoder_layers=2, num_heads=2, num_experts=2,
                                                encoder_sparse_step=2, decoder_sparse_step=2)
    model = transformers.SwitchTransformersModel(cfg).eval()
    notes = DM.dense_expert_notes(model, {})
    containers = [n for n, _m in model.named_modules() if n.endswith(".experts")]
    assert containers and len(notes) == len(containers)
    for n, note in zip(containers, notes):
        assert note == (f"{n} (SwitchTransformersExperts, an nn.ModuleDict of per-expert modules): diff reads "
                        "its experts' linears as dense linears (no routing)")


def test_ct_router_without_a_module_falls_back_to_norm_topk_prob_or_is_refused(ct_mixtral, tmp_path, capsys):
    """A copy of the checkpoint whose model_type transformers does not know (no router module to read):
    with norm_topk_prob false in config.json, the layer is read with renormalize False and the note says
    where that came from; without it, diff refuses the model naming the layer and what is missing (exit 2)."""
    import shutil

    from dispatch.apps import diff_models as DM

    folder, _ = ct_mixtral
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "not_a_model_type", ["NotAModel"]
    (bad / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    m = DM.load_model(str(bad))
    assert [lay.renormalize for lay in m.layers if lay.name.endswith("block_sparse_moe")] == [False, False]
    assert m.notes == ["routers: softmax top-2, not renormalized (config.json norm_topk_prob)"]
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = _run(capsys, bad, "--layers", "*.block_sparse_moe", "--tokens", "2", "--impls", "reference")
    assert rc == diff.EXIT_ARGS
    assert ("MoE layer model.layers.0.block_sparse_moe: cannot tell whether its router renormalizes the top-2 "
            "weights: config.json has no norm_topk_prob, and no router module transformers builds here for "
            "model_type 'not_a_model_type' takes the checkpoint's 'model.layers.0.block_sparse_moe.gate' tensors") in err


def test_experts_in_a_block_diff_does_not_read_are_said_to_be_left_out():
    """Llama 4's MoE block (a sigmoid router named ``router``, gate_up_proj [E, H, 2I]) is not read as an
    MoE layer; diff says its experts are not diffed, naming the container."""
    from dispatch.apps import diff_models as DM

    cfg = transformers.Llama4TextConfig(vocab_size=32, hidden_size=32, intermediate_size=16,
                                        intermediate_size_mlp=32, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=16, num_local_experts=2,
                                        num_experts_per_tok=1, moe_layers=[0])
    model = transformers.Llama4TextModel(cfg).eval()
    blocks = {n: m for n, m in model.named_modules() if DM._moe_block(m)}
    assert not blocks
    (note,) = DM.dense_expert_notes(model, blocks)
    assert note.startswith("layers.0.feed_forward.experts (Llama4TextExperts): 3-D expert parameters in a block "
                           "diff does not read as an MoE layer") and note.endswith("not diffed")
