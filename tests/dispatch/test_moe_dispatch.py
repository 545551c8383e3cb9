"""dispatch.moe: MoE layers through the registry (the MoE table, choose, BoundMoE, fused_moe,
explain_moe) against the float64 oracle formats.reference_moe, on fresh seeded inputs.

Numbers: every variant the Triton lesson serves (kernels_triton.moe.FORMATS, weight-only
A16_FORMATS), forced to triton, is checked against the oracle with the bound of
tests/kernels_triton/test_moe.py (``_moe_bound``: derived stage by stage from the lesson's
roundings, see that module's docstring), loaded from that file so that there is one derivation;
the reference backend must equal the oracle exactly (it is the oracle, given the same arguments:
the test is that dispatch passes every argument through).

Decisions are checked on devices described as values (DeviceInfo: an H200 sm_90, a GB10 sm_121 with
and without b12x, the CPU), with expectations read from the MoE table and the device, not
hard-coded. Tiny shapes: the interpreter runs every kernel on a CPU.
"""

from __future__ import annotations

import dataclasses

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, device_name, make_input

import dispatch
import formats
from _moe_testlib import moe_experts, moe_routing
from dispatch import backends, moe as dm, policy, registry
from dispatch.contract import ImplementationUnavailable, UnsupportedEntry
from dispatch.devices import CPU, KNOWN_DEVICES, interpreting
from kernels_triton import moe as tmoe

ROOT = Path(__file__).resolve().parents[2]


def _load_bound():
    spec = importlib.util.spec_from_file_location("_lesson_moe_tests", ROOT / "tests/kernels_triton/test_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._moe_bound, mod._assert_matches


_moe_bound, _assert_matches = _load_bound()

E, H, I, M, TOP_K = 4, 128, 128, 5, 2  # H, I: fp8_block's 128-wide scale group fits once
LESSON = [f for f in tmoe.FORMATS] + [registry.variant_name(f, True) for f in tmoe.A16_FORMATS]
ACTS = formats.MOE_ACTIVATIONS
HERE = CPU if interpreting() else dispatch.current_device()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    dm.clear_cache()
    yield
    dm.clear_cache()


def _experts(fmt, e=E, h=H, i=I):
    return moe_experts(fmt, e, h, i)


def _routing(m=M, e=E, k=TOP_K):
    return moe_routing(m, e, k)


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", LESSON)
def test_bound_moe_on_triton_matches_the_oracle(variant, monkeypatch):
    v = registry.variant(variant)
    act = ACTS[LESSON.index(variant) % len(ACTS)]
    w13, w2 = _experts(v.fmt)
    x = make_input((M, H), torch.bfloat16)
    ids, wt = _routing()
    b13 = (torch.randn(E, 2 * I) * 0.1).to(DEVICE) if variant == "mxfp4" else None
    layer = dispatch.BoundMoE(w13, w2, variant=variant if v.a16 else None, activation=act, w13_bias=b13,
                              name="layers.0.mlp.experts")
    monkeypatch.setenv(policy.ENV_VAR, "triton")
    y = layer(x, ids, wt, renormalize=variant == "nvfp4")
    assert layer.last_impl == "triton" and list(layer.backends) == [f"triton:{variant}"]
    ref, bound = _moe_bound(y, x, w13, w2, ids, wt, activation=act, a16=v.a16, w13_bias=b13,
                            renormalize=variant == "nvfp4")
    _assert_matches(y, ref, bound, variant)


@pytest.mark.parametrize("variant", ["fp8_tensor", "nvfp4_w4a16", "fp8_channel"])
def test_the_reference_backend_is_the_oracle_with_every_argument(variant, monkeypatch):
    v = registry.variant(variant)
    w13, w2 = _experts(v.fmt)
    x = make_input((M, H), torch.float32)
    ids, wt = _routing()
    b13, b2 = (torch.randn(E, 2 * I) * 0.1).to(DEVICE), (torch.randn(E, H) * 0.1).to(DEVICE)
    opts = {} if v.a16 or v.fmt != "fp8_tensor" else {"scale": (torch.rand(E) + 0.01).to(DEVICE)}
    kw = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2, w13_act_opts=opts or None, w2_act_opts=opts or None)
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    layer = dispatch.BoundMoE(w13, w2, variant=variant, swiglu_alpha=1.5, swiglu_limit=5.0, **kw)
    y = layer(x, ids, wt, renormalize=True)
    ref = formats.reference_moe(x, w13, w2, ids, wt, renormalize=True, a16=v.a16, swiglu_alpha=1.5,
                                swiglu_limit=5.0, **kw)
    assert layer.last_impl == "reference" and y.dtype == torch.float32
    assert torch.equal(y, ref)
    # the unbound door gives the same, with impl= over B12X_IMPL
    with pytest.raises(dispatch.InvalidImplementation, match="impl='gpu' is not an implementation"):
        dispatch.fused_moe(x, w13, w2, ids, wt, variant=variant, impl="gpu")
    assert torch.equal(dispatch.fused_moe(x, w13, w2, ids, wt, variant=variant, renormalize=True, impl="reference",
                                          **kw), formats.reference_moe(x, w13, w2, ids, wt, renormalize=True,
                                                                       a16=v.a16, **kw))


