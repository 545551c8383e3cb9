"""The sm_90 MoE (kernels_triton/hopper/moe.py), called directly (not through the gated MoE table),
against the float64 oracle formats.reference_moe on fresh seeded inputs: each served variant
(nvfp4, nvfp4_w4a16, mxfp4, mxfp4_w4a16), the decode route (M <= 16) and the prefill route, silu and
gpt-oss's SwiGLU with expert biases, renormalize on and off, M in {1, 3, 16, 17, 64}, split-K forced,
uneven expert loads (an expert with no token, every token on one expert, a token picking one expert
twice), static per-expert global scales and the MX floor rule, NaN/Inf, the route per M, the named
errors and the table's gate (dispatch.moe.HOPPER_MOE_GPU_RAN). A GPU-only test runs the two
benchmark layers' real shapes (gpt-oss-20b mxfp4_w4a16, Qwen3-30B-A3B nvfp4); it skips elsewhere.

The bound (``_moe_bound``) is the lesson's (tests/_moe_testlib.py ``moe_bound``, the one function both
tests call, stage by stage), applied to these kernels, which differ from the lesson only in the order of fp32 additions (every decoded
product is exact in bf16 and in fp32; split-K adds at most SPLIT_K roundings, inside K 2^-24):

* W13: dh = H 2^-24 |x|.|W13|^T + 6 2^-24 (|h| + |b13|) (the fp32 sum and epilogue), through the
  activation's Lipschitz constants (silu' <= 1.1, SwiGLU's <= 1.25, the clamps 1) plus its own fp32
  evaluation (32 2^-24 |a|); asserted on the kernel's own intermediate (``hmoe._w13``). Weight-only:
  the intermediate is rounded to bf16, + 2^-8 |a|.
* W4A4: where the kernel's intermediate and the oracle's cross a rounding boundary differently, the
  difference is taken exactly: |dq(kernel's) - dq(oracle's)| . |W2|^T (both quantized by formats).
* W2: I 2^-24 |a|.|W2|^T + 6 2^-24 (|o| + |b2|); router weight, renormalize and the top_k sum in fp32:
  (2 top_k + 2) 2^-24 sum_j |w_j o_j|; y rounded once: 2^-p |y| + the smallest subnormal spacing.

Interpreter cost: 46 tests (and the compile-only sm_90 build, ~30 s), ~3 min serially on the shared
2-core machine; the 10 GPU-only layer tests skip there.
"""

from __future__ import annotations

import functools

import pytest
import torch
import triton
from conftest import DEVICE, device_name, make_input

import formats
from _moe_testlib import assert_within as _assert_matches
from _moe_testlib import assert_nonfinite_where_the_oracle, moe_bound, moe_experts
from _moe_testlib import moe_routing as _routing
from kernels_triton import interpreting, moe, record_launches
from kernels_triton._common import device_capability
from kernels_triton.hopper import moe as hmoe
from kernels_triton.hopper._route import TileConfig

VARIANTS = [("mxfp4", True), ("nvfp4", False), ("nvfp4", True), ("mxfp4", False)]
VID = ["mxfp4_w4a16", "nvfp4", "nvfp4_w4a16", "mxfp4"]
ON_SM90 = device_capability(DEVICE) is not None and device_capability(DEVICE)[0] == 9
_experts = functools.partial(moe_experts, on=DEVICE)  # drawn where the test runs (large layers on the GPU)


def _kernel_intermediate(x, p, ids, a16, kw, tiles):
    """The kernels' W13 output, activated, one row per slot, float64 (before any quantization)."""
    M, top_k = ids.shape
    s13, rule = (None, 0) if a16 else hmoe._static_scales(kw.get("w13_act_opts"), p.fmt, p.num_experts, x.device, "o")
    pl = hmoe.plan(M, p.num_experts, top_k, p.hidden, p.intermediate, fmt=p.fmt, a16=a16,
                   capability=device_capability(x.device), sm_count=hmoe.sm_count(x.device) if ON_SM90 else 132,
                   x_dtype=x.dtype, tiles=tiles)
    inter, blocks = hmoe._w13(x, p, ids.to(torch.int32), pl, activation=kw.get("activation", "silu"),
                              bias=kw.get("w13_bias"), static=s13, rule=rule, a16=a16, top_k=top_k,
                              alpha=kw.get("swiglu_alpha", 1.702), limit=kw.get("swiglu_limit", 7.0))
    if blocks is None:  # decode: by slot; weight-only in W2's planes layout (DECODE_A16_PLANES)
        if hmoe._a16_planes(pl, a16):
            inter = inter[:, hmoe.plane_columns(p.intermediate, pl.w2.BLOCK_K, inter.device)]
        return inter.double()
    real = blocks.slot < M * top_k
    out = torch.empty(M * top_k, p.intermediate, dtype=torch.float64, device=x.device)
    out[blocks.slot[real].long()] = inter[real].double()
    return out


