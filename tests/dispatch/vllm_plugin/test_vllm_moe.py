"""vLLM 0.33.0's FusedMoE layer served by the plugin's MoE method (dispatch/vllm_plugin/moe.py).

Layer 0's experts of the tiny Qwen3-MoE checkpoints that compressed-tensors' own code writes
(tests/vllm_engine/engine_env.write_moe_model: 8 experts, top-2, H = 256, I = 128), built by vLLM's
``FusedMoEFactory`` with vLLM's compressed-tensors config of the checkpoint, loaded through vLLM's
``RoutedExperts.weight_loader`` (checkpoint name -> w13_/w2_ parameter, shard w1/w3/w2, expert id,
as vLLM's ``make_expert_params_mapping`` maps them), processed, and called as vLLM's runner calls
it (``forward_modular(x, topk_weights, topk_ids)``). Checked: the method is ours for each scheme
and serves the checkpoint's variant; the output against formats.reference_moe over experts built
from the checkpoint's tensors directly (not through vLLM or the method), within the Triton lesson's
derived bound (tests/kernels_triton/test_moe.py ``_moe_bound``) or one bf16 rounding for the
reference implementation; a tampered or missing expert scale is refused naming layer, expert and tensor.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from _vllm_env import ckpt_root, dist, impl, written_once  # noqa: F401  (skips without vLLM 0.33.0; CPU platform, VLLM_PLUGINS)
import harness
import torch

import formats
from formats.codecs import decode_e4m3, encode_e4m3
from conftest import DEVICE  # noqa: F401  (the seeded session; vLLM's CPU platform runs these layers)
import conftest as _tests_conftest  # noqa: E402  (tests/conftest.py, imported at collection)

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "vllm_engine"))
import engine_env  # noqa: E402  (write_moe_model: compressed-tensors' own writer; no engine needed)

PREFIX = "model.layers.0.mlp.experts"
E, TOP_K, H, I = 8, 2, 256, 128
# [moe-served]
SERVED = {"moe_nvfp4": "nvfp4", "moe_nvfp4a16": "nvfp4_w4a16", "moe_mxfp4": "mxfp4", "moe_mxfp4a16": "mxfp4_w4a16",
          "moe_fp8_block": "fp8_block", "moe_fp8": "fp8_tensor", "moe_fp8_channel": "fp8_channel"}
# [/moe-served]
SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _lesson_bound():
    # test_moe.py does `from conftest import ...`: by the time this runs, sys.modules["conftest"] may be
    # another folder's conftest (tests/vllm_engine's, collected later), so lend it tests/conftest.py.
    spec = importlib.util.spec_from_file_location("_lesson_moe_tests_vllm", ROOT / "tests/kernels_triton/test_moe.py")
    mod = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("conftest")
    sys.modules["conftest"] = _tests_conftest
    try:
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("conftest", None)
        else:
            sys.modules["conftest"] = saved
    return mod._moe_bound, mod._assert_matches


@pytest.fixture(scope="module")
def moe_ckpt(ckpt_root):
    return written_once(ckpt_root, engine_env.write_moe_model)


def _tensors(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.startswith(PREFIX + ".")}


def build(ckpt: Path, *, tamper=None, skip=()):
    """vLLM's RoutedExperts for layer 0 of ``ckpt``, loaded and processed (plugin active,
    --linear-backend b12x). ``tamper(name, tensor) -> tensor`` edits a checkpoint tensor on the way
    in; ``skip``: checkpoint names left out."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    with harness.vllm_context(ckpt) as cfg:
        qc = harness.quant_config(cfg)
        runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, renormalize=True,
                                 quant_config=qc, prefix=PREFIX, params_dtype=torch.bfloat16)
        layer = runner.routed_experts
        params = dict(layer.named_parameters())
        for name, t in _tensors(ckpt).items():
            if name in skip:
                continue
            e, proj, suffix = name[len(PREFIX) + 1:].split(".", 2)
            pname = ("w2_" if proj == "down_proj" else "w13_") + suffix
            if tamper is not None:
                t = tamper(name, t)
            p = params[pname]
            p.weight_loader(p, t, name, shard_id=SHARD[proj], expert_id=int(e), return_success=True)
        layer.quant_method.process_weights_after_loading(layer)
        return layer