def test_b12x_impl_selects_the_implementation(monkeypatch):
    w13, w2 = _experts("mxfp8")
    x, (ids, wt) = make_input((M, H)), _routing()
    layer = dispatch.BoundMoE(w13, w2)
    for impl in ("reference", "triton"):
        monkeypatch.setenv(policy.ENV_VAR, impl)
        if impl == "triton" and not dm.get("triton", "mxfp8").is_supported(HERE)[0]:
            continue
        layer(x, ids, wt)
        assert layer.last_impl == impl
    assert sorted(layer.backends) == sorted(f"{i}:mxfp8" for i in ("reference", "triton"))
    monkeypatch.setenv(policy.ENV_VAR, "hopper")  # a named gap: forced, never a silent fallback
    with pytest.raises(ImplementationUnavailable, match="no sm_90 MoE kernels for this variant"):
        layer(x, ids, wt)
    monkeypatch.setenv(policy.ENV_VAR, "nonsense")
    with pytest.raises(dispatch.InvalidImplementation, match="B12X_IMPL='nonsense'"):
        layer(x, ids, wt)


def test_auto_here_runs_what_the_registry_chooses():
    w13, w2 = _experts("nvfp4")
    x, (ids, wt) = make_input((M, H)), _routing()
    layer = dispatch.BoundMoE(w13, w2, activation="swigluoai_uninterleave")
    c = layer.choice(M, TOP_K)
    y = layer(x, ids, wt)
    assert layer.last_impl == c.impl and y.shape == (M, H) and y.dtype == x.dtype
    if c.impl == "triton":
        ref, bound = _moe_bound(y, x, w13, w2, ids, wt, activation="swigluoai_uninterleave")
        _assert_matches(y, ref, bound)


# ---------------------------------------------------------------------------------------------
# Decisions on described devices
# ---------------------------------------------------------------------------------------------
def _b12x(monkeypatch, installed: bool):
    probe = backends.B12xProbe(object(), "1.5.1", None) if installed else \
        backends.B12xProbe(None, None, "ModuleNotFoundError: No module named 'b12x'")
    monkeypatch.setattr(backends, "b12x_probe", lambda: probe)


def _expected(device, problem):
    """(impl, reasons of the ones skipped) by walking the table as the policy says: the first cell
    of registry.priority(device) whose verdict passes."""
    skipped = []
    for impl in registry.priority(device):
        ok, why = dm.verdict(dm.entries()[(impl, problem.variant)], problem, device)
        if ok:
            return impl, skipped
        skipped.append(why)
    raise AssertionError("nothing serves")