def _moe_bound(x, w13, w2, ids, wt, p, *, a16=False, tiles=None, **kw):
    """(the oracle's float64 y, the bound of the module docstring: _moe_testlib.moe_bound on these kernels'
    own intermediate), on x's device; asserts the W13 stage on the way."""
    return moe_bound(x, w13, w2, ids, wt, _kernel_intermediate(x, p, ids, a16, kw, tiles), a16=a16, **kw)


def _run(fmt, a16, M, E, top_k, H, I, *, dtype=torch.bfloat16, ids=None, tiles=None, bias=False, experts=None,
         **kw):
    """One fused_moe call against the oracle within the bound; returns (y, the launched kernels)."""
    w13, w2 = experts or _experts(fmt, E, H, I)
    x = make_input((M, H), dtype, block=32)
    rid, wt = _routing(M, E, top_k)
    ids = rid if ids is None else ids
    if bias:
        kw["w13_bias"] = torch.randn(E, 2 * I, device=DEVICE)
        kw["w2_bias"] = torch.randn(E, H, device=DEVICE).bfloat16()
    p = moe.prepare_experts(w13, w2)
    with record_launches() as log:
        y = hmoe.fused_moe(x, p, ids, wt, a16=a16, tiles=tiles, **kw)
    ref, bound = _moe_bound(x, w13, w2, ids, wt, p, a16=a16, tiles=tiles, **kw)
    _assert_matches(y, ref, bound, f"{fmt} a16={a16} M={M}")
    cap = device_capability(x.device)
    r = hmoe.route(M, E, top_k, H, I, fmt=fmt, a16=a16, capability=cap,
                   sm_count=hmoe.sm_count(x.device) if cap else 132, x_dtype=dtype,
                   w13_act_opts=kw.get("w13_act_opts"), w2_act_opts=kw.get("w2_act_opts"), tiles=tiles)
    assert tuple(log) == r.kernels, (log, r.describe())  # every launch matches its route
    return y, tuple(log)


def _needs_kernels():
    if not (interpreting() or ON_SM90):
        pytest.skip(f"kernels_triton.hopper.moe runs on an sm_90 GPU or under TRITON_INTERPRET=1; found "
                    f"{device_name()} with the interpreter off")


