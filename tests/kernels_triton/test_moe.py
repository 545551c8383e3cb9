"""The Triton MoE lesson (kernels_triton/moe.py) against the float64 oracle formats.reference_moe, on
fresh seeded inputs: every variant, each activation, biases, renormalize, decode / a few tokens /
prefill-sized M, an expert with no tokens, all tokens on one expert, per-expert static scales (and
fp8_channel's per-token dynamic ones), the
native kernel where the interpreter runs dot_scaled, NaN/Inf, the grouping itself, the route and the
named errors.

The bound (``_moe_bound``: tests/_moe_testlib.py ``moe_bound``, shared with the sm_90 MoE's tests, on the
lesson's own intermediate) follows the lesson's roundings, stage by stage, for each (token, expert):

* W13: the kernel's fp32 h differs from the oracle's float64 h by its fp32 sum and epilogue,
  dh = H 2^-24 |x|.|W13|^T + 6 2^-24 (|h| + |b13|) (formats/bounds.py's terms, before any output
  rounding); the activation moves that by at most its Lipschitz constants (silu' <= 1.1; gpt-oss's
  g sigmoid(alpha g) has slope in [-0.23, 1.23] for any alpha; the clamps are 1-Lipschitz) plus its
  own fp32 evaluation (exp, one division, three products: 32 2^-24 |a| covers GPU's approximate exp):
      da = L_g (|up| + du + c) dg + (|act_g| + L_g dg) du + 32 2^-24 |a|      (c = 1 for SwiGLU's +1)
  This is asserted on the kernel's own intermediate (``moe._w13``).
* The intermediate: quantized by the kernel from its fp32 value, by the oracle from float64. Where
  the two round differently (a value within da of a code boundary, or a block scale / per-tensor value
  that moved), the difference is taken exactly: the test quantizes the kernel's intermediate with
  formats.quantize and adds |dq(kernel's) - dq(oracle's)| . |W2|^T. Weight-only: rounded to bf16
  (<= 2^-8 |a|) where the oracle keeps float64, and da enters directly.
* W2: I 2^-24 |a|.|W2|^T + 6 2^-24 (|o| + |b2|); the router weight (renormalized in fp32: top_k + 1
  roundings), its product and the top_k sum in fp32: (2 top_k + 2) 2^-24 sum_j |w_j o_j|.
* y is rounded once to bf16/fp16: half a spacing, 2^-p |y|, plus the smallest subnormal spacing.

Interpreter cost: 56 tests, 25-30 s serially on the shared 2-core machine when it is quiet (a fused_moe
call is 0.1-0.5 s; the slowest test 2.7 s), 70-100 s under other agents' load.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, make_input
from hypothesis import given
from hypothesis import strategies as st

import formats
from _moe_testlib import assert_within as _assert_matches
from _moe_testlib import assert_nonfinite_where_the_oracle, moe_bound
from _moe_testlib import moe_experts as _experts
from _moe_testlib import moe_routing as _routing
import kernels_triton
from formats import QuantizedTensor
from kernels_triton import _common, moe, record_launches

VARIANTS = [(f, False) for f in moe.FORMATS] + [(f, True) for f in moe.A16_FORMATS]
VID = [f + ("_a16" if a else "") for f, a in VARIANTS]


def _kernel_intermediate(x, w13, w2, ids, *, a16=False, activation="silu", w13_bias=None, w13_act_opts=None,
                         w2_act_opts=None, swiglu_alpha=1.702, swiglu_limit=7.0, path=None, tile=None):
    """The lesson's W13 output, activated, one row per slot (token * top_k + j), float64 on the CPU
    (before any quantization): ``moe._w13`` on the route ``fused_moe`` takes."""
    fmt, E, (H, I) = w13[0].fmt, len(w13), w2[0].shape
    M, top_k = ids.shape
    p = moe.prepare_experts(w13, w2)
    _, path, tile = moe._plan(M, E, top_k, H, I, fmt, a16, _common.device_capability(x.device), path, tile,
                              w13_act_opts, w2_act_opts)
    blocks, _, inter = moe._w13(x, p, ids, path, tile, a16=a16, act_opts=w13_act_opts, activation=activation,
                             bias=w13_bias, alpha=swiglu_alpha, limit=swiglu_limit)
    real = blocks.slot < M * top_k
    a_kernel = torch.empty(M * top_k, I, dtype=torch.float64)
    a_kernel[blocks.slot[real].long().cpu()] = inter[real].double().cpu()
    return a_kernel


def _moe_bound(y, x, w13, w2, ids, wt, *, path=None, tile=None, **kw):
    """(the oracle's float64 y, the bound of the module docstring: _moe_testlib.moe_bound on the lesson's
    own intermediate), on the CPU; asserts the W13 stage on the way. ``kw``: fused_moe's arguments."""
    keep = ("a16", "activation", "w13_bias", "w13_act_opts", "w2_act_opts", "swiglu_alpha", "swiglu_limit")
    a_kernel = _kernel_intermediate(x, w13, w2, ids, path=path, tile=tile, **{k: v for k, v in kw.items() if k in keep})
    return moe_bound(x, w13, w2, ids, wt, a_kernel, **kw)