def test_the_table_has_every_cell_and_names_its_gaps():
    table = dm.entries()
    assert set(table) == {(i, v) for i in registry.IMPLS for v in registry.VARIANTS}
    for v in registry.VARIANTS:
        assert isinstance(table[("reference", v)], dm.ReferenceMoE)
        if v in dm.HOPPER_MOE_VARIANTS and dm.hopper_moe_on():
            assert isinstance(table[("hopper", v)], dm.HopperMoE)
        else:
            cell = table[("hopper", v)]
            assert isinstance(cell, UnsupportedEntry) and cell.reason == dm.hopper_gap(v)
        assert isinstance(table[("triton", v)], dm.TritonMoE) == (v in LESSON)
    for v in ("fp8_tensor", "fp8_block", "fp8_channel", "mxfp8", "mxfp8_w8a16"):
        assert table[("cute", v)].reason == "b12x 1.5.1 has no FP8 MoE; triton serves"
    for v in ("nvfp4", "mxfp4"):
        if dm.cute_moe_present():
            assert isinstance(table[("cute", v)], dm.CuteMoE)
        else:
            assert table[("cute", v)].reason == "kernels_cute.moe is not in this installation"
    with pytest.raises(registry.Unsupported, match="no sm_90 MoE kernels for this variant"):
        dm.get("hopper", "fp8_block")
    if not dm.hopper_moe_on():
        with pytest.raises(registry.Unsupported, match="written, not yet run on a GPU"):
            dm.get("hopper", "nvfp4")


def _hopper_gate_off(monkeypatch):
    """The sm_90 MoE's gate off for one test (HOPPER_MOE_GPU_RAN False, no B12X_HOPPER_MOE_UNVERIFIED),
    the table rebuilt under it: the hopper cells are named gaps, as on a machine before the GPU ran them."""
    monkeypatch.setattr(dm, "HOPPER_MOE_GPU_RAN", False)
    monkeypatch.delenv(dm.HOPPER_UNVERIFIED_ENV, raising=False)
    monkeypatch.setattr(dm, "_TABLE", {})
    dm.clear_cache()


def test_h200_picks_the_triton_lesson_after_the_hopper_gap(monkeypatch):
    """While the sm_90 MoE's gate is off the hopper cell is a named gap and auto on an H200 takes the
    lesson; an unserved variant stays a gap."""
    _hopper_gate_off(monkeypatch)
    p = dm.MoEProblem("mxfp4", 32, 4, 2880, 2880, 16, "swigluoai")
    c = dm.choose(p, KNOWN_DEVICES["h200"])
    assert c.impl == "triton" and c.requested == "auto"
    assert c.considered[0] == ("hopper", False, f"hopper has no MoE kernel for mxfp4: {dm.HOPPER_UNRUN}")
    assert "written, not yet run on a GPU" in c.reason
    r = c.backend.route(p, KNOWN_DEVICES["h200"])
    assert r.kernels == tmoe.route(16, 32, 4, 2880, 2880, fmt="mxfp4", capability=(9, 0)).kernels
    c8 = dm.choose(dataclasses.replace(p, variant="mxfp8"), KNOWN_DEVICES["h200"])
    assert c8.considered[0] == ("hopper", False, f"hopper has no MoE kernel for mxfp8: {dm.HOPPER_GAP}")
    dm.clear_cache()


@pytest.mark.parametrize("installed", [True, False], ids=["b12x", "no-b12x"])
@pytest.mark.parametrize("variant", ["nvfp4", "mxfp4", "fp8_block"])
def test_gb10_follows_the_table(monkeypatch, installed, variant):
    _b12x(monkeypatch, installed)
    gb10 = KNOWN_DEVICES["gb10"]
    p = dm.MoEProblem(variant, 128, 8, 2048, 768, 1, static_scales=True)
    impl, skipped = _expected(gb10, p)
    c = dm.choose(p, gb10)
    assert c.impl == impl and c.considered[0][0] == "cute"
    cell = dm.entries()[("cute", variant)]
    if isinstance(cell, UnsupportedEntry):  # FP8, or kernels_cute.moe not merged yet: the gap's reason
        assert c.impl == "triton" and cell.reason in c.reason
    elif not installed:
        assert c.impl == "triton" and "b12x is not installed" in c.reason
    assert skipped == [w for _, ok, w in c.considered if not ok]