CASES = {
    # decode (M <= 16) and prefill; both activations with and without biases, renormalize on and off
    "M1_silu": dict(M=1, E=4, top_k=2, H=256, I=128),
    "M3_swigluoai_bias_renorm": dict(M=3, E=6, top_k=2, H=256, I=128, activation="swigluoai", bias=True,
                                     renormalize=True),
    "M16_uninterleave_bias": dict(M=16, E=4, top_k=2, H=256, I=128, activation="swigluoai_uninterleave", bias=True),
    "M17_silu_renorm": dict(M=17, E=4, top_k=2, H=256, I=128, renormalize=True),
    "M64_swigluoai_bias": dict(M=64, E=4, top_k=3, H=256, I=128, activation="swigluoai", bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=VID)
def test_matches_the_oracle(fmt, a16, case):
    _needs_kernels()
    c = dict(CASES[case])
    log = _run(fmt, a16, **c)[1]
    assert ("_decode_gemm_kernel" in log) == (c["M"] <= 16)


@pytest.mark.parametrize("fmt,a16", [("mxfp4", True), ("nvfp4", False)], ids=["mxfp4_w4a16", "nvfp4"])
def test_forced_split_k_and_a_k_tail(fmt, a16):
    """Decode tiles with SPLIT_K 3 (W13: _act_kernel sums the partials, adds the bias, activates) and
    2 (W2: _combine_kernel sums them), BLOCK_N smaller than N and K = 384 = 3 steps of 128; then
    K = 320 (a tail of 64 in the last step: the planes' K masks)."""
    _needs_kernels()
    tiles = (TileConfig(16, 32, 128, GROUP_M=1, num_stages=1, SPLIT_K=3), TileConfig(16, 64, 128, GROUP_M=1,
                                                                                      num_stages=1, SPLIT_K=2))
    log = _run(fmt, a16, 5, 4, 2, 384, 256, tiles=tiles, activation="swigluoai", bias=True)[1]
    first = ("act_planes_kernel",) if a16 and hmoe.DECODE_A16_PLANES else ()  # x laid out as planes once
    q = ("_act_quant_kernel",) if not a16 and hmoe.DECODE_A4_PREPASS else ()  # W4A4: each input quantized once
    assert log == first + q + ("_decode_gemm_kernel", "_act_kernel") + q + ("_decode_gemm_kernel", "_combine_kernel")
    _run(fmt, a16, 2, 3, 2, 320, 128, activation="swigluoai", bias=True)


@pytest.mark.parametrize("fmt,a16", [("mxfp4", True), ("nvfp4", False)], ids=["mxfp4_w4a16", "nvfp4"])
@pytest.mark.parametrize("M", [9, 40])
def test_uneven_expert_loads(fmt, a16, M):
    """Expert 3 gets no token and experts 0-2 the rest; every token on expert 2 alone (one expert's
    dynamic global scale from all its rows; 40 rows: several chunks of 16 on the decode kernel's side
    are a prefill here); a token picking one expert twice (decode: 2 M slots of one expert, > 16 rows,
    two chunks of the decode kernel)."""
    _needs_kernels()
    E = 4
    experts = _experts(fmt, E, 256, 128)
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(M)]).to(torch.int32).to(DEVICE)
    _run(fmt, a16, M, E, 2, 256, 128, ids=ids, experts=experts)
    _run(fmt, a16, M, E, 1, 256, 128, ids=torch.full((M, 1), 2, dtype=torch.int32, device=DEVICE), experts=experts)
    if M <= 16:
        log = _run(fmt, a16, M, E, 2, 256, 128, ids=torch.full((M, 2), 1, dtype=torch.int32, device=DEVICE),
                   experts=experts)[1]
        assert "_decode_gemm_kernel" in log


@pytest.mark.parametrize("M", [3, 20])
def test_static_global_scales_and_the_mx_floor_rule(M):
    """nvfp4's static per-expert global scales (no amax kernel on the prefill route; the decode kernel
    reads them) and one for all; mxfp4's floor scale rule, as the oracle reads them."""
    _needs_kernels()
    E = 4
    v = torch.tensor([2688.0 / 8 * (1 + 0.25 * e) for e in range(E)], device=DEVICE)
    log = _run("nvfp4", False, M, E, 2, 256, 128, activation="swigluoai", w13_act_opts={"global_scale": v},
               w2_act_opts={"global_scale": 2688.0 / 8})[1]
    assert "_amax_kernel" not in log
    _run("mxfp4", False, M, E, 2, 256, 128, w13_act_opts={"scale_rule": "floor"}, w2_act_opts={"scale_rule": "floor"})


@pytest.mark.parametrize("M", [1, 16, 20])
def test_fp16_activations(M):
    """fp16 x: W4A4 quantizes it exactly from fp32 on either route; weight-only takes the prefill
    kernel at every M (fp16 tiles as two exact bf16 halves on a GPU)."""
    _needs_kernels()
    log = _run("mxfp4", True, M, 4, 2, 256, 128, dtype=torch.float16, activation="swigluoai")[1]
    assert "_decode_gemm_kernel" not in log
    log = _run("nvfp4", False, M, 4, 2, 256, 128, dtype=torch.float16)[1]
    assert ("_decode_gemm_kernel" in log) == (M <= 16)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("M", [8, 24])
@pytest.mark.parametrize("fmt,a16", [("nvfp4", False), ("mxfp4", True)], ids=["nvfp4", "mxfp4_w4a16"])
def test_nan_and_inf_reach_the_outputs_the_oracle_says(fmt, a16, M):
    """NaN in one token's row and Inf in another's, a NaN router weight, a zero weight sum under
    renormalize, an Inf gate bias: non-finite exactly where the oracle's outputs are (nvfp4's dynamic
    global scale: every token of the expert)."""
    _needs_kernels()
    w13, w2 = _experts(fmt, 8, 128, 128)
    assert_nonfinite_where_the_oracle(hmoe.fused_moe, w13, w2, moe.prepare_experts(w13, w2), a16=a16, M=M)