def _experts_from_checkpoint(ckpt: Path, kind: str):
    """(w13, w2, w13_act_opts, w2_act_opts) built from the checkpoint's tensors with formats alone."""
    t = _tensors(ckpt)
    fmt = {"nvfp4": "nvfp4", "nvfp4_w4a16": "nvfp4", "mxfp4": "mxfp4", "mxfp4_w4a16": "mxfp4",
           "fp8_block": "fp8_block", "fp8_tensor": "fp8_tensor", "fp8_channel": "fp8_channel"}[SERVED[kind]]
    data_key = "weight" if fmt.startswith("fp8") else "weight_packed"
    g = lambda e, p, s: t[f"{PREFIX}.{e}.{p}.{s}"]  # noqa: E731
    d13, d2, s13, s2, g13, g2, o13, o2 = [], [], [], [], [], [], [], []
    for e in range(E):
        gd, ud, dd = (g(e, p, data_key) for p in ("gate_proj", "up_proj", "down_proj"))
        gs, us, ds = (g(e, p, "weight_scale") for p in ("gate_proj", "up_proj", "down_proj"))
        if fmt == "fp8_tensor":  # one scale per expert: the shard with the smaller one requantized (vLLM's merge)
            smax = torch.maximum(gs.float().reshape(()), us.float().reshape(()))
            re = lambda c, s: encode_e4m3((decode_e4m3(c).double() * s.double() / smax.double()).float())  # noqa: E731
            d13.append(torch.cat([re(gd, gs), re(ud, us)]))
            s13.append(smax)
            d2.append(dd)
            s2.append(ds.float().reshape(()))
            o13.append(g(e, "gate_proj", "input_scale").float().reshape(()))
            o2.append(g(e, "down_proj", "input_scale").float().reshape(()))
            continue
        d13.append(torch.cat([gd, ud]))
        s13.append(torch.cat([gs, us]))
        d2.append(dd)
        s2.append(ds)
        if fmt == "fp8_channel":  # [N, 1] per-channel scales as formats keeps them: [N]
            s13[-1], s2[-1] = s13[-1].float().reshape(-1), ds.float().reshape(-1)
        if fmt == "nvfp4":
            g13.append(g(e, "gate_proj", "weight_global_scale").float().reshape(()))
            g2.append(g(e, "down_proj", "weight_global_scale").float().reshape(()))
        if SERVED[kind] == "nvfp4":
            o13.append(g(e, "gate_proj", "input_global_scale").float().reshape(()))
            o2.append(g(e, "down_proj", "input_global_scale").float().reshape(()))
    glob = lambda x: torch.stack(x) if x else None  # noqa: E731
    w13 = formats.experts_from_stacked(fmt, torch.stack(d13), torch.stack(s13), glob(g13), name="w13")
    w2 = formats.experts_from_stacked(fmt, torch.stack(d2), torch.stack(s2), glob(g2), name="w2")
    key = {"fp8_tensor": "scale", "nvfp4": "global_scale"}.get(SERVED[kind])
    opts = lambda o: {key: torch.stack(o)} if o else None  # noqa: E731
    return w13, w2, opts(o13), opts(o2)