def _run(fmt, a16, M, E, top_k, H, I, *, dtype=torch.bfloat16, ids=None, **kw):
    w13, w2 = _experts(fmt, E, H, I)
    x = make_input((M, H), dtype, block=32)
    rid, wt = _routing(M, E, top_k)
    ids = rid if ids is None else ids
    with record_launches() as log:
        y = moe.fused_moe(x, moe.prepare_experts(w13, w2), ids, wt, a16=a16, **kw)
    ref, bound = _moe_bound(y, x, w13, w2, ids, wt, a16=a16, **kw)
    _assert_matches(y, ref, bound, f"{fmt} a16={a16}")
    return y, ref, tuple(log)


CASES = {
    # M = 1: decode; a few tokens with every option; prefill-sized M over several blocks per expert
    "decode_silu": dict(M=1, E=4, top_k=2, H=256, I=128),
    "few_swigluoai_bias_renorm": dict(M=5, E=6, top_k=2, H=256, I=128, activation="swigluoai", renormalize=True,
                                      bias=True),
    "prefill_uninterleave_fp16": dict(M=40, E=4, top_k=3, H=384, I=128, activation="swigluoai_uninterleave",
                                      dtype=torch.float16, bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=VID)
def test_matches_the_oracle(fmt, a16, case):
    c = dict(CASES[case])
    bias = c.pop("bias", False)
    if bias:
        c["w13_bias"] = torch.randn(c["E"], 2 * c["I"], device=DEVICE)
        c["w2_bias"] = torch.randn(c["E"], c["H"], device=DEVICE).bfloat16()
    _run(fmt, a16, **c)


@pytest.mark.parametrize("fmt,opts", [
    ("fp8_tensor", "per_expert"), ("fp8_tensor", "one"), ("nvfp4", "per_expert"), ("nvfp4", "one"),
    ("fp8_channel", "per_expert"), ("fp8_channel", "one"),
    ("fp8_block", {"ue8m0": True}), ("mxfp8", {"scale_rule": "floor"}), ("mxfp4", {"scale_rule": "floor"})])
def test_activation_options_and_per_expert_static_scales(fmt, opts):
    """Static per-tensor values, one per expert ([E]: a checkpoint's w13_input_scale / input global
    scale) or one for all, and the block formats' options, as the oracle reads them; a static value
    drops the amax kernel from the route."""
    E, H, I = 4, 256, 128
    if isinstance(opts, str):
        key = moe.ACT_OPTION[fmt]
        # calibrated-looking values: the scale of amax 8 (h, a of order 1-10), per expert a little apart
        base = 2688.0 / 8 if fmt == "nvfp4" else 8.0 / 448
        v = torch.tensor([base * (1 + 0.25 * e) for e in range(E)], device=DEVICE)
        o13, o2 = ({key: v}, {key: v.flip(0)}) if opts == "per_expert" else ({key: base}, {key: v[:1]})
    else:
        o13 = o2 = opts
    log = _run(fmt, False, 6, E, 2, H, I, w13_act_opts=o13, w2_act_opts=o2, activation="swigluoai")[2]
    assert log == moe.route(6, E, 2, H, I, fmt=fmt, w13_act_opts=o13, w2_act_opts=o2).kernels
    assert "_amax_kernel" not in log


@pytest.mark.parametrize("fmt,a16", [("fp8_tensor", False), ("nvfp4", False), ("mxfp4", False), ("nvfp4", True)],
                         ids=["fp8_tensor", "nvfp4", "mxfp4", "nvfp4_a16"])
def test_an_expert_without_tokens_and_all_tokens_on_one_expert(fmt, a16):
    """Expert 3 gets no row (its scales are never read) and experts 0-2 the rest; then every token on
    expert 2 alone: 40 rows over three blocks, whose dynamic per-tensor value is one amax reduced over
    the three blocks' partials."""
    M, E = 9, 4
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(M)]).to(torch.int32).to(DEVICE)
    _run(fmt, a16, M, E, 2, 256, 128, ids=ids)
    tile = _common.TileConfig(16, 64, 128, num_stages=1)  # 16-row blocks; fits an sm_90's shared memory
    _run(fmt, a16, 40, E, 1, 256, 128, ids=torch.full((40, 1), 2, dtype=torch.int32, device=DEVICE),
                  tile=tile)
    assert moe.align_block_size(torch.full((40, 1), 2), E, 16).first_block.tolist() == [0, 0, 0, 3, 3]


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_block", "mxfp8", "mxfp4", "fp8_channel"])
def test_the_native_kernel(fmt):
    """path="native": the codes and scales through tl.dot_scaled, as on SM12x; the interpreter decodes
    E8M0 scales right (not nvfp4's e4m3 ones: refused there, see test_errors_name_the_argument)."""
    log = _run(fmt, False, 5, 4, 2, 256, 128, path="native", activation="swigluoai_uninterleave",
               w13_bias=torch.randn(4, 256, device=DEVICE))[2]
    assert log.count("_grouped_gemm_kernel") == 2
    assert moe.route(5, 4, 2, 256, 128, fmt=fmt, path="native").why.endswith("path='native' forced")