# ---------------------------------------------------------------------------------------------
# Route and errors (pure)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,a16", VARIANTS, ids=VID)
def test_route_names_the_kernels_per_m(fmt, a16):
    """On a described sm_90 device: nothing at M = 0; the decode kernels at 1 <= M <= 16, with
    split-K (and _act_kernel) where the few experts' N tiles leave SMs idle (gpt-oss at M = 1: 4
    experts); the prefill kernels above (the lesson's quantizer first for W4A4, its amax kernel for
    nvfp4's dynamic global scale)."""
    E, k, H, I = (32, 4, 2880, 2880) if fmt == "mxfp4" else (128, 8, 2048, 768)
    assert hmoe.route(0, E, k, H, I, fmt=fmt, a16=a16, capability=(9, 0)).kernels == ()
    for M in (1, 4, 16):
        r = hmoe.route(M, E, k, H, I, fmt=fmt, a16=a16, capability=(9, 0), sm_count=132)
        first = ("act_planes_kernel",) if a16 and hmoe.DECODE_A16_PLANES else ()
        q = ("_act_quant_kernel",) if not a16 and hmoe.DECODE_A4_PREPASS else ()
        assert r.kernels[:len(first + q) + 1] == first + q + ("_decode_gemm_kernel",), r.describe()
        assert r.kernels[-2 - len(q):] == q + ("_decode_gemm_kernel", "_combine_kernel"), r.describe()
        assert ("_act_kernel" in r.kernels) == ("W13" in r.tile and "splitk" in r.tile.split("/")[0]), r.describe()
        assert r.impl == "hopper" and "decode route" in r.why
    r1 = hmoe.route(1, E, k, H, I, fmt=fmt, a16=a16, capability=(9, 0), sm_count=132)
    assert r1.split_k > 1, r1.describe()  # a handful of experts cannot fill 132 SMs without split-K
    for M in (17, 64, 4096):
        r = hmoe.route(M, E, k, H, I, fmt=fmt, a16=a16, capability=(9, 0), sm_count=132)
        quant = () if a16 else (("_amax_kernel",) if fmt == "nvfp4" else ()) + ("_quantize_kernel",)
        assert r.kernels == quant + ("_gemm_kernel",) + quant + ("_gemm_kernel", "_combine_kernel"), r.describe()
        assert "prefill route" in r.why and r.split_k == 1
    static = {"global_scale": 100.0}
    if fmt == "nvfp4" and not a16:
        assert hmoe.route(64, E, k, H, I, fmt=fmt, capability=(9, 0), w13_act_opts=static).kernels.count(
            "_amax_kernel") == 1
    fp16 = hmoe.route(4, E, k, H, I, fmt=fmt, a16=a16, capability=(9, 0), x_dtype=torch.float16)
    assert ("_decode_gemm_kernel" in fp16.kernels) == (not a16)  # fp16 weight-only: the prefill kernel's hi/lo


@pytest.mark.parametrize("plane_k", [128, 256])
def test_the_planes_layout_is_act_planes_kernels(plane_k, monkeypatch):
    """plane_columns (the decode route's map of an element to its planes column, _plane_col on the
    host) is the layout hopper._fp4_decode.act_planes_kernel writes: x [3, K] laid out by the kernel and
    read back through the map is x; and the weight-only decode route with the planes off (each K step
    reorders its tile in registers) gives the oracle too."""
    _needs_kernels()
    from kernels_triton.hopper import _fp4_decode

    K = 2 * plane_k + 64  # a partial last tile
    x = make_input((3, K), block=32)
    xp = torch.empty((3, triton.cdiv(K, plane_k) * plane_k), dtype=torch.float32 if interpreting() else torch.bfloat16,
                     device=DEVICE)
    _fp4_decode.act_planes_kernel[(triton.cdiv(K, plane_k),)](
        x, x, xp, 3, K, x.stride(0), x.stride(1), 0, xp.stride(0), GROUP=32, SCALE_E4M3=False, A16=True,
        F16_DEQUANTIZE=False, USE_ASM=False, DOT_DTYPE=hmoe._dot_dtype(), EVEN_K=False, BLOCK_M=16, BLOCK_K=plane_k)
    cols = hmoe.plane_columns(K, plane_k, DEVICE)
    assert len(set(cols.tolist())) == K and int(cols.max()) < xp.shape[1]  # one column each
    assert torch.equal(xp[:, cols].to(x.dtype), x)
    monkeypatch.setattr(hmoe, "DECODE_A16_PLANES", False)
    log = _run("mxfp4", True, 3, 4, 2, 256, 128, activation="swigluoai", bias=True)[1]
    assert "act_planes_kernel" not in log