def _call(layer, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, H, generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.rand(m, E, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    wt = torch.rand(m, TOP_K, generator=gen) + 0.05
    wt = wt / wt.sum(dim=1, keepdim=True)  # vLLM's router renormalizes before apply
    return x, ids, wt, layer.forward_modular(x, wt, ids)


def _assert_rounded_oracle(y, x, w13, w2, ids, wt, **kw):
    """y is formats.reference_moe(x, w13, w2, ids, wt, **kw) rounded once to bf16 (RNE), as the
    reference implementation's output is: finite and within bf16's unit roundoff, 2^-8 relative (7
    stored mantissa bits); 2^-133 absolute covers bf16's subnormals."""
    ref = formats.reference_moe(x, w13, w2, ids, wt, out_dtype=torch.float64, **kw)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all() and bool((err <= ref.abs() * 2.0 ** -8 + 2.0 ** -133).all()), float(err.max())


@pytest.mark.parametrize("kind", list(SERVED))
def test_the_method_serves_the_checkpoint_scheme_and_matches_the_oracle(kind, moe_ckpt, dist, impl):
    from dispatch.vllm_plugin.moe import B12xDualCompressedTensorsMoEMethod
    from dispatch import registry

    impl("reference")
    ckpt = moe_ckpt(kind)
    layer = build(ckpt)
    method = layer.quant_method
    assert isinstance(method, B12xDualCompressedTensorsMoEMethod), type(method).__name__
    assert method.variant == SERVED[kind] and method.bound.variant == SERVED[kind]
    w13, w2, o13, o2 = _experts_from_checkpoint(ckpt, kind)
    a16 = registry.variant(SERVED[kind]).a16
    x, ids, wt, y = _call(layer, 7, 0)
    _assert_rounded_oracle(y, x, w13, w2, ids, wt, a16=a16, w13_act_opts=o13, w2_act_opts=o2)
    assert method.launched == {"reference": 1}
    rep = method.report(7)
    assert PREFIX in rep and SERVED[kind] in rep and "reference" in rep and "ran: reference: 1 calls" in rep


@pytest.mark.parametrize("kind", ["moe_nvfp4", "moe_mxfp4a16", "moe_fp8", "moe_fp8_block", "moe_fp8_channel"])
def test_triton_serves_the_layer_within_the_lesson_bound(kind, moe_ckpt, dist, impl):
    from dispatch import registry

    impl("triton")
    _moe_bound, _assert_matches = _lesson_bound()
    ckpt = moe_ckpt(kind)
    layer = build(ckpt)
    w13, w2, o13, o2 = _experts_from_checkpoint(ckpt, kind)
    a16 = registry.variant(SERVED[kind]).a16
    x, ids, wt, y = _call(layer, 5, 1)
    assert layer.quant_method.launched == {"triton": 1}
    ref, bound = _moe_bound(y, x, w13, w2, ids, wt, a16=a16, w13_act_opts=o13, w2_act_opts=o2)
    _assert_matches(y, ref, bound, kind)


def test_per_channel_experts_with_static_activations_are_refused_by_name(moe_ckpt, dist, tmp_path):
    """FP8_DYNAMIC's scheme with its input activations made static per tensor (the config alone:
    no compressed-tensors preset writes it): b12x-dual's method serves per-token dynamic activations
    only, and vLLM's method asserts on it, so the layer is refused naming the layer and the scheme."""
    import json
    import shutil

    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from dispatch.vllm_plugin.convert import CheckpointError

    ckpt = tmp_path / "moe_fp8_channel_static"
    shutil.copytree(moe_ckpt("moe_fp8_channel"), ckpt)
    cfg_path = ckpt / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    for group in cfg_json["quantization_config"]["config_groups"].values():
        group["input_activations"].update(dynamic=False, strategy="tensor")
    cfg_path.write_text(json.dumps(cfg_json))
    with harness.vllm_context(ckpt) as cfg:
        with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: .*float8 channel static.*float8 tensor static"
                                                  r".*dynamic per-token activations"):
            FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                            quant_config=harness.quant_config(cfg), prefix=PREFIX, params_dtype=torch.bfloat16)


def test_without_the_switch_vllm_keeps_its_method(moe_ckpt, dist):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from dispatch.vllm_plugin.moe import B12xDualCompressedTensorsMoEMethod

    ckpt = moe_ckpt("moe_mxfp4")
    with harness.vllm_context(ckpt, linear_backend="auto") as cfg:
        runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                                 quant_config=harness.quant_config(cfg), prefix=PREFIX, params_dtype=torch.bfloat16)
    assert not isinstance(runner.routed_experts.quant_method, B12xDualCompressedTensorsMoEMethod)