# ---------------------------------------------------------------------------------------------
# The grouping
# ---------------------------------------------------------------------------------------------
@given(st.integers(0, 40), st.integers(1, 9), st.integers(1, 4), st.sampled_from([1, 2, 4, 16]), st.integers(0, 2**31))
def test_align_block_size_groups_every_slot_once_by_expert(M, E, top_k, block_m, seed):
    """Each slot appears once; each block holds one expert's slots in token order, padded at its end;
    each expert has ceil(count / block_m) blocks in expert order; the rest of the grid is unused."""
    top_k = min(top_k, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :top_k]
    b = moe.align_block_size(ids, E, block_m)
    n = M * top_k
    assert b.n_slots == n and b.slot.numel() == b.expert.numel() * block_m
    assert b.expert.numel() == -(-n // block_m) + min(n, E)
    real = b.slot[b.slot < n].long()
    assert sorted(real.tolist()) == list(range(n))
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert b.first_block.tolist() == [0] + torch.cumsum(-(-counts // block_m), 0).tolist()
    for blk, e in enumerate(b.expert.tolist()):
        rows = b.slot[blk * block_m:(blk + 1) * block_m].long()
        if e < 0:
            assert blk >= b.first_block[-1] and bool((rows == n).all())
            continue
        assert b.first_block[e] <= blk < b.first_block[e + 1]
        mine = rows[rows < n]
        assert bool((ids.reshape(-1)[mine] == e).all()) and bool((mine.diff() > 0).all())
        assert bool((rows[len(mine):] == n).all())  # padding only at the end of a block


# ---------------------------------------------------------------------------------------------
# Non-finite values: never made finite
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("fmt,a16", [("fp8_tensor", False), ("nvfp4", False), ("mxfp4", False), ("fp8_block", False),
                                     ("mxfp8", True), ("fp8_channel", False)],
                         ids=["fp8_tensor", "nvfp4", "mxfp4", "fp8_block", "mxfp8_a16", "fp8_channel"])
def test_nan_and_inf_reach_the_outputs_the_oracle_says(fmt, a16):
    """NaN in one token's row and Inf in another's, a NaN router weight, a zero weight sum under
    renormalize, and (SwiGLU) an Inf gate bias: the outputs they reach are non-finite exactly where
    the oracle's are (with a dynamic per-tensor scale: every token of the expert; per-token
    (fp8_channel): that token's rows only)."""
    w13, w2 = _experts(fmt, 8, 128 if fmt != "fp8_block" else 256, 128)
    assert_nonfinite_where_the_oracle(moe.fused_moe, w13, w2, moe.prepare_experts(w13, w2), a16=a16)


# ---------------------------------------------------------------------------------------------
# Route, tiles, empty input
# ---------------------------------------------------------------------------------------------
def test_route_names_what_runs_and_why():
    """The route lists the kernels fused_moe launches (amax kernels only for dynamic per-tensor
    values, none before a weight-only GEMM), its tile and its reasons; on a described SM12x device the
    GEMMs are native, weight-only ones portable; M = 0 launches nothing and returns [0, H]."""
    r = moe.route(3, 8, 2, 256, 128, fmt="nvfp4")
    assert r.kernels == ("_amax_kernel", "_quantize_kernel", "_grouped_gemm_kernel") * 2
    assert "blocks of 16" in r.why and "a grid of 7 blocks" in r.why and "interpreter" in r.why
    assert moe.route(3, 8, 2, 256, 128, fmt="mxfp4", a16=True).kernels == ("_grouped_gemm_kernel",) * 2
    assert "native" in moe.route(3, 8, 2, 256, 128, fmt="mxfp4", capability=(12, 0)).why
    assert "tf32" in moe.route(3, 8, 2, 256, 128, fmt="mxfp4", a16=True, capability=(12, 0)).why
    assert moe.route(512, 8, 2, 256, 128, fmt="mxfp8").tile.startswith("64x")  # 128 rows per expert
    w13, w2 = _experts("mxfp4", 4, 128, 64)
    with record_launches() as log:
        y = moe.fused_moe(torch.zeros(0, 128, dtype=torch.bfloat16, device=DEVICE), moe.prepare_experts(w13, w2),
                          torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), torch.zeros(0, 2, device=DEVICE))
    assert y.shape == (0, 128) and log == [] and moe.route(0, 4, 2, 128, 64, fmt="mxfp4").kernels == ()


def test_a_given_tile_is_launched_and_unchecked_is_the_same_call():
    """tile= (BLOCK_M 16, BLOCK_N 32, BLOCK_K 64: several N tiles and K steps) is the route's tile and
    gives the oracle within the bound; fused_moe_unchecked computes the same bits."""
    tile = _common.TileConfig(16, 32, 64)
    assert moe.route(7, 4, 2, 128, 64, fmt="mxfp4", tile=tile).tile == str(tile)
    _run("mxfp4", False, 7, 4, 2, 128, 64, tile=tile, activation="swigluoai")
    w13, w2 = _experts("nvfp4", 4, 128, 64)
    p, x = moe.prepare_experts(w13, w2), make_input((7, 128), block=32)
    ids, wt = _routing(7, 4, 2)
    y = moe.fused_moe(x, p, ids, wt, tile=tile)
    assert torch.equal(y, moe.fused_moe_unchecked(x, p, ids, wt, tile=tile))
    assert torch.equal(y, kernels_triton.fused_moe(x, p, ids, wt, tile=tile))  # the package's export


def test_the_lesson_imports_only_the_format_lessons_public_tile_helpers():
    """moe.py composes the format lessons through their public tile helpers (and the lessons' shared
    _codecs / _common), never a lesson's private kernels, kernels_triton.tuning or hopper."""
    used = set()
    for node in ast.walk(ast.parse(Path(moe.__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in ("_codecs", "_common"):
            assert node.module in moe.FORMATS, node.module
            assert all(a.name in (f"{node.module}_quantize_tile", f"{node.module}_dequantize_tile")
                       for a in node.names), [a.name for a in node.names]
            used.add(node.module)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.startswith("kernels_triton") or "hopper" in n or "tuning" in n for n in names), names
    assert used == set(moe.FORMATS)


# ---------------------------------------------------------------------------------------------
# Named errors
# ---------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    E, H, I, M = 4, 128, 64, 3
    w13, w2 = _experts("mxfp4", E, H, I)
    p = moe.prepare_experts(w13, w2)
    x = make_input((M, H), block=32)
    ids, wt = _routing(M, E, 2)
    q8 = _experts("mxfp8", 1, H, I)[0][0]
    p8c = moe.prepare_experts(*_experts("fp8_channel", E, H, I))
    for call, msg in [
        (lambda: moe.prepare_experts(w13[0], w2), "w13 must be a non-empty sequence"),
        (lambda: moe.prepare_experts([], w2), "w13 must be a non-empty sequence"),
        (lambda: moe.prepare_experts(w13[:-1] + [q8], w2), r"every expert of w13 must have w13\[0\]'s format"),
        (lambda: moe.prepare_experts(w13, w2[:-1]), r"w13 must be E experts \[2I, H\]"),
        (lambda: moe.prepare_experts(w13, [formats.quantize(torch.randn(H, 2 * I), "mxfp4")] * E),
         r"4 x mxfp4 \[128, 128\]"),
        (lambda: moe.prepare_experts([QuantizedTensor("mxfp4", "weight", w13[0].data, w13[0].scale.float(), None,
                                                      w13[0].block_shape, w13[0].shape)] * E, w2), r"w13\[0\]"),
        (lambda: moe.fused_moe(x, (w13, w2), ids, wt), "prepared must be a MoEWeights"),
        (lambda: moe.fused_moe(x.float(), p, ids, wt), "bfloat16 or float16"),
        (lambda: moe.fused_moe(x[:, :64], p, ids, wt), "must equal the weight's K=128"),
        (lambda: moe.fused_moe(x[None], p, ids, wt), r"x must be 2-D \[M, H\]"),
        (lambda: moe.fused_moe(x, p, ids.float(), wt), "topk_ids must be an integer tensor"),
        (lambda: moe.fused_moe(x, p, ids[:2], wt[:2]), "topk_ids must be an integer tensor"),
        (lambda: moe.fused_moe(x, p, ids, wt[:, :1]), "topk_weights must be a float tensor of topk_ids' shape"),
        (lambda: moe.fused_moe(x, p, ids, wt.int()), "topk_weights must be a float tensor"),
        # routing on another device than the experts' (the meta device stands for one on any machine)
        (lambda: moe.fused_moe(x, p, ids.to("meta"), wt),
         rf"topk_ids must be an integer tensor \[M=3, top_k >= 1\] on {p.device}, got torch.int32 \(3, 2\) on meta"),
        (lambda: moe.fused_moe(x, p, ids, wt.to("meta")), rf"topk_weights must be .* on {p.device}, got .* on meta"),
        (lambda: moe.fused_moe(x, p, ids + E, wt), r"topk_ids must lie in \[0, 4\)"),
        (lambda: moe.fused_moe(x, p, ids - E, wt), r"topk_ids must lie in \[0, 4\)"),
        (lambda: moe.fused_moe(x, p, ids, wt, activation="gelu"), "activation must be one of"),
        (lambda: moe.fused_moe(x, p, ids, wt, w13_bias=torch.zeros(E, I, device=DEVICE)),
         r"w13_bias must be .*\(4, 128\)"),
        (lambda: moe.fused_moe(x, p, ids, wt, w2_bias=torch.zeros(E, H, dtype=torch.int32, device=DEVICE)), "w2_bias"),
        (lambda: moe.fused_moe(x, p, ids, wt, w13_act_opts={"scale": 1.0}), "w13_act_opts takes only 'scale_rule'"),
        (lambda: moe.fused_moe(x, p, ids, wt, w2_act_opts={"scale_rule": "round"}), r"\('ceil' or 'floor'\) for mxfp4"),
        (lambda: moe.fused_moe(x, p, ids, wt, path="fast"), "path must be None or one of"),
        (lambda: moe.route(M, E, 2, H, I, fmt="fp8_tensor", a16=True), r"with a16=True\), got 'fp8_tensor'"),
        (lambda: moe.route(M, E, 2, H, I, fmt="fp8_channel", a16=True), r"with a16=True\), got 'fp8_channel'"),
        (lambda: moe.route(M, E, 2, H, I, fmt="int4"), "fmt must be one of"),
        (lambda: moe.fused_moe(x, p8c, ids, wt, w2_act_opts={"scale": -1.0}), "one positive number"),
        (lambda: moe.route(-1, E, 2, H, I, fmt="mxfp4"), "M must be >= 0"),
        (lambda: moe.route(M, E, 2, 256, 128, fmt="fp8_block", tile=_common.TileConfig(16, 64, 64)), "BLOCK_K == 128"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()
    w13n, w2n = _experts("nvfp4", E, H, I)
    pn = moe.prepare_experts(w13n, w2n)
    for opts, msg in [({"global_scale": -1.0}, "one positive number"), ({"global_scale": "1"}, "one positive number"),
                      ({"global_scale": torch.ones(3)}, "one per expert")]:
        with pytest.raises(ValueError, match=msg):
            moe.fused_moe(x, pn, ids, wt, w13_act_opts=opts)
    if _common.device_capability(x.device) is None:  # the interpreter's dot_scaled reads e4m3 scales as E8M0
        with pytest.raises(ValueError, match="decodes e4m3 scales as E8M0"):
            moe.fused_moe(x, pn, ids, wt, path="native")