@pytest.mark.parametrize("fmt,opts", [("nvfp4", {}), ("nvfp4", {"global_scale": 2688.0 / 4}),
                                      ("mxfp4", {"scale_rule": "floor"})], ids=["nvfp4", "nvfp4_static", "mxfp4_floor"])
def test_w4a4_decode_quantizes_once_or_per_tile_alike(fmt, opts, monkeypatch):
    """W4A4 decode with each GEMM's activation quantized once by _act_quant_kernel (DECODE_A4_PREPASS)
    and with every program quantizing its tiles in registers: both within the oracle's bound, and the
    same values in the same planes order, so under the interpreter the same bits (on the GPU only
    the bound: with its activation from shared memory the pipeliner may split the dot's K otherwise).
    Tiles with a K tail (H = 320, I = 192: the prepass's padding); expert 1 picked twice by tokens
    0-7 and once by token 8: 17 or more slots, two 16-row chunks in both kernels."""
    _needs_kernels()
    E, top_k, H, I, M = 4, 2, 320, 192, 12
    experts = _experts(fmt, E, H, I)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(M)]).to(torch.int32).to(DEVICE)
    ids[:8] = 1
    ids[8, 0] = 1
    kw = dict(experts=experts, ids=ids, activation="swigluoai", bias=True, w13_act_opts=opts or None,
              w2_act_opts=opts or None)
    seed = int(torch.randint(0, 2 ** 31, ()))  # the same fresh inputs for both calls
    torch.manual_seed(seed)
    y_once, log = _run(fmt, False, M, E, top_k, H, I, **kw)
    assert log.count("_act_quant_kernel") == 2 * hmoe.DECODE_A4_PREPASS
    monkeypatch.setattr(hmoe, "DECODE_A4_PREPASS", not hmoe.DECODE_A4_PREPASS)
    torch.manual_seed(seed)
    y_tiles, log = _run(fmt, False, M, E, top_k, H, I, **kw)
    assert log.count("_act_quant_kernel") == 2 * hmoe.DECODE_A4_PREPASS
    if interpreting():
        assert torch.equal(y_once, y_tiles)