@pytest.mark.parametrize("kind, tensor, value", [
    ("moe_mxfp4", "down_proj.weight_scale", 255),             # E8M0 0xFF: NaN
    ("moe_fp8_block", "up_proj.weight_scale", float("inf")),
    ("moe_nvfp4", "gate_proj.weight_scale", float("nan")),
    ("moe_fp8_channel", "up_proj.weight_scale", 0.0),          # a per-channel scale of 0
    ("moe_fp8_channel", "down_proj.weight_scale", -0.5),
])
def test_a_tampered_expert_scale_is_refused_by_name(kind, tensor, value, moe_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    bad = f"{PREFIX}.5.{tensor}"

    def tamper(name, t):
        if name != bad:
            return t
        t = t.clone()
        flat = t.view(-1) if t.dtype != torch.float8_e4m3fn else t.view(torch.uint8).view(-1)
        if t.dtype == torch.float8_e4m3fn:
            flat[-1] = 0x7F  # e4m3 NaN
        else:
            flat[-1] = value
        return t

    stem = "w2" if tensor.startswith("down") else "w13"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}.*expert 5.*{stem}_weight_scale"):
        build(moe_ckpt(kind), tamper=tamper)


@pytest.mark.parametrize("kind, value", [("moe_fp8", 0.0), ("moe_nvfp4", -1.0)])
def test_a_bad_per_tensor_scale_is_refused_naming_expert_and_shard(kind, value, moe_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    name = "weight_scale" if kind == "moe_fp8" else "weight_global_scale"
    bad = f"{PREFIX}.2.up_proj.{name}"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 2 up_proj \(w3\): checkpoint tensor 'w13_{name}'"):
        build(moe_ckpt(kind), tamper=lambda n, t: torch.full_like(t, value) if n == bad else t)


def test_differing_gate_and_up_global_scales_are_refused(moe_ckpt, dist, impl):
    """One NVFP4 global scale serves an expert's W13 (compressed-tensors shares it over gate and up);
    vLLM's own method would keep the gate's with a warning and misread the up rows."""
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    bad = f"{PREFIX}.3.up_proj.weight_global_scale"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 3: checkpoint tensor 'w13_weight_global_scale' "
                                              "holds gate .* and up .*one weight global scale per expert"):
        build(moe_ckpt("moe_nvfp4"), tamper=lambda n, t: t * 2 if n == bad else t)


@pytest.mark.parametrize("kind", ["moe_mxfp4", "moe_fp8"])
def test_a_missing_expert_scale_is_refused_by_name(kind, moe_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: checkpoint tensor\(s\) 'w13_weight_scale' \(expert 6 w3\) "
                                              "missing"):
        build(moe_ckpt(kind), skip=(f"{PREFIX}.6.up_proj.weight_scale",))


def test_a_float_e8m0_scale_is_refused_at_the_loader(moe_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    bad = f"{PREFIX}.1.gate_proj.weight_scale"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 1: checkpoint tensor 'w13_weight_scale' \(w1\) "
                                              r"is float32"):
        build(moe_ckpt("moe_mxfp4"), tamper=lambda n, t: torch.exp2(t.float() - 127) if n == bad else t)


def test_fp8_merge_keeps_the_larger_scale_shard_and_requantizes_the_other():
    """_requantize_to_max: each value of the requantized shard within half an e4m3 step (2^-4
    relative, or 2^-10 * smax absolute in the subnormal range) of the original; the other shard untouched."""
    from dispatch.vllm_plugin.moe import _requantize_to_max
    from formats.codecs import decode_e4m3, encode_e4m3

    gen = torch.Generator().manual_seed(3)
    codes = encode_e4m3(torch.randn(2, 8, 16, generator=gen) * 100)
    scales = torch.tensor([[0.5, 2.0], [3.0, 1.0]])
    out = _requantize_to_max(codes, scales)
    assert torch.equal(out[0, 4:], codes[0, 4:]) and torch.equal(out[1, :4], codes[1, :4])
    for e, rows, s in ((0, slice(0, 4), 0.5), (1, slice(4, 8), 1.0)):
        before = decode_e4m3(codes[e, rows]).double() * s
        smax = float(scales[e].max())
        after = decode_e4m3(out[e, rows]).double() * smax
        assert bool(((after - before).abs() <= before.abs() * 2.0 ** -4 + smax * 2.0 ** -10).all())
    assert not torch.equal(out[0, :4], codes[0, :4])