def test_cute_refuses_what_b12x_cannot_serve_before_asking_kernels_cute():
    gb10, cute = KNOWN_DEVICES["gb10"], dm.CuteMoE("nvfp4_w4a16")
    p = dm.MoEProblem("nvfp4_w4a16", 32, 4, 2880, 2880, 1, "swigluoai", has_bias=True)
    assert cute.can_implement(p, gb10) == (False, f"cute: {dm.CUTE_NO_BIAS}")
    p = dm.MoEProblem("nvfp4_w4a16", 32, 4, 2880, 2880, 1, "swigluoai", dtype=torch.float16)
    assert cute.can_implement(p, gb10) == (False, f"cute: {dm.CUTE_BF16_ONLY}, got float16")
    p = dm.MoEProblem("nvfp4", 128, 8, 2048, 768, 1)  # dynamic activation global scales
    assert dm.CuteMoE("nvfp4").can_implement(p, gb10) == (False, f"cute: {dm.CUTE_STATIC_NVFP4}")
    c = dm.choose(p, gb10)
    assert c.impl == "triton" and not c.considered[0][1]
    # a layer knows whether its scales are static
    w13, w2 = _experts("nvfp4")
    g = {"global_scale": torch.full((E,), 100.0, device=DEVICE)}
    assert dispatch.BoundMoE(w13, w2, w13_act_opts=g, w2_act_opts=g).problem(1, 2).static_scales
    assert not dispatch.BoundMoE(w13, w2, w13_act_opts=g).problem(1, 2).static_scales
    assert not dispatch.BoundMoE(w13, w2, variant="nvfp4_w4a16").problem(1, 2).static_scales


def test_the_cpu_takes_triton_under_the_interpreter_else_the_oracle():
    p = dm.MoEProblem("nvfp4", 8, 2, 128, 128, 3)
    c = dm.choose(p, CPU)
    assert c.impl == ("triton" if interpreting() else "reference")


def test_an_sm12x_gpu_runs_the_cute_cell_when_there_is_one():
    here = dispatch.current_device()
    if not here.is_sm12x:
        pytest.skip(f"needs an SM120/SM121 GPU for b12x's fused MoE; found {device_name()}")
    if not dm.cute_moe_present():
        pytest.skip("kernels_cute.moe is not in this installation")
    w13, w2 = _experts("nvfp4")
    x, (ids, wt) = make_input((M, H)), _routing()
    layer = dispatch.BoundMoE(w13, w2)
    with policy.use_impl("cute"):
        y = layer(x, ids, wt)
    ref = formats.reference_moe(x, w13, w2, ids, wt, out_dtype=torch.float64)
    assert layer.last_impl == "cute" and torch.isfinite(y).all()
    assert (y.double().cpu() - ref.cpu()).norm() <= 0.05 * ref.norm()  # b12x's own roundings (docs/moe.md)


def test_the_decision_cache_is_keyed_by_every_field():
    dev = KNOWN_DEVICES["h200"]
    base = dm.MoEProblem("nvfp4", 8, 2, 128, 128, 17, "silu", torch.bfloat16)
    c = dm.choose(base, dev)
    assert dm.choose(dm.MoEProblem("nvfp4", 8, 2, 128, 128, 32), dev) is c  # 17 and 32: one M bucket
    assert len(dm._cache) == 1
    variations = [dict(M=33), dict(variant="nvfp4_w4a16"), dict(num_experts=16), dict(top_k=4), dict(hidden=256),
                  dict(intermediate=256), dict(activation="swigluoai"), dict(dtype=torch.float16), dict(has_bias=True),
                  dict(static_scales=True)]
    for n, change in enumerate(variations, start=2):
        fields = {**base.__dict__, **change}
        assert dm.choose(dm.MoEProblem(**fields), dev) is not c
        assert len(dm._cache) == n, change
    dm.choose(base, KNOWN_DEVICES["h100_sxm"])
    dm.choose(base, dev, impl="reference")
    assert len(dm._cache) == len(variations) + 3