def test_the_planes_padding_is_never_read():
    """W2's decode GEMM on a weight-only intermediate in the planes layout (K = I = 192, BLOCK_K 128:
    the last tile half padding) whose padding holds NaN: the padding reads as 0 (the load's mask maps
    each column back to its element, _plane_elem), the result is the K-order path's, bit for bit."""
    _needs_kernels()
    E, H, I, top_k, M = 3, 128, 192, 2, 4
    w13, w2 = _experts("mxfp4", E, H, I)
    p = moe.prepare_experts(w13, w2)
    ids, _ = _routing(M, E, top_k)
    flat, n = ids.reshape(-1), M * top_k
    inter = make_input((n, I), block=32)
    planes = torch.full((n, 256), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    planes[:, hmoe.plane_columns(I, 128, DEVICE)] = inter
    tile = TileConfig(16, 64, 128, GROUP_M=1, num_stages=1)
    kw = dict(a16=True, gather=False, act=-1, bias=None, static=None, rule=0, top_k=top_k, alpha=1.0, limit=1.0)
    o_planes, o_k = (torch.empty((1, n, H), device=DEVICE) for _ in range(2))
    hmoe._decode_gemm(planes, p.w2, "mxfp4", tile, flat, n, o_planes, a_planes=True, **kw)
    hmoe._decode_gemm(inter, p.w2, "mxfp4", tile, flat, n, o_k, **kw)
    assert bool(torch.isfinite(o_planes).all()) and torch.equal(o_planes, o_k)


def test_route_refuses_what_it_does_not_serve():
    for call, msg in [
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="mxfp8", capability=(9, 0)), "fmt must be one of"),
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="nvfp4", capability=(12, 0)), "an sm_90 one"),
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="nvfp4", capability=(8, 0)), "an sm_90 one"),
        (lambda: hmoe.route(-1, 4, 2, 256, 128, fmt="nvfp4"), "M must be >= 0"),
        (lambda: hmoe.route(1, 4, 2, 256, 120, fmt="mxfp4"), "multiples of 32"),
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="nvfp4", capability=(9, 0), sm_count=0), "sm_count"),
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="nvfp4", x_dtype=torch.float32), "x_dtype"),
        (lambda: hmoe.route(1, 4, 2, 256, 128, fmt="mxfp4", tiles=(TileConfig(16, 64, 64),) * 2), "BLOCK_K"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()


def test_fused_moe_names_bad_arguments():
    _needs_kernels()
    E, H, I, M = 4, 128, 64, 3
    w13, w2 = _experts("mxfp4", E, H, I)
    p = moe.prepare_experts(w13, w2)
    p8 = moe.prepare_experts(*_experts("mxfp8", E, H, I))
    x = make_input((M, H), block=32)
    ids, wt = _routing(M, E, 2)
    for call, msg in [
        (lambda: hmoe.fused_moe(x, (w13, w2), ids, wt), "prepared must be a MoEWeights"),
        (lambda: hmoe.fused_moe(x, p8, ids, wt), "prepared must hold experts of"),
        (lambda: hmoe.fused_moe(x.float(), p, ids, wt), "bfloat16 or float16"),
        (lambda: hmoe.fused_moe(x[None], p, ids, wt), r"x must be 2-D \[M, H\]"),
        (lambda: hmoe.fused_moe(x, p, ids.float(), wt), "topk_ids must be an integer tensor"),
        (lambda: hmoe.fused_moe(x, p, ids, wt[:, :1]), "topk_weights must be a float tensor of topk_ids' shape"),
        (lambda: hmoe.fused_moe(x, p, ids.to("meta"), wt), rf"topk_ids must be .* on {p.device}, got .* on meta"),
        (lambda: hmoe.fused_moe(x, p, ids, wt.to("meta")), rf"topk_weights must be .* on {p.device}, got .* on meta"),
        (lambda: hmoe.fused_moe(x, p, ids + E, wt), r"topk_ids must lie in \[0, 4\)"),
        (lambda: hmoe.fused_moe(x, p, ids, wt, activation="gelu"), "activation must be one of"),
        (lambda: hmoe.fused_moe(x, p, ids, wt, w13_bias=torch.zeros(E, I, device=DEVICE)), "w13_bias must be"),
        (lambda: hmoe.fused_moe(x, p, ids, wt, w2_act_opts={"scale_rule": "round"}), "'ceil' or 'floor'"),
        (lambda: hmoe.fused_moe(x, p, ids, wt, a16=True, w13_act_opts={"scale_rule": "floor"}), "must be empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()
    y = hmoe.fused_moe(x[:0], p, ids[:0], wt[:0])
    assert y.shape == (0, H)


# ---------------------------------------------------------------------------------------------
# The MoE table's gate
# ---------------------------------------------------------------------------------------------
def test_the_table_serves_hopper_only_once_the_gate_is_on(monkeypatch):
    """While dispatch.moe.HOPPER_MOE_GPU_RAN is False (and B12X_HOPPER_MOE_UNVERIFIED unset) make("hopper",
    v) is a named gap, "written, not yet run on a GPU", for the served variants, and says what exists
    for the others; switched on (our own constant, or the variable), a HopperMoE serves the four
    variants, and auto on a described H200 picks it, with this module's route."""
    from dispatch import moe as dm
    from dispatch.contract import UnsupportedEntry
    from dispatch.devices import KNOWN_DEVICES

    monkeypatch.delenv(dm.HOPPER_UNVERIFIED_ENV, raising=False)
    monkeypatch.setattr(dm, "HOPPER_MOE_GPU_RAN", False)
    for v in hmoe.VARIANTS:
        cell = dm.make("hopper", v)
        assert isinstance(cell, UnsupportedEntry) and "written, not yet run on a GPU" in cell.reason
    gap = dm.make("hopper", "mxfp8")
    assert isinstance(gap, UnsupportedEntry) and "serves nvfp4, nvfp4_w4a16, mxfp4, mxfp4_w4a16" in gap.reason
    assert dm.HOPPER_MOE_VARIANTS == hmoe.VARIANTS
    monkeypatch.setenv(dm.HOPPER_UNVERIFIED_ENV, "yes")
    with pytest.raises(ValueError, match="B12X_HOPPER_MOE_UNVERIFIED='yes' is not allowed"):
        dm.make("hopper", "nvfp4")
    monkeypatch.setenv(dm.HOPPER_UNVERIFIED_ENV, "1")
    assert isinstance(dm.make("hopper", "nvfp4"), dm.HopperMoE)
    monkeypatch.delenv(dm.HOPPER_UNVERIFIED_ENV)
    monkeypatch.setattr(dm, "HOPPER_MOE_GPU_RAN", True)
    for v in hmoe.VARIANTS:
        assert isinstance(dm.make("hopper", v), dm.HopperMoE)
    assert isinstance(dm.make("hopper", "fp8_block"), UnsupportedEntry)
    monkeypatch.setattr(dm, "_TABLE", {})
    dm.clear_cache()
    h200 = KNOWN_DEVICES["h200"]
    prob = dm.MoEProblem("mxfp4_w4a16", 32, 4, 2880, 2880, 1, "swigluoai", has_bias=True)
    c = dm.choose(prob, h200)
    assert c.impl == "hopper" and "decode route" in c.reason
    assert c.backend.route(prob, h200) == hmoe.route(1, 32, 4, 2880, 2880, fmt="mxfp4", a16=True, capability=(9, 0),
                                                     sm_count=h200.sm_count)
    ok, why = c.backend.is_supported(KNOWN_DEVICES["gb10"])
    assert not ok and "sm_90" in why
    dm.clear_cache()


# ---------------------------------------------------------------------------------------------
# The benchmark layers' real shapes (sm_90 GPU only)
# ---------------------------------------------------------------------------------------------
LAYERS = {"gpt-oss-20b": ("mxfp4", True, 32, 4, 2880, 2880, "swigluoai", True),
          "qwen3-30b-a3b": ("nvfp4", False, 128, 8, 2048, 768, "silu", False)}


@pytest.mark.skipif(not ON_SM90 or interpreting(), reason=f"the real layer shapes run on an sm_90 GPU only "
                    f"(found {device_name()}); the interpreter would take hours")
@pytest.mark.parametrize("M", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_the_benchmark_layers_on_the_gpu(layer, M):
    """gpt-oss-20b's MoE (mxfp4_w4a16, E 32, top-4, 2880 x 2880, SwiGLU with biases) and Qwen3-30B-A3B's
    (nvfp4 W4A4, E 128, top-8, 2048 x 768, silu), and their weight-only / W4A4 twins, within the bound."""
    fmt, a16, E, k, H, I, act, bias = LAYERS[layer]
    experts = _experts(fmt, E, H, I)
    for a in (a16, not a16):
        _run(fmt, a, M, E, k, H, I, activation=act, bias=bias, experts=experts, renormalize=M == 4)


# ---------------------------------------------------------------------------------------------
# The sm_90 build, without a GPU
# ---------------------------------------------------------------------------------------------
_BUILD = r'''
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_triton.hopper import moe as hm
T = GPUTarget("cuda", 90, 32)
FLOATS = ("alpha", "limit")
def build(fn, types, ce, **opt):
    sig = {}
    for name in fn.arg_names:
        if name in ce:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*u8")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce), target=T, options=opt)
    ptx = k.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"), "pdl": ptx.count("griddepcontrol"), "shared": k.metadata.shared}
rows = {}
for fmt, a16 in ((1, True), (0, False)):  # the two benchmark layers' variants: mxfp4_w4a16, nvfp4
    for gated in (True, False):
        t13, t2 = hm.decode_tiles(1, 32, 4, 2880, 2880, hm.FORMATS[fmt], (9, 0), 132)
        t = t13 if gated else t2
        once = not a16 and hm.DECODE_A4_PREPASS  # W4A4: the GEMM loads _act_quant_kernel's planes by slot
        a = "*bf16" if (a16 or gated or once) else "*fp32"
        types = {"a_ptr": a, "gw_ptr": "*fp32", "static_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32",
                 "out_ptr": "*bf16" if a16 else "*fp32", "ws_ptr": "*fp32"}
        ce = dict(FMT=fmt, A16=a16, STATIC=once, RULE=0, GATHER=gated and not once, GATED=gated, ACT=1,
                  HAS_BIAS=True, ROUND_BF16=a16 and gated, USE_ASM=True, DOT_DTYPE=tl.bfloat16, EVEN_K=False, TOP_K=4,
                  S_PAD=64, SPLIT_K=t.SPLIT_K, BLOCK_N=t.BLOCK_N, BLOCK_M=16, BLOCK_K=t.BLOCK_K, USE_PDL=True,
                  A_PLANES=a16 or once, OUT_PLANE_K=t2.BLOCK_K if a16 and gated else 0)
        rows[f"decode{fmt}{a16}{gated}"] = build(hm._decode_gemm_kernel, types, ce, num_warps=t.num_warps,
                                                 num_stages=t.num_stages, launch_pdl=True)
        if once:
            rows[f"act_quant{fmt}{gated}"] = build(
                hm._act_quant_kernel, {"a_ptr": "*bf16" if gated else "*fp32", "static_ptr": "*fp32",
                                       "ids_ptr": "*i32", "p_ptr": "*bf16", "g_ptr": "*fp32"},
                dict(FMT=fmt, STATIC=False, RULE=0, GATHER=gated, TOP_K=4, S_PAD=64, BLOCK_M=16, BLOCK_K=t.BLOCK_K,
                     USE_PDL=True), num_warps=4, launch_pdl=True)
        t13, t2 = hm.prefill_tiles(4096, 128, 8, 2048, 768, hm.FORMATS[fmt], (9, 0))
        t = t13 if gated else t2
        types = {"a_ptr": "*bf16" if a16 else "*u8", "sa_ptr": "*bf16" if a16 else "*u8", "ta_ptr": "*fp32",
                 "tw_ptr": "*fp32", "bias_ptr": "*fp32", "slot_ptr": "*i32", "expert_ptr": "*i32",
                 "out_ptr": "*bf16" if a16 and gated else "*fp32"}
        ce = dict(FMT=fmt, A16=a16, SPLIT_A16=False, GATHER=a16 and gated, GATED=gated, ACT=1, HAS_BIAS=gated,
                  ROUND_BF16=a16 and gated, DOT_DTYPE=tl.bfloat16, TOP_K=8, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N,
                  BLOCK_K=t.BLOCK_K)
        rows[f"prefill{fmt}{a16}{gated}"] = build(hm._gemm_kernel, types, ce, num_warps=t.num_warps,
                                                  num_stages=t.num_stages)
rows["act"] = build(hm._act_kernel, {"ws_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16"},
                    dict(ACT=1, HAS_BIAS=True, ROUND_BF16=True, SPLIT_K=2, BLOCK_S=16, BLOCK_N=64, USE_PDL=True,
                         OUT_PLANE_K=128),
                    num_warps=4, launch_pdl=True)
rows["combine"] = build(hm._combine_kernel, {"o_ptr": "*fp32", "bias_ptr": "*bf16", "ids_ptr": "*i32",
                                             "topk_w_ptr": "*fp32", "y_ptr": "*bf16"},
                        dict(HAS_BIAS=True, RENORM=True, ROUND_BF16=False, SPLIT_K=4, TOP_K=4, K_PAD=4, BLOCK_H=256,
                             USE_PDL=True), num_warps=4, launch_pdl=True)
json.dump(rows, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_sm90_build_of_the_moe_kernels(tmp_path):
    """Compile-only (no GPU): the decode and prefill GEMMs of the two benchmark layers' variants, at
    their routes' tiles, issue wgmma; every kernel of the decode chain waits and signals with
    griddepcontrol (PDL)."""
    import json

    from _sm90_build import run_sm90_build

    out = tmp_path / "build.json"
    run_sm90_build(["-c", _BUILD, out], tmp_path, timeout=900)
    rows = json.loads(out.read_text())
    for name, r in rows.items():
        if name.startswith(("decode", "prefill")):
            assert r["wgmma"] > 0, f"{name}: no wgmma ({r})"
        if name.startswith(("decode", "act", "combine")):
            assert r["pdl"] > 0, f"{name}: no griddepcontrol ({r})"
    assert ("act_quant0True" in rows) == hmoe.DECODE_A4_PREPASS, sorted(rows)  # the shipped W4A4 decode chain