def test_a_nan_expert_weight_code_is_refused_unless_allowed(moe_ckpt, dist, impl, monkeypatch):
    """An e4m3 NaN code (0x7F) in expert 4's down_proj: refused naming layer, expert and tensor;
    served (and its rows NaN, never made finite) with B12X_VLLM_ALLOW_NAN_WEIGHTS=1, as dense layers."""
    from dispatch.vllm_plugin.convert import CheckpointError
    from dispatch.vllm_plugin.loading import ENV_ALLOW_NAN_WEIGHTS

    impl("reference")
    bad = f"{PREFIX}.4.down_proj.weight"

    def tamper(name, t):
        if name != bad:
            return t
        t = t.clone()
        t.view(torch.uint8)[7, 0] = 0x7F
        return t

    monkeypatch.delenv(ENV_ALLOW_NAN_WEIGHTS, raising=False)
    with pytest.raises(CheckpointError, match=rf"{PREFIX} \(expert 4, w2\): w2_weight: 1 .*{ENV_ALLOW_NAN_WEIGHTS}=1"):
        build(moe_ckpt("moe_fp8_block"), tamper=tamper)
    monkeypatch.setenv(ENV_ALLOW_NAN_WEIGHTS, "1")
    layer = build(moe_ckpt("moe_fp8_block"), tamper=tamper)
    x = torch.randn(3, H).to(torch.bfloat16)
    ids = torch.tensor([[4, 0], [1, 2], [4, 3]], dtype=torch.int32)
    y = layer.forward_modular(x, torch.full((3, TOP_K), 0.5), ids)
    assert torch.isnan(y[[0, 2], 7]).all() and torch.isfinite(y[1]).all()


