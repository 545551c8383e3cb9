"""vLLM 0.33.0's FusedMoE layers of the two other common MoE checkpoint layouts, served by the
plugin's MoE methods (dispatch/vllm_plugin/moe.py):

gpt-oss's own MXFP4 checkpoint (``engine_env.write_gptoss_model``: the tiny random
GptOssForCausalLM in openai/gpt-oss-20b's layout, ``gate_up_proj_blocks`` u8 [E, 2I, H/32, 16],
``*_scales`` E8M0 bytes, gate/up interleaved, bf16 biases, ``quant_method "mxfp4"``). Layer 0's
experts are built as vLLM's ``MLPBlock`` builds them (``FusedMoEFactory(..., has_bias=True,
activation="swigluoai", routed_experts_cls=GptOssRoutedExperts)`` under vLLM's own quant config of
the checkpoint, GptOssMxfp4Config) and loaded as ``GptOssModel._load_weights_mxfp4`` loads them at
TP = 1 (its renames, its views, one stacked tensor per parameter into ``weight_loader`` with
``shard_id`` / ``expert_id`` None; that method needs a whole model, so its steps are repeated here).

ModelOpt NVFP4 (``engine_env.write_modelopt_moe_model``: the tiny Qwen3-MoE exported by
nvidia-modelopt where it is installed, else derived in ModelOpt's layout; this venv has no
ModelOpt, so here it is derived, and tests/vllm_engine/test_engine_moe_checkpoints.py checks the
derived layout against ModelOpt's own export). Loaded through vLLM's ``RoutedExperts.load_weights``
(checkpoint names -> w13_/w2_ parameters, shard ids, expert ids).

Checked, per layout: the method is ours and serves the variant (gpt-oss: mxfp4_w4a16 with
swigluoai and biases; ModelOpt NVFP4: nvfp4, W4A16_NVFP4: nvfp4_w4a16); the output against
formats.reference_moe over experts built from the checkpoint's tensors with formats alone (within
one bf16 rounding under B12X_IMPL=reference, the Triton lesson's derived bound under triton);
ModelOpt's global-scale convention (a multiplier; formats' g a divisor) against ModelOpt's
definition of the weight; a tampered or missing expert scale refused naming layer, expert and tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _vllm_env import ckpt_root, dist, impl, written_once  # noqa: F401  (skips without vLLM 0.33.0; CPU platform, VLLM_PLUGINS)
import harness
import torch

import formats
from formats.codecs import decode_e2m1, decode_e4m3, unpack_e2m1
from conftest import DEVICE  # noqa: F401  (the seeded session; vLLM's CPU platform runs these layers)

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "vllm_engine"))
import engine_env  # noqa: E402  (the checkpoint writers; no engine needed)
from test_vllm_moe import (E, H, I, PREFIX, TOP_K, _assert_rounded_oracle, _call,  # noqa: E402  (one tiny
                           _lesson_bound, _tensors)  # Qwen3-MoE layer 0, as engine_env writes it)
# gpt-oss's checkpoint names -> vLLM's parameters (GptOssForCausalLM.hf_to_vllm_mapper's suffixes)
GPTOSS_NAMES = {"gate_up_proj_blocks": "w13_weight", "gate_up_proj_scales": "w13_weight_scale",
                "gate_up_proj_bias": "w13_bias", "down_proj_blocks": "w2_weight",
                "down_proj_scales": "w2_weight_scale", "down_proj_bias": "w2_bias"}
MODELOPT_SERVED = {"modelopt_moe_NVFP4": "nvfp4", "modelopt_moe_W4A16_NVFP4": "nvfp4_w4a16"}


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gptoss_ckpt(ckpt_root):
    return written_once(ckpt_root, engine_env.write_gptoss_model)("gptoss_mxfp4")


def build_gptoss(ckpt: Path, *, tamper=None, skip=(), linear_backend="b12x", intermediate=I):
    """vLLM's GptOssRoutedExperts for layer 0 of ``ckpt``, loaded as GptOssModel._load_weights_mxfp4
    loads it at TP = 1 and processed. ``tamper(name, tensor)`` edits a checkpoint tensor on the way
    in; ``skip``: checkpoint leaf names (``down_proj_scales``) left out; ``intermediate``: the
    layer's I per rank (above the checkpoint's: the rows vLLM's loader leaves unfilled)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    with harness.vllm_context(ckpt, linear_backend=linear_backend) as cfg:
        qc = harness.quant_config(cfg)
        runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=intermediate,
                                 renormalize=True, quant_config=qc, prefix=PREFIX, params_dtype=torch.bfloat16,
                                 apply_router_weight_on_input=False, has_bias=True, activation="swigluoai",
                                 routed_experts_cls=GptOssRoutedExperts)
        layer = runner.routed_experts
        if linear_backend != "b12x":
            return layer
        params = dict(layer.named_parameters())
        for name, t in _tensors(ckpt).items():
            leaf = name[len(PREFIX) + 1:]
            if leaf in skip:
                continue
            if tamper is not None:
                t = tamper(leaf, t)
            pname = GPTOSS_NAMES[leaf]
            if pname == "w13_weight":  # _load_weights_mxfp4's views of the blocks
                t = t.view(E, 2 * I, -1).contiguous()
            elif pname == "w2_weight":
                t = t.view(E, -1, I // 2).contiguous()
            p = params[pname]
            p.weight_loader(p, t, weight_name=f"{PREFIX}.{pname}", shard_id=None, expert_id=None)
        layer.quant_method.process_weights_after_loading(layer)
        return layer


def gptoss_experts(ckpt: Path):
    """(w13, w2, w13_bias, w2_bias) from the checkpoint's tensors with formats alone: each expert's
    blocks [2I, H/32, 16] as the [2I, H/2] packed codes of an OCP MXFP4 weight, its E8M0 scales."""
    t = _tensors(ckpt)
    out = []
    for stem, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        b, s = t[f"{PREFIX}.{stem}_blocks"], t[f"{PREFIX}.{stem}_scales"]
        out.append([formats.QuantizedTensor("mxfp4", "weight", b[e].reshape(n, k // 2), s[e], None, (1, 32), (n, k))
                    for e in range(E)])
    return out[0], out[1], t[f"{PREFIX}.gate_up_proj_bias"].float(), t[f"{PREFIX}.down_proj_bias"].float()


def test_gptoss_layer_is_served_as_mxfp4_w4a16_and_matches_the_oracle(gptoss_ckpt, dist, impl):
    from dispatch.vllm_plugin.moe import B12xDualGptOssMxfp4MoEMethod

    impl("reference")
    layer = build_gptoss(gptoss_ckpt)
    method = layer.quant_method
    assert type(method) is B12xDualGptOssMxfp4MoEMethod
    assert method.variant == "mxfp4_w4a16" and method.bound.variant == "mxfp4_w4a16"
    assert method.bound.activation == "swigluoai" and method.bound.w13_bias is not None
    w13, w2, b13, b2 = gptoss_experts(gptoss_ckpt)
    x, ids, wt, y = _call(layer, 7, 0)
    _assert_rounded_oracle(y, x, w13, w2, ids, wt, activation="swigluoai", w13_bias=b13, w2_bias=b2, a16=True)
    assert method.launched == {"reference": 1}
    rep = method.report(7)
    assert PREFIX in rep and "mxfp4_w4a16" in rep and "gpt-oss MXFP4" in rep and "ran: reference: 1 calls" in rep


def test_gptoss_rows_past_the_checkpoint_compute_zero(gptoss_ckpt, dist, impl):
    """vLLM's gpt-oss loader gives each tensor-parallel rank whole 32-blocks of I (cdiv), so the last
    rank's I can exceed what the checkpoint fills (gpt-oss-20b's I = 2880 at TP = 4: 736 per rank,
    672 filled on the last); it copies into the leading rows only. Here the layer holds I = 160 and
    the checkpoint 128: the extra rows must compute 0 (zero codes and biases, as vLLM's method
    allocates them), so the output is the 128-row oracle's (one bf16 rounding)."""
    impl("reference")
    layer = build_gptoss(gptoss_ckpt, intermediate=I + 32)
    assert layer.quant_method.bound.intermediate == I + 32
    w13, w2, b13, b2 = gptoss_experts(gptoss_ckpt)
    x, ids, wt, y = _call(layer, 6, 4)
    _assert_rounded_oracle(y, x, w13, w2, ids, wt, activation="swigluoai", w13_bias=b13, w2_bias=b2, a16=True)


def test_gptoss_expert_parallel_slice_must_match_the_expert_map(dist):
    """vLLM's gpt-oss loader gives EP rank r the contiguous experts [r * E // ep, (r + 1) * E // ep):
    vLLM's linear expert_map (ep dividing E) routes exactly those there; a round_robin map, or
    8 experts over 3 ranks (vLLM gives the first ranks one more), routes others there, and the
    layer is refused by name instead of serving other experts' weights."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from dispatch.vllm_plugin.convert import CheckpointError
    from dispatch.vllm_plugin.moe import check_gptoss_expert_slice

    check_gptoss_expert_slice(None, 0, 1, PREFIX)
    for r in range(2):
        check_gptoss_expert_slice(determine_expert_map(2, r, E, "linear")[1], r, 2, PREFIX)
    with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: vLLM's gpt-oss loader gives expert-parallel rank 1 "
                                              r"of 2 the experts \[4, 8\) in order, but the layer's expert_map routes "
                                              r"global ids \[1, 3, 5, 7\] .*round_robin"):
        check_gptoss_expert_slice(determine_expert_map(2, 1, E, "round_robin")[1], 1, 2, PREFIX)
    with pytest.raises(CheckpointError, match=r"rank 1 of 3 the experts \[2, 4\) in order, .* global ids \[3, 4, 5\]"):
        check_gptoss_expert_slice(determine_expert_map(3, 1, E, "linear")[1], 1, 3, PREFIX)


@pytest.mark.parametrize("i_rank, rounded", [(48, 64), (720, 736), (64, 64), (1440, 1440)])
def test_gptoss_rank_intermediate_is_rounded_up_to_whole_blocks(i_rank, rounded, dist):
    """vLLM's gpt-oss loader gives a tensor-parallel rank cdiv(I / 32, TP) 32-blocks of I, so the
    method's I per rank is rounded up to whole blocks as vLLM's own method rounds it (I = 96 at
    TP = 2: 48 -> 64; gpt-oss-20b's 2880 at TP = 4: 720 -> 736), H unchanged."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    from dispatch.vllm_plugin.moe import B12xDualGptOssMxfp4MoEMethod

    method = B12xDualGptOssMxfp4MoEMethod.__new__(B12xDualGptOssMxfp4MoEMethod)
    assert method.maybe_roundup_sizes(H, i_rank, torch.bfloat16, FusedMoEParallelConfig.make_no_parallel()) == \
        (H, rounded)


def test_gptoss_layer_triton_within_the_lesson_bound(gptoss_ckpt, dist, impl):
    impl("triton")
    _moe_bound, _assert_matches = _lesson_bound()
    layer = build_gptoss(gptoss_ckpt)
    w13, w2, b13, b2 = gptoss_experts(gptoss_ckpt)
    x, ids, wt, y = _call(layer, 5, 1)
    assert layer.quant_method.launched == {"triton": 1}
    ref, bound = _moe_bound(y, x, w13, w2, ids, wt, activation="swigluoai", w13_bias=b13,
                            w2_bias=b2, a16=True)
    _assert_matches(y, ref, bound, "gpt-oss mxfp4_w4a16")


def test_gptoss_without_the_switch_vllm_keeps_its_method(gptoss_ckpt, dist):
    from dispatch.vllm_plugin.moe import B12xDualMoEMethod

    try:
        layer = build_gptoss(gptoss_ckpt, linear_backend="auto")
    except Exception as e:  # noqa: BLE001  (vLLM's own method may refuse this machine: not ours either way)
        assert "b12x-dual" not in str(e)
        return
    assert not isinstance(layer.quant_method, B12xDualMoEMethod), type(layer.quant_method).__name__


def test_gptoss_tampered_expert_scale_is_refused_by_name(gptoss_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")

    def tamper(leaf, t):
        if leaf != "gate_up_proj_scales":
            return t
        t = t.clone()
        t[5, 17, 3] = 0xFF  # E8M0 NaN in expert 5, row 17, K-block 3
        return t

    with pytest.raises(CheckpointError, match=rf"{PREFIX} \(expert 5, w13\): w13_weight_scale: 1 E8M0 .*row 17, "
                                              r"K-block 3"):
        build_gptoss(gptoss_ckpt, tamper=tamper)


def test_gptoss_missing_expert_scales_and_bad_bias_are_refused_by_name(gptoss_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: checkpoint tensor\(s\) 'w2_weight_scale' \(expert 0, "
                                              r"expert 1, .*\(8 in all\)\) missing"):
        build_gptoss(gptoss_ckpt, skip=("down_proj_scales",))

    def tamper(leaf, t):
        if leaf != "down_proj_bias":
            return t
        t = t.clone()
        t[3, 9] = float("inf")
        return t

    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 3: checkpoint tensor 'w2_bias' holds inf at row 9"):
        build_gptoss(gptoss_ckpt, tamper=tamper)


# ---------------------------------------------------------------------------------------------
# ModelOpt NVFP4
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modelopt_ckpt(ckpt_root):
    return written_once(ckpt_root, engine_env.write_modelopt_moe_model)


def build_modelopt(ckpt: Path, *, tamper=None, skip=()):
    """vLLM's RoutedExperts for layer 0 of the ModelOpt checkpoint ``ckpt``, loaded through vLLM's
    ``RoutedExperts.load_weights`` (names relative to the layer, as the model's loader hands them)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    with harness.vllm_context(ckpt) as cfg:
        qc = harness.quant_config(cfg)
        runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, renormalize=True,
                                 quant_config=qc, prefix=PREFIX, params_dtype=torch.bfloat16)
        layer = runner.routed_experts
        weights = [(n[len(PREFIX) + 1:], tamper(n, t) if tamper else t) for n, t in _tensors(ckpt).items()
                   if n not in skip]
        list(layer.load_weights(weights))
        layer.quant_method.process_weights_after_loading(layer)
        return layer


def _modelopt_dequantized(t: dict, p: str) -> torch.Tensor:
    """ModelOpt's definition of an NVFP4 weight (modelopt NVFP4QTensor.dequantize): e2m1 value x
    e4m3 block scale x weight_scale_2, in float64."""
    v = decode_e2m1(unpack_e2m1(t[p + "weight"])).double()
    s = decode_e4m3(t[p + "weight_scale"]).double().repeat_interleave(16, dim=1)
    return v * s * t[p + "weight_scale_2"].double()


def modelopt_experts(ckpt: Path, kind: str):
    """(w13, w2, w13_act_opts, w2_act_opts) from the checkpoint's tensors with formats alone: g =
    1 / weight_scale_2 (ModelOpt's multiplier as formats' divisor, rounded once to float32), W13's
    input g from the larger of gate's and up's input_scale (vLLM's a13_scale.max)."""
    t = _tensors(ckpt)
    recip = lambda v: (1.0 / v.double()).float().reshape(())  # noqa: E731
    w13, w2, a13, a2 = [], [], [], []
    for e in range(E):
        g, u, d = (f"{PREFIX}.{e}.{proj}." for proj in ("gate_proj", "up_proj", "down_proj"))
        w13.append(formats.QuantizedTensor("nvfp4", "weight", torch.cat([t[g + "weight"], t[u + "weight"]]),
                                           torch.cat([t[g + "weight_scale"], t[u + "weight_scale"]]),
                                           recip(t[g + "weight_scale_2"]), (1, 16), (2 * I, H)))
        w2.append(formats.QuantizedTensor("nvfp4", "weight", t[d + "weight"], t[d + "weight_scale"],
                                          recip(t[d + "weight_scale_2"]), (1, 16), (H, I)))
        if MODELOPT_SERVED[kind] == "nvfp4":
            a13.append(recip(torch.maximum(t[g + "input_scale"], t[u + "input_scale"])))
            a2.append(recip(t[d + "input_scale"]))
    opts = lambda a: {"global_scale": torch.stack(a)} if a else None  # noqa: E731
    return w13, w2, opts(a13), opts(a2)


@pytest.mark.parametrize("kind", list(MODELOPT_SERVED))
def test_modelopt_layer_is_served_and_matches_the_oracle(kind, modelopt_ckpt, dist, impl):
    from dispatch import registry
    from dispatch.vllm_plugin.moe import B12xDualModelOptNvFp4MoEMethod

    impl("reference")
    ckpt = modelopt_ckpt(kind)
    layer = build_modelopt(ckpt)
    method = layer.quant_method
    assert type(method) is B12xDualModelOptNvFp4MoEMethod
    assert method.variant == MODELOPT_SERVED[kind] and method.bound.variant == MODELOPT_SERVED[kind]
    w13, w2, o13, o2 = modelopt_experts(ckpt, kind)
    x, ids, wt, y = _call(layer, 7, 2)
    _assert_rounded_oracle(y, x, w13, w2, ids, wt, a16=registry.variant(MODELOPT_SERVED[kind]).a16,
                           w13_act_opts=o13, w2_act_opts=o2)
    assert method.launched == {"reference": 1} and "ModelOpt" in method.report(7)


def test_modelopt_layer_triton_within_the_lesson_bound(modelopt_ckpt, dist, impl):
    impl("triton")
    _moe_bound, _assert_matches = _lesson_bound()
    ckpt = modelopt_ckpt("modelopt_moe_NVFP4")
    layer = build_modelopt(ckpt)
    w13, w2, o13, o2 = modelopt_experts(ckpt, "modelopt_moe_NVFP4")
    x, ids, wt, y = _call(layer, 5, 3)
    assert layer.quant_method.launched == {"triton": 1}
    ref, bound = _moe_bound(y, x, w13, w2, ids, wt, w13_act_opts=o13, w2_act_opts=o2)
    _assert_matches(y, ref, bound, "ModelOpt nvfp4")


def test_modelopt_global_scale_convention(modelopt_ckpt, dist, impl):
    """The method's experts (g = 1 / weight_scale_2) dequantize to ModelOpt's own definition of the
    weight, e2m1 x e4m3 x weight_scale_2, within 2^-22 relative: the reciprocal's one float32
    rounding (2^-24) and formats' float32 division (2^-24), each relative; g itself (not 1/g) would
    be off by a factor of about 2688^2 / amax^2."""
    impl("reference")
    ckpt = modelopt_ckpt("modelopt_moe_NVFP4")
    layer = build_modelopt(ckpt)
    t = _tensors(ckpt)
    for e in (0, 5):
        for stem, q, proj in (("w13", layer.quant_method.bound.w13[e], "gate_proj"),
                              ("w2", layer.quant_method.bound.w2[e], "down_proj")):
            want = _modelopt_dequantized(t, f"{PREFIX}.{e}.{proj}.")
            got = formats.dequantize(q, torch.float64)[: want.shape[0]]
            assert bool(((got - want).abs() <= want.abs() * 2.0 ** -22).all()), (stem, e)


def test_modelopt_tampered_and_missing_expert_scales_are_refused_by_name(modelopt_ckpt, dist, impl):
    from dispatch.vllm_plugin.convert import CheckpointError

    impl("reference")
    ckpt = modelopt_ckpt("modelopt_moe_NVFP4")
    bad = f"{PREFIX}.5.up_proj.weight_scale"

    def nan_scale(name, t):
        if name != bad:
            return t
        t = t.clone()
        t.view(torch.uint8)[3, 2] = 0x7F  # e4m3 NaN
        return t

    with pytest.raises(CheckpointError, match=rf"{PREFIX} \(expert 5, w13\): w13_weight_scale"):
        build_modelopt(ckpt, tamper=nan_scale)
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: checkpoint tensor\(s\) 'w13_weight_scale_2' "
                                              r"\(expert 6 w3\) missing"):
        build_modelopt(ckpt, skip=(f"{PREFIX}.6.up_proj.weight_scale_2",))
    zero = f"{PREFIX}.2.down_proj.weight_scale_2"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 2: checkpoint tensor 'w2_weight_scale_2' holds "
                                              r"0.0; a per-tensor scale must be finite and > 0"):
        build_modelopt(ckpt, tamper=lambda n, t: torch.zeros_like(t) if n == zero else t)
    up = f"{PREFIX}.4.up_proj.weight_scale_2"
    with pytest.raises(CheckpointError, match=rf"{PREFIX}: expert 4: checkpoint tensor 'w13_weight_scale_2' holds "
                                              r"gate .* and up .*one weight global scale \(weight_scale_2\) per "
                                              r"expert \(ModelOpt's export shares it"):
        build_modelopt(ckpt, tamper=lambda n, t: t * 2 if n == up else t)


def test_modelopt_w13_input_scale_is_the_larger_of_gate_and_up(modelopt_ckpt, dist, impl):
    """One static input scale serves an expert's W13: the larger of gate's and up's, as vLLM's
    kernels take it (``a13_scale.max(dim=1)``, quantization/utils/flashinfer_fp4_moe.py and
    b12x_moe.py), as formats' divisor g = 1 / input_scale (within the reciprocal's float32 rounding)."""
    impl("reference")
    ckpt = modelopt_ckpt("modelopt_moe_NVFP4")
    up = f"{PREFIX}.1.up_proj.input_scale"
    layer = build_modelopt(ckpt, tamper=lambda n, t: t * 4 if n == up else t)
    t = _tensors(ckpt)
    g = layer.quant_method.bound.w13_act_opts["global_scale"].double()
    want = 1 / torch.stack([t[f"{PREFIX}.0.gate_proj.input_scale"].double(), t[up].double() * 4])
    assert bool(((g[:2] - want).abs() <= want * 2.0 ** -23).all()), (g[:2], want)


def test_gptoss_layer_with_another_activation_is_refused_by_name(gptoss_ckpt, dist):
    """gpt-oss's W13 rows are interleaved for swigluoai; the method serves nothing else, and says so
    at the layer's construction (vLLM's method would build it)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    from dispatch.vllm_plugin.convert import CheckpointError

    with harness.vllm_context(gptoss_ckpt) as cfg:
        with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: gpt-oss MXFP4 .* with activation 'silu'; "
                                                  r"b12x-dual's gpt-oss MXFP4 MoE method serves \('swigluoai',\)"):
            FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, renormalize=True,
                            quant_config=harness.quant_config(cfg), prefix=PREFIX, params_dtype=torch.bfloat16,
                            has_bias=True, activation="silu", routed_experts_cls=GptOssRoutedExperts)


def test_gptoss_under_auto_is_never_first(gptoss_ckpt, dist, monkeypatch):
    """Under auto the plugin's MoE method goes first only where b12x's fused MoE (cute) serves the
    layer, and it takes no expert biases: gpt-oss's layers stay vLLM's on every device unless asked for."""
    from dispatch.vllm_plugin import moe, placement

    monkeypatch.delenv(placement.ENV_AUTO, raising=False)
    with harness.vllm_context(gptoss_ckpt, linear_backend="auto"):
        ok, why = moe.wanted("mxfp4_w4a16", biases=True)
    assert not ok and "takes no expert biases" in why and "--moe-backend b12x" in why, why
    with harness.vllm_context(gptoss_ckpt, linear_backend="b12x"):
        assert moe.wanted("mxfp4_w4a16", biases=True) == (True, "--linear-backend b12x")


def test_modelopt_group_size_other_than_16_is_refused_by_name(modelopt_ckpt, dist, tmp_path):
    """The ModelOpt config with ``group_size`` 32 (the config alone; NVFP4's block is 16 by
    definition): refused at the layer's construction naming the layer and the group size."""
    import json
    import shutil

    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from dispatch.vllm_plugin.convert import CheckpointError

    ckpt = tmp_path / "modelopt_group32"
    shutil.copytree(modelopt_ckpt("modelopt_moe_NVFP4"), ckpt)
    for name in ("config.json", "hf_quant_config.json"):
        cfg = json.loads((ckpt / name).read_text())
        qc = cfg.get("quantization_config") or cfg["quantization"]
        qc["group_size"] = 32
        for group in qc.get("config_groups", {}).values():
            for key in ("weights", "input_activations"):
                if group.get(key):
                    group[key]["group_size"] = 32
        (ckpt / name).write_text(json.dumps(cfg))
    with harness.vllm_context(ckpt) as cfg:
        with pytest.raises(CheckpointError, match=rf"layer {PREFIX}: the checkpoint is ModelOpt NVFP4 with group_size "
                                                  r"32; NVFP4 experts have one e4m3 block scale per 16 elements"):
            FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, renormalize=True,
                            quant_config=harness.quant_config(cfg), prefix=PREFIX, params_dtype=torch.bfloat16)