def test_experts_are_prepared_once_per_backend(monkeypatch):
    _hopper_gate_off(monkeypatch)
    w13, w2 = _experts("mxfp4")
    layer = dispatch.BoundMoE(w13, w2, activation="swigluoai", device=KNOWN_DEVICES["h200"])
    layer.prepare_buckets(TOP_K)  # every bucket on a described H200: the lesson, prepared once
    assert list(layer.backends) == ["triton:mxfp4"]
    p = layer.backends["triton:mxfp4"]
    assert isinstance(p, tmoe.MoEWeights) and p.num_experts == E
    layer.prepare_buckets(TOP_K)
    layer.prepare_buckets(TOP_K + 1)
    assert layer.backends["triton:mxfp4"] is p and len(layer.backends) == 1
    with policy.use_impl("reference"):
        layer.prepare_buckets(TOP_K)
    assert sorted(layer.backends) == ["reference:mxfp4", "triton:mxfp4"]
    assert layer.backends["triton:mxfp4"] is p
    text = layer.report(1, TOP_K)
    assert "triton" in text and "_grouped_gemm_kernel" in text and "written, not yet run on a GPU" in text
    dm.clear_cache()


def test_a_sealed_layer_refuses_a_changed_choice(monkeypatch):
    w13, w2 = _experts("fp8_block")
    x, (ids, wt) = make_input((M, H)), _routing()
    layer = dispatch.BoundMoE(w13, w2, name="model.layers.3.mlp.experts")
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    layer.prepare_buckets(TOP_K)
    layer.seal()
    layer(x, ids, wt)  # what it was prepared for still runs
    monkeypatch.setenv(policy.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match=r"MoE layer model\.layers\.3\.mlp\.experts .*prepared for "
                                           r"\['reference:fp8_block'\].*chooses triton:fp8_block"):
        layer(x, ids, wt)


# ---------------------------------------------------------------------------------------------
# Named errors
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(7)
    w13, w2 = _experts("mxfp8", e=3, h=64, i=32)
    return w13, w2, dispatch.BoundMoE(w13, w2)


@pytest.mark.parametrize("bad, match", [
    (dict(ids=[[0, 3]]), r"topk_ids must lie in \[0, 3\) \(the expert count\), got 3"),
    (dict(ids=[[-1, 0]]), r"got -1 \(-1, expert parallelism's 'not on this rank'"),
    (dict(wt_cols=3), r"top-k mismatch: topk_ids has top_k=2 but topk_weights has 3 columns"),
    (dict(ids_float=True), r"topk_ids must be an integer tensor \[M=1, top_k >= 1\], got float32"),
    (dict(x_h=32), r"x must be \[M, H=64\] \(the experts' hidden size\), got \(1, 32\)"),
    (dict(x_dtype=torch.float64), r"x must be one of \(bfloat16, float16, float32\) here, got float64"),
    (dict(k=4), r"topk_ids has top_k=4 columns but there are only 3 experts"),
])
def test_bad_call_arguments_are_named(tiny, bad, match):
    layer = tiny[2]
    x = torch.randn(1, bad.get("x_h", 64)).to(bad.get("x_dtype", torch.bfloat16)).to(DEVICE)
    k = bad.get("k", 2)
    ids = torch.tensor(bad.get("ids", [list(range(k))]), dtype=torch.float32 if bad.get("ids_float") else torch.int32)
    wt = torch.rand(1, bad.get("wt_cols", k))
    with pytest.raises(ValueError, match=match):
        layer(x, ids.to(DEVICE), wt.to(DEVICE))