@pytest.mark.parametrize("variant, i, block", [("fp8_block", 64, 128), ("mxfp4", 48, 32), ("nvfp4_w4a16", 8, 16)])
def test_a_rank_intermediate_size_off_the_scale_block_is_refused(variant, i, block, dist):
    """I per tensor-parallel rank (TP splits the experts' intermediate size) must hold whole scale
    blocks: FP8_BLOCK's 128 at TP = 2 of I = 128 is refused by name, not left to vLLM's narrowing."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig  # noqa: F401  (vLLM present)

    from dispatch.vllm_plugin.convert import CheckpointError
    from dispatch.vllm_plugin.moe import B12xDualCompressedTensorsMoEMethod

    method = B12xDualCompressedTensorsMoEMethod.__new__(B12xDualCompressedTensorsMoEMethod)
    method.variant, method.layer_name, method.expected, method.arrived = variant, PREFIX, {}, {}
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: {variant} experts need the intermediate size per "
                                              rf"tensor-parallel rank I .* multiple of {block} .* got {i}"):
        method.create_weights(torch.nn.Module(), E, H, i, torch.bfloat16)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_parallel_ranks_add_up_to_the_whole_layer(placement, moe_ckpt, dist):
    """Expert parallelism's id mapping (moe.local_routing) on vLLM's own expert maps
    (``determine_expert_map``, EP = 2, 8 experts, both placements): each rank computes the oracle
    over its 4 experts (in slot order) with the mapped ids and weights, and the two ranks' outputs add up to the
    whole layer's, as vLLM's runner all-reduces them. Tokens whose two experts are both on one rank
    get exactly 0 from the other. Both sides are formats.reference_moe in float64 over the same
    decoded operands; they differ only in float64 summation order (each expert's GEMMs see other
    rows, and BLAS blocks by them; the two weighted outputs add in another order): dot products of
    at most 256 terms, each within 256 * 2^-53 of the sum of its terms' magnitudes, so well within
    2^-40 of the largest output (a misrouted expert is off by the output's own size)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from dispatch.vllm_plugin.moe import local_routing

    ckpt = moe_ckpt("moe_nvfp4")
    w13, w2, o13, o2 = _experts_from_checkpoint(ckpt, "moe_nvfp4")
    maps = [determine_expert_map(2, r, E, placement)[:2] for r in range(2)]
    on = [[g for g in range(E) if int(m[g]) >= 0] for _, m in maps]
    gen = None  # the session seed (tests/conftest.py): fresh inputs per run
    M = 6
    x = (torch.randn(M, H, generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.rand(M, E, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    ids[0] = torch.tensor(on[1][:2])  # token 0: both experts on rank 1
    ids[1] = torch.tensor(on[0][1:3])  # token 1: both on rank 0
    wt = torch.rand(M, TOP_K, generator=gen) + 0.05
    wt = wt / wt.sum(dim=1, keepdim=True)
    whole = formats.reference_moe(x, w13, w2, ids, wt, w13_act_opts=o13, w2_act_opts=o2, out_dtype=torch.float64)
    parts = []
    for r, (n, emap) in enumerate(maps):
        assert n == 4 and len(on[r]) == 4
        order = sorted(on[r], key=lambda g: int(emap[g]))  # slot s holds global expert order[s]
        lid, lw = local_routing(ids, wt, emap, n, PREFIX)
        assert lid.dtype == ids.dtype and int(lid.min()) >= 0 and int(lid.max()) < n
        sub = lambda o: {k: v[order] for k, v in o.items()}  # noqa: E731
        parts.append(formats.reference_moe(x, [w13[g] for g in order], [w2[g] for g in order], lid, lw,
                                           w13_act_opts=sub(o13), w2_act_opts=sub(o2), out_dtype=torch.float64))
    assert torch.equal(parts[0][0], torch.zeros(H, dtype=torch.float64))  # token 0's experts are all on rank 1
    assert torch.equal(parts[1][1], torch.zeros(H, dtype=torch.float64))
    assert parts[1][0].abs().max() > 0 and parts[0][1].abs().max() > 0
    err = (parts[0] + parts[1] - whole).abs()
    assert float(err.max()) <= 2.0 ** -40 * float(whole.abs().max()), float(err.max())


def test_expert_parallel_routing_refusals(dist):
    """local_routing without a map returns the routing as it is; an id outside the global map and a
    map whose local slots are not 0 .. E_local - 1 are refused naming the layer."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from dispatch.vllm_plugin.convert import CheckpointError
    from dispatch.vllm_plugin.moe import check_expert_map, local_routing

    ids, wt = torch.tensor([[0, 7]], dtype=torch.int32), torch.tensor([[0.25, 0.75]])
    assert local_routing(ids, wt, None, E, PREFIX) == (ids, wt)
    _, emap, _ = determine_expert_map(2, 1, E)
    lid, lw = local_routing(ids, wt, emap, 4, PREFIX)
    assert lid.tolist() == [[0, 3]] and lw.tolist() == [[0.0, 0.75]]
    with pytest.raises(ValueError, match=rf"layer {PREFIX}: topk_ids must lie in \[0, 8\) .* got 8"):
        local_routing(torch.tensor([[1, 8]], dtype=torch.int32), wt, emap, 4, PREFIX)
    assert "holds 4 of 8 experts (global ids [4, 5, 6, 7])" in check_expert_map(emap, 4, PREFIX)
    assert check_expert_map(None, E, PREFIX) == ""
    with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: vLLM's expert_map gives this rank local slots "
                                              r"\[0, 1, 2, 3\]; the layer holds 5 experts"):
        check_expert_map(emap, 5, PREFIX)


def test_expert_parallelism_needs_static_per_expert_activation_scales(dist):
    """Under expert parallelism the weight-0 rows of other ranks' tokens join slot 0's rows, so the
    variants whose activation scale is one per expert (nvfp4, fp8_tensor) must carry a static one in
    both GEMMs: a missing one is refused naming the layer, the variant and the option; per-row
    variants, static scales and no expert parallelism pass."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from dispatch.vllm_plugin.convert import CheckpointError
    from dispatch.vllm_plugin.moe import EP_STATIC_SCALE, check_ep_activations

    _, emap, _ = determine_expert_map(2, 0, E)
    assert EP_STATIC_SCALE == {"nvfp4": "global_scale", "fp8_tensor": "scale"}
    for variant, key in EP_STATIC_SCALE.items():
        static = {key: torch.full((E // 2,), 2.0)}
        check_ep_activations(emap, variant, static, static, PREFIX)
        check_ep_activations(None, variant, {}, {}, PREFIX)
        for w13, w2, which in ((static, {}, "W2"), ({}, static, "W13")):
            with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: expert parallelism with {variant} needs "
                                                      rf"the static per-expert activation {key} of {which}"):
                check_ep_activations(emap, variant, w13, w2, PREFIX)
    for variant in ("mxfp4", "fp8_block", "fp8_channel", "nvfp4_w4a16", "mxfp8"):
        check_ep_activations(emap, variant, {}, {}, PREFIX)


def test_warmup_runs_each_moe_signature_once_per_token_count(moe_ckpt, dist, impl):
    """warmup.warmup_model walks the MoE layers too: one signature, run at each token count once
    (a second walk runs nothing: what a served call needs was compiled at load, on a GPU)."""
    from dispatch.vllm_plugin import warmup

    impl("reference")
    layer = build(moe_ckpt("moe_mxfp4a16"))
    before = layer.quant_method.launched.copy()
    start = warmup.compiles
    assert warmup.warmup_model(layer, (1, 5)) == {"b12x-dual MoE mxfp4_w4a16": 1}
    assert warmup.compiles - start == 2
    assert warmup.warmup_model(layer, (1, 5)) == {"b12x-dual MoE mxfp4_w4a16": 1} and warmup.compiles - start == 2
    assert layer.quant_method.launched == before  # warmup calls are not the layer's served calls
    assert layer.b12x_warmup_provider is layer.quant_method


def test_the_watchdog_checks_served_moe_calls_not_warmup_and_the_replay_names_the_expert(
        moe_ckpt, dist, impl, monkeypatch, tmp_path, caplog, capsys):
    """B12X_CHECK=1 with triton serving an MXFP4 layer whose prepared experts carry one flipped block-scale
    byte of expert e's W2 (tests/faults.py FlippedExpertScale, installed before the layer is built):
    warmup's calls write no replay file; the first served call is checked against the oracle on its own
    routing: one WARNING naming the layer, expert e and its W2 GEMM, one MoE replay file holding the call's topk_ids and
    topk_weights; ``b12x-dual diff --replay`` on it names expert e and its W2 GEMM (exit 1)."""
    import faults
    from dispatch import check, replay
    from dispatch.apps.cli import main
    from dispatch.vllm_plugin import warmup

    monkeypatch.setenv("B12X_CHECK", "1")
    monkeypatch.setenv("B12X_CHECK_DIR", str(tmp_path / "replays"))
    check.reload()
    impl("triton")
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(4, H, generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.rand(4, E, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    wt = torch.rand(4, TOP_K, generator=gen) + 0.05
    wt = wt / wt.sum(dim=1, keepdim=True)
    e = int(ids[0, 0])
    try:
        with faults.installed_moe(faults.FlippedExpertScale, "mxfp4", expert=e, tensor="w2", n=7, kb=1):
            layer = build(moe_ckpt("moe_mxfp4"))
            warmup.warmup_model(layer, (2, 3))
            assert not (tmp_path / "replays").exists()
            with caplog.at_level("WARNING", logger="dispatch.check"):
                layer.forward_modular(x, wt, ids)
            name = layer.quant_method.layer_name
            (msg,) = [r.getMessage() for r in caplog.records if "b12x-dual watchdog" in r.getMessage()]
            assert msg.startswith(f"b12x-dual watchdog: layer {name} on triton (mxfp4, M=4): expert {e}: the W2 GEMM "
                                  "departs first")
            (path,) = (tmp_path / "replays").glob("*.b12x-replay.safetensors")
            rp = replay.read(path)
            assert rp.layer.name == name and torch.equal(rp.topk_ids, ids) and torch.equal(rp.topk_weights, wt)
            rc = main(["diff", "--replay", str(path), "--impls", "triton", "--no-progress", "--plain", "--device", "cpu"])
        out = capsys.readouterr().out
        assert rc == 1 and f"triton: expert {e}: the W2 GEMM departs first" in out and "reproduces here: YES" in out
    finally:
        monkeypatch.delenv("B12X_CHECK")
        check.reload()
