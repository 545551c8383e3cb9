"""The tiny MoE checkpoints. Qwen3-MoE (engine_env.write_moe_model): compressed-tensors' own code
quantizes each expert's gate/up/down projections, the tensors are named and shaped as vLLM loads
them, the router is ignored, and every expert weight dequantizes to the model's own weight within
its format's rounding bound (the wrong expert or the other half of gate/up does not). gpt-oss
(engine_env.write_gptoss_model): its own MXFP4 layout, gate/up interleaved as the model computes.

Needs transformers and compressed-tensors, no vLLM: it runs in both venvs.
"""

from __future__ import annotations

import json

import pytest

import engine_env

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors",
                    reason="the checkpoints are written by compressed-tensors (pip install --no-deps -r tests/vllm_engine/requirements.txt)")
pytest.importorskip("transformers", reason="the model is transformers' Qwen3MoeForCausalLM")

import formats  # noqa: E402

H, I, E, LAYERS = 256, 128, 8, 2
# Per kind: {leaf: (dtype, shape)} of one expert's gate_proj (and up_proj) and of its down_proj.
EXPECTED = {
    "moe_nvfp4": ({"weight_packed": (torch.uint8, (I, H // 2)), "weight_scale": (torch.float8_e4m3fn, (I, H // 16)),
                   "weight_global_scale": (torch.float32, (1,)), "input_global_scale": (torch.float32, (1,))},
                  {"weight_packed": (torch.uint8, (H, I // 2)), "weight_scale": (torch.float8_e4m3fn, (H, I // 16)),
                   "weight_global_scale": (torch.float32, (1,)), "input_global_scale": (torch.float32, (1,))}),
    "moe_nvfp4a16": ({"weight_packed": (torch.uint8, (I, H // 2)), "weight_scale": (torch.float8_e4m3fn, (I, H // 16)),
                      "weight_global_scale": (torch.float32, (1,))},
                     {"weight_packed": (torch.uint8, (H, I // 2)), "weight_scale": (torch.float8_e4m3fn, (H, I // 16)),
                      "weight_global_scale": (torch.float32, (1,))}),
    "moe_mxfp4": ({"weight_packed": (torch.uint8, (I, H // 2)), "weight_scale": (torch.uint8, (I, H // 32))},
                  {"weight_packed": (torch.uint8, (H, I // 2)), "weight_scale": (torch.uint8, (H, I // 32))}),
    "moe_fp8_block": ({"weight": (torch.float8_e4m3fn, (I, H)), "weight_scale": (torch.float32, (1, 2))},
                      {"weight": (torch.float8_e4m3fn, (H, I)), "weight_scale": (torch.float32, (2, 1))}),
    "moe_fp8": ({"weight": (torch.float8_e4m3fn, (I, H)), "weight_scale": (torch.float32, (1,)),
                 "input_scale": (torch.float32, (1,))},
                {"weight": (torch.float8_e4m3fn, (H, I)), "weight_scale": (torch.float32, (1,)),
                 "input_scale": (torch.float32, (1,))}),
    "moe_fp8_channel": ({"weight": (torch.float8_e4m3fn, (I, H)), "weight_scale": (torch.float32, (I, 1))},
                        {"weight": (torch.float8_e4m3fn, (H, I)), "weight_scale": (torch.float32, (H, 1))}),
}
EXPECTED["moe_mxfp4a16"] = EXPECTED["moe_mxfp4"]


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_ckpts")


@pytest.fixture(scope="module")
def reference():
    """The model the checkpoints were written from (its fused experts), seeded like write_moe_model."""
    return engine_env.tiny_qwen3_moe()


def _tensors(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def _dequantized(kind: str, t: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized [N, K] float32, the per-element scale s) of one projection, through formats/."""
    w = t.get(prefix + "weight_packed", t.get(prefix + "weight"))
    s = t[prefix + "weight_scale"]
    n, k = w.shape[0], w.shape[1] * (2 if w.dtype == torch.uint8 else 1)
    if kind.startswith("moe_nvfp4"):
        g = t[prefix + "weight_global_scale"].reshape(())  # compressed-tensors' g = 2688 / amax: our multiplier
        q = formats.QuantizedTensor("nvfp4", "weight", w, s, g, (1, 16), (n, k))
        elem = formats.codecs.decode_e4m3(s).repeat_interleave(16, 1) / g
    elif kind.startswith("moe_mxfp4"):
        q = formats.QuantizedTensor("mxfp4", "weight", w, s, None, (1, 32), (n, k))
        elem = formats.codecs.decode_e8m0(s).repeat_interleave(32, 1)
    elif kind == "moe_fp8_block":
        q = formats.QuantizedTensor("fp8_block", "weight", w, s.float(), None, (128, 128), (n, k))
        elem = s.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    elif kind == "moe_fp8":
        q = formats.QuantizedTensor("fp8_tensor", "weight", w, s.float().reshape(()), None, None, (n, k))
        elem = s.float().expand(n, k)
    else:  # per-channel FP8 (no format of formats/ yet): code * row scale
        return formats.codecs.decode_e4m3(w) * s.float(), s.float().expand(n, k)
    formats.validate.check_weight(q)
    return formats.dequantize(q), elem


def _bound(kind: str, w: torch.Tensor, elem: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest error of one element: e2m1 steps are 0.5 below 2, then 1, then 2 (relative
    step <= 1/2 above 0.5, so the error is <= |w|/4, or <= s/4 near zero; saturation at 6 from an
    e4m3-rounded nvfp4 scale costs <= 0.375 s <= |w|/4); e4m3 has 3 mantissa bits (<= 2^-4 |w|)
    and subnormal steps of 2^-9 s (<= 2^-10 s). Plus 2^-20 |w| for the float32 arithmetic."""
    if "fp4" in kind:
        return 0.25 * w.abs() + 0.25 * elem + 2.0**-20 * w.abs()
    return 2.0**-4 * w.abs() + 2.0**-10 * elem + 2.0**-20 * w.abs()


def test_linearized_experts_compute_the_fused_ones(reference):
    """The unfused per-expert Linears (what compressed-tensors quantizes) give the model's logits."""
    ids = engine_env.calibration_ids()
    with torch.no_grad():
        fused = reference(input_ids=ids).logits
        model = engine_env.tiny_qwen3_moe()
        engine_env.linearize_experts(model)
        linear = model(input_ids=ids).logits
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in model.parameters())
    # float32 GEMMs over other row sets and in another grouping: each dot product of <= 512 terms may
    # differ by 2 * 512 * 2^-24 (6e-5) of its sum of |terms|; the logits are O(1)
    torch.testing.assert_close(linear, fused, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", tuple(engine_env.MOE_KINDS))
def test_moe_checkpoint_tensors_and_values(kind, moe_root, reference):
    d = engine_env.write_moe_model(moe_root, kind)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    # the routers are ignored (compressed-tensors#733's list), lm_head too
    assert {"lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(LAYERS))} <= set(qc["ignore"])
    t = _tensors(d)
    assert t["model.layers.0.mlp.gate.weight"].shape == (E, H)  # unquantized router
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in t)  # no fused 3-D experts
    want13, want2 = EXPECTED[kind]
    fused_layers = [layer.mlp.experts for layer in reference.model.layers]
    for layer in range(LAYERS):
        for e in range(E):
            for proj, want in (("gate_proj", want13), ("up_proj", want13), ("down_proj", want2)):
                p = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                got = {k[len(p):]: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(p)}
                assert got == want, f"{p}: {got}"
                dq, elem = _dequantized(kind, t, p)
                f = fused_layers[layer]
                w = {"gate_proj": f.gate_up_proj[e, :I], "up_proj": f.gate_up_proj[e, I:],
                     "down_proj": f.down_proj[e]}[proj].detach().float()
                assert torch.all((dq - w).abs() <= _bound(kind, w, elem)), f"{p} departs from the model's weight"
                # the other half of W13 (or the next expert's down_proj) is far outside the bound
                other = {"gate_proj": f.gate_up_proj[e, I:], "up_proj": f.gate_up_proj[e, :I],
                         "down_proj": f.down_proj[(e + 1) % E]}[proj].detach().float()
                assert not torch.all((dq - other).abs() <= _bound(kind, other, elem))


def test_gptoss_mxfp4_layout(moe_root):
    """Blocks/scales/biases as openai/gpt-oss-20b names and shapes them, and each expert's blocks
    dequantize to the model's weight (transposed to [N, K]) within MXFP4's rounding bound."""
    d = engine_env.write_gptoss_model(moe_root)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    t = _tensors(d)
    model = engine_env.tiny_gptoss()
    p = "model.layers.1.mlp.experts."
    want = {"gate_up_proj_blocks": (torch.uint8, (E, 2 * I, H // 32, 16)), "gate_up_proj_scales": (torch.uint8, (E, 2 * I, H // 32)),
            "gate_up_proj_bias": (torch.bfloat16, (E, 2 * I)), "down_proj_blocks": (torch.uint8, (E, H, I // 32, 16)),
            "down_proj_scales": (torch.uint8, (E, H, I // 32)), "down_proj_bias": (torch.bfloat16, (E, H))}
    assert {k[len(p):]: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(p)} == want
    experts = model.model.layers[1].mlp.experts
    for name, w in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
        b, s = t[p + name + "_blocks"], t[p + name + "_scales"]
        for e in range(E):
            q = formats.QuantizedTensor("mxfp4", "weight", b[e].reshape(b.shape[1], -1), s[e], None, (1, 32),
                                        (b.shape[1], b.shape[2] * 32))
            ref = w[e].T.detach().float()
            elem = formats.codecs.decode_e8m0(s[e]).repeat_interleave(32, 1)
            assert torch.all((formats.dequantize(q) - ref).abs() <= _bound("moe_mxfp4", ref, elem))


def _modelopt_layout(d) -> dict:
    """{(layer, leaf of one expert's projection): (dtype, shape)} of a ModelOpt MoE checkpoint's experts."""
    out = {}
    for k, v in _tensors(d).items():
        if ".mlp.experts." in k:
            layer, rest = k.split(".mlp.experts.")
            out[(layer, rest.split(".", 1)[1])] = (v.dtype, tuple(v.shape))
    return out


@pytest.mark.parametrize("kind", tuple(engine_env.MODELOPT_MOE))
def test_modelopt_moe_checkpoint_layout_and_values(kind, moe_root, reference):
    """The ModelOpt NVFP4 Qwen3-MoE (nvidia-modelopt's export where it is installed, else
    engine_env.derive_modelopt_moe): per expert and projection ``weight`` u8 [N, K/2],
    ``weight_scale`` e4m3 [N, K/16], ``weight_scale_2`` f32 0-d shared by gate and up, ``input_scale``
    f32 0-d for NVFP4 only; each weight, read as formats' NVFP4 with g = 1 / weight_scale_2 (the plugin's
    reading of ModelOpt's multiplier), is the model's weight within NVFP4's rounding bound (the
    wrong projection is not), and where ModelOpt is installed, ModelOpt's own NVFP4QTensor decodes
    every weight to formats' reading within 2^-22 relative (the reciprocal's and the division's
    float32 roundings), and the derived layout equals the export's."""
    d = engine_env.write_modelopt_moe_model(moe_root, kind)
    a16 = kind.endswith("W4A16_NVFP4")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["quantization_config"]["quant_algo"] == ("W4A16_NVFP4" if a16 else "NVFP4")
    t = _tensors(d)
    leaves = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32}
    if not a16:
        leaves["input_scale"] = torch.float32
    fused_layers = [layer.mlp.experts for layer in reference.model.layers]
    for layer in range(LAYERS):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert t[p + "gate_proj.weight_scale_2"] == t[p + "up_proj.weight_scale_2"]
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                got = {leaf: (v.dtype, tuple(v.shape)) for leaf, v in
                       ((kk[len(p + proj) + 1:], vv) for kk, vv in t.items() if kk.startswith(p + proj + "."))}
                want = {"weight": (torch.uint8, (n, k // 2)), "weight_scale": (torch.float8_e4m3fn, (n, k // 16))}
                want.update({leaf: (torch.float32, ()) for leaf in leaves if leaf not in want})
                assert got == want, f"{p}{proj}: {got}"
                g = (1 / t[p + proj + ".weight_scale_2"].double()).float()
                q = formats.QuantizedTensor("nvfp4", "weight", t[p + proj + ".weight"],
                                            t[p + proj + ".weight_scale"], g, (1, 16), (n, k))
                dq = formats.dequantize(q)
                f = fused_layers[layer]
                w = {"gate_proj": f.gate_up_proj[e, :I], "up_proj": f.gate_up_proj[e, I:],
                     "down_proj": f.down_proj[e]}[proj].detach().float()
                elem = formats.codecs.decode_e4m3(q.scale).repeat_interleave(16, 1) / g
                assert torch.all((dq - w).abs() <= _bound("moe_nvfp4", w, elem)), f"{p}{proj}"
                if proj == "gate_proj":
                    other = f.gate_up_proj[e, I:].detach().float()
                    assert not torch.all((dq - other).abs() <= _bound("moe_nvfp4", other, elem))
    if engine_env.modelopt_available():
        assert (d / "DERIVED").exists()
        return
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    assert not (d / "DERIVED").exists()
    for name, v in t.items():
        if name.endswith(".weight") and v.dtype == torch.uint8:
            base = name[: -len("weight")]
            q = NVFP4QTensor(torch.Size([v.shape[0], 2 * v.shape[1]]), torch.float32, v)
            theirs = q.dequantize(dtype=torch.float32, scale=t[base + "weight_scale"],
                                  double_scale=t[base + "weight_scale_2"], block_sizes={-1: 16}).double()
            g = (1 / t[base + "weight_scale_2"].double()).float()
            q = formats.QuantizedTensor("nvfp4", "weight", v, t[base + "weight_scale"], g, (1, 16),
                                        (v.shape[0], 2 * v.shape[1]))
            ours = formats.dequantize(q, torch.float64)
            assert torch.all((ours - theirs).abs() <= theirs.abs() * 2.0 ** -22), name
    derived = moe_root / f"{kind}_derived"
    if not (derived / "model.safetensors").exists():
        engine_env.derive_modelopt_moe(derived, kind)
    assert _modelopt_layout(derived) == _modelopt_layout(d)
    mine = json.loads((derived / "hf_quant_config.json").read_text())["quantization"]
    theirs = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    assert {k: mine[k] for k in ("quant_algo", "group_size")} == {k: theirs[k] for k in ("quant_algo", "group_size")}