def test_bad_weights_biases_and_options_are_named(tiny):
    w13, w2, _ = tiny
    with pytest.raises(ValueError, match="w13 and w2 must have the same expert count, got 3 and 2"):
        dispatch.BoundMoE(w13, w2[:2])
    with pytest.raises(ValueError, match=r"w13's experts must be \[2I, H\] and w2's \[H, I\], got w13 \[64, 64\]"):
        dispatch.BoundMoE(w13, [formats.quantize(torch.randn(64, 64), "mxfp8").to(DEVICE)] * 3)
    with pytest.raises(ValueError, match="w13 must be a non-empty list of weight QuantizedTensors"):
        dispatch.BoundMoE(w13[0], w2)
    with pytest.raises(ValueError, match=r"w2_bias has 2 expert rows but w13/w2 have 3 experts"):
        dispatch.BoundMoE(w13, w2, w2_bias=torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"w13_bias must be \[E=3, 64\] \(W13's rows\)"):
        dispatch.BoundMoE(w13, w2, w13_bias=torch.zeros(3, 32))
    with pytest.raises(ValueError, match=r"w13_act_opts\['scale_rule'\] must hold one value or one per expert \(3\)"):
        dispatch.BoundMoE(w13, w2, w13_act_opts={"scale_rule": torch.zeros(2)})
    with pytest.raises(ValueError, match="w2_act_opts must be empty for the weight-only variant mxfp8_w8a16"):
        dispatch.BoundMoE(w13, w2, variant="mxfp8_w8a16", w2_act_opts={"scale_rule": "floor"})
    with pytest.raises(ValueError, match="variant 'nvfp4_w4a16' needs nvfp4 experts, got mxfp8 ones"):
        dispatch.BoundMoE(w13, w2, variant="nvfp4_w4a16")
    with pytest.raises(ValueError, match="activation must be one of"):
        dispatch.BoundMoE(w13, w2, activation="gelu")
    # the MoE argument is "variant" (a linear's is "format"): the message names the one the caller passed
    with pytest.raises(ValueError, match=r"^variant must be one of \('fp8_tensor', .*got 'mxfp9'$"):
        dispatch.BoundMoE(w13, w2, variant="mxfp9")


# ---------------------------------------------------------------------------------------------
# Reports and layering
# ---------------------------------------------------------------------------------------------
def test_explain_moe_names_the_pick_the_gaps_and_the_route(monkeypatch):
    text = dispatch.explain_moe("mxfp4", 16, 32, 4, 2880, 2880, "h200", activation="swigluoai")
    if dm.hopper_moe_on():  # the sm_90 MoE's gate is on: hopper serves, with its decode and prefill routes
        assert "swigluoai (M bucket 16, asked): auto -> hopper" in text and "_decode_gemm_kernel" in text
        assert "prefill M=4096" in text and "_gemm_kernel" in text
    else:
        assert "MoE mxfp4 decode M=16 E=32 top_k=4 H=2880 I=2880 swigluoai (M bucket 16, asked): auto -> triton" in text
        assert f"    hopper: no: hopper has no MoE kernel for mxfp4: {dm.HOPPER_UNRUN}" in text
        assert "prefill M=4096" in text and "_grouped_gemm_kernel" in text
    forced = dispatch.explain_moe("fp8_tensor", 1, 8, 2, 128, 128, "gb10", impl="cute")
    assert "impl=cute -> error: implementation 'cute' cannot serve" in forced and "no FP8 MoE" in forced
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    assert "B12X_IMPL=reference -> reference: the formats/ oracle" in dispatch.explain_moe("nvfp4", 3, 8, 2, 128, 128,
                                                                                     "cpu")


def test_dispatch_and_the_moe_table_import_no_b12x():
    code = ("import sys, dispatch; from dispatch import moe; moe.entries(); "
            "print(sorted(m for m in sys.modules if m == 'b12x' or m.startswith(('b12x.', 'cutlass'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_only_the_lesson_exposes_its_steps():
    """diff names the first wrong step only where an implementation exposes its steps (the lesson's
    fused_moe_stages); the kernels that keep them on chip (hopper, cute) and the oracle return None, so
    diff stops at the expert. hopper shares the lesson backend's run and prepared experts, not its steps."""
    for cls in (dm.HopperMoE, dm.CuteMoE, dm.ReferenceMoE):
        assert cls("nvfp4").stages(None, None, None, None) is None, cls
    assert dm.TritonMoE.stages is not dm.MoEBackend.stages
