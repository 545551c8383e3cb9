"""The MoE oracle (formats.moe.reference_moe): hand-worked layers, an independent per-token loop for
every variant family and activation, transformers' own expert modules, the per-expert scope of the
activation scales, the non-finite rule and every named error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import formats as F
from formats.moe import experts_from_stacked, moe_activation, reference_moe

U64 = 2.0**-53  # float64 unit roundoff


def _sparse(rows: int, k: int, entries: dict) -> torch.Tensor:
    """A [rows, k] float32 matrix of zeros with the given {(row, col): value} entries."""
    w = torch.zeros(rows, k)
    for (r, c), v in entries.items():
        w[r, c] = v
    return w


# ---------------------------------------------------------------------------------------------
# Hand-worked layers: 2 tokens, hidden 32 and intermediate 32 (mxfp8's block; only the first units
# are non-zero), every weight a small power-of-two multiple that e4m3 holds exactly, so that the
# weights dequantize exactly and every number below is worked out by hand.
# ---------------------------------------------------------------------------------------------
H = I = 32
X_HAND = _sparse(2, H, {(0, 0): 1.0, (0, 1): 2.0, (1, 0): -1.0, (1, 1): 0.5}).to(torch.bfloat16)


def _silu_layer():
    """Three experts. W13 rows [0, I) are the gate, [I, 2I) the up projection (vLLM's order)."""
    g_u_w2 = [  # (gate row 0 over x[0:2], up row 0 over x[0:2], W2 column 0 over y[0:2])
        ((1.0, 0.0), (0.0, 1.0), (1.0, -1.0)),  # e0: gate = x0, up = x1
        ((0.0, 1.0), (1.0, 1.0), (2.0, 0.5)),  # e1: gate = x1, up = x0 + x1
        ((-1.0, 0.0), (0.5, 0.0), (0.0, 4.0)),  # e2: gate = -x0, up = x0 / 2
    ]
    w13, w2 = [], []
    for g, u, d in g_u_w2:
        w13.append(F.quantize(_sparse(2 * I, H, {(0, 0): g[0], (0, 1): g[1], (I, 0): u[0], (I, 1): u[1]}), "mxfp8"))
        w2.append(F.quantize(_sparse(H, I, {(0, 0): d[0], (1, 0): d[1]}), "mxfp8"))
    ids = torch.tensor([[0, 1], [2, 0]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    return w13, w2, ids, weights


def test_hand_silu_weight_only():
    """a = silu(gate) * up, silu(g) = g / (1 + e^-g): silu(1) = 0.7310585786300049,
    silu(2) = 1.7615941559557646, silu(-1) = -0.2689414213699951.
    token 0 = (1, 2): e0 a = silu(1) * 2 = 1.4621171572600098,  o = (a, -a)
                      e1 a = silu(2) * 3 = 5.284782467867294,   o = (2a, a/2)
                      y = 0.75 o_e0 + 0.25 o_e1 = (3.7389791018786545, -0.43599005946159564)
    token 1 = (-1, 0.5): e2 a = silu(1) * -0.5 = -0.36552928931500245, o = (0, 4a)
                         e0 a = silu(-1) * 0.5 = -0.13447071068499755, o = (a, -a)
                         y = 0.5 o_e2 + 0.5 o_e0 = (-0.06723535534249878, -0.6638232232875061)"""
    w13, w2, ids, weights = _silu_layer()
    y = reference_moe(X_HAND, w13, w2, ids, weights, a16=True, out_dtype=torch.float64)
    want = torch.zeros(2, H, dtype=torch.float64)
    want[0, :2] = torch.tensor([3.7389791018786545, -0.43599005946159564], dtype=torch.float64)
    want[1, :2] = torch.tensor([-0.06723535534249878, -0.6638232232875061], dtype=torch.float64)
    # a few float64 roundings (2^-53 each) and torch's silu within a few ulps: 1e-14 relative
    torch.testing.assert_close(y, want, rtol=1e-14, atol=0)


def test_hand_silu_w8a8_quantizes_the_intermediate_again():
    """The same layer with mxfp8 activations. x's rows are exact in e4m3 (scales 2^-7 and 2^-8).
    Each intermediate a is quantized before W2: its block's scale is 2^ceil(log2(|a| / 448)) and
    a / scale rounds to e4m3 (steps of 32 between 256 and 512):
      1.4621171572600098:  scale 2^-8,  374.30 -> 384, a -> 1.5
      5.284782467867294:   scale 2^-6,  338.23 -> 352, a -> 5.5
      -0.36552928931500245: scale 2^-10, -374.30 -> -384, a -> -0.375
      -0.13447071068499755: scale 2^-11, -275.40 -> -288, a -> -0.140625
    y0 = 0.75 (1.5, -1.5) + 0.25 (11, 2.75) = (3.875, -0.4375)
    y1 = 0.5 (0, -1.5) + 0.5 (-0.140625, 0.140625) = (-0.0703125, -0.6796875): all exact in bf16."""
    w13, w2, ids, weights = _silu_layer()
    y = reference_moe(X_HAND, w13, w2, ids, weights)
    assert y.dtype == torch.bfloat16
    want = torch.zeros(2, H)
    want[0, :2] = torch.tensor([3.875, -0.4375])
    want[1, :2] = torch.tensor([-0.0703125, -0.6796875])
    assert torch.equal(y.float(), want)


def test_hand_swigluoai_with_biases_and_renormalize():
    """gpt-oss's activation, gate/up interleaved in W13 (row 0 gate, row 1 up), alpha 1.702, limit 7:
    a = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7).
    e0: gate = x0 + 0.5 (bias), up = x1;   o = (a, 0) + b2 (0, 0.25)
    e1: gate = 2 x0, up = -4 x1;           o = (0, a) + b2 (0.5, 0)
    token 0 = (1, 2), router weights (3, 2) renormalized to (0.6, 0.4):
      e0 gate 1.5, up 2:       a = 3 * 1.5 * sigmoid(2.553) = 3 * 1.5 * 0.9277747989647177 = 4.174986595341229
      e1 gate 2, up -8 -> -7:  a = -6 * 2 * sigmoid(3.404) = -12 * 0.9678293115721042 = -11.61395173886525
      y = 0.6 (4.174986595341229, 0.25) + 0.4 (0.5, -11.61395173886525) = (2.704991957204738, -4.4955806955461)
    token 1 = (4, -4), router weights (3, 1) renormalized to (0.75, 0.25):
      e1 gate 8 -> 7, up 16 -> 7: a = 8 * 7 * sigmoid(11.914) = 56 * 0.9999933040433311 = 55.99962502642654
      e0 gate 4.5, up -4:         a = -3 * 4.5 * sigmoid(7.659) = -13.5 * 0.9995284435164857 = -13.493633987472558
      y = 0.75 (0.5, 55.99962502642654) + 0.25 (-13.493633987472558, 0.25) = (-2.9984084968681395, 42.06221876981991)"""
    x = _sparse(2, H, {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 4.0, (1, 1): -4.0}).to(torch.bfloat16)
    w13 = [F.quantize(_sparse(2 * I, H, {(0, 0): 1.0, (1, 1): 1.0}), "mxfp8"),
           F.quantize(_sparse(2 * I, H, {(0, 0): 2.0, (1, 1): -4.0}), "mxfp8")]
    w2 = [F.quantize(_sparse(H, I, {(0, 0): 1.0}), "mxfp8"), F.quantize(_sparse(H, I, {(1, 0): 1.0}), "mxfp8")]
    b13 = torch.zeros(2, 2 * I)
    b13[0, 0] = 0.5
    b2 = torch.zeros(2, H)
    b2[0, 1], b2[1, 0] = 0.25, 0.5
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    weights = torch.tensor([[3.0, 2.0], [3.0, 1.0]])
    y = reference_moe(x, w13, w2, ids, weights, activation="swigluoai", renormalize=True, w13_bias=b13,
                      w2_bias=b2, a16=True, out_dtype=torch.float64)
    want = torch.zeros(2, H, dtype=torch.float64)
    want[0, :2] = torch.tensor([2.704991957204738, -4.4955806955461], dtype=torch.float64)
    want[1, :2] = torch.tensor([-2.9984084968681395, 42.06221876981991], dtype=torch.float64)
    torch.testing.assert_close(y, want, rtol=1e-14, atol=0)  # as above: float64 roundings, torch's sigmoid


# ---------------------------------------------------------------------------------------------
# Every variant family and activation against a per-token loop written plainly here.
# ---------------------------------------------------------------------------------------------
E, M, TOPK = 4, 6, 2
# (name, fmt, a16, w13 activation options, w2 activation options) with E per-expert static scales
VARIANTS = [
    ("fp8_tensor", "fp8_tensor", False, None, None),
    ("fp8_tensor_static", "fp8_tensor", False, {"scale": "per_expert"}, {"scale": 0.05}),
    ("fp8_block", "fp8_block", False, None, None),
    ("mxfp8", "mxfp8", False, None, None),
    ("nvfp4", "nvfp4", False, {"global_scale": "per_expert"}, {"global_scale": "per_expert"}),
    ("nvfp4_dynamic", "nvfp4", False, None, None),
    ("mxfp4", "mxfp4", False, None, None),
    ("nvfp4_w4a16", "nvfp4", True, None, None),
    ("mxfp4_w4a16", "mxfp4", True, None, None),
]


def _layer(fmt: str, h: int, i: int, n_experts: int = E, *, bias: bool = False):
    w13 = [F.quantize(torch.randn(2 * i, h) * 0.1, fmt) for _ in range(n_experts)]
    w2 = [F.quantize(torch.randn(h, i) * 0.1, fmt) for _ in range(n_experts)]
    b13 = torch.randn(n_experts, 2 * i) * 0.1 if bias else None
    b2 = torch.randn(n_experts, h) * 0.1 if bias else None
    return w13, w2, b13, b2


def _router(m: int, n_experts: int = E, top_k: int = TOPK):
    """Distinct experts per token (as a top-k gives) and positive weights."""
    ids = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(m)])
    return ids, torch.rand(m, top_k) + 0.05


def _opts(spec, key_fmt):
    """Resolve "per_expert" into E static scales (one per expert: as vLLM loads them)."""
    if spec is None:
        return None
    out = {}
    for k, v in spec.items():
        if v == "per_expert":
            v = torch.rand(E) * 0.05 + 0.01 if k == "scale" else torch.rand(E) * 200 + 100
        out[k] = v
    return out


def _loop(x, w13, w2, ids, weights, *, activation, renormalize, b13, b2, a16, o13, o2, alpha=1.702, limit=7.0):
    """The layer one token and one chosen expert at a time, in float64, with element-wise products
    and sums (no matmul). An expert's activation scale covers the tokens routed to it
    (reference_moe's rule), so a token's quantized rows are taken from its expert's group."""
    m, h = x.shape

    def per_expert(opts, e):
        return {k: (v[e] if isinstance(v, torch.Tensor) and v.numel() > 1 else v) for k, v in (opts or {}).items()}

    def act(hh):
        if activation == "swigluoai":
            gate, up = hh[0::2], hh[1::2]
        else:
            gate, up = hh[:hh.shape[0] // 2], hh[hh.shape[0] // 2:]
        if activation == "silu":
            return gate / (1 + torch.exp(-gate)) * up
        g = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
        return (torch.clamp(up, -limit, limit) + 1) * g / (1 + torch.exp(-alpha * g))

    def intermediate(e, group, t):
        """silu/swigluoai(x[t] . W13[e]^T + b13[e]) for token t among expert e's tokens ``group``."""
        if a16:
            xin = x[t].double()
        else:
            xq = F.quantize(x[group], w13[e].fmt, role="activation", **per_expert(o13, e))
            xin = F.dequantize(xq, torch.float64)[group.index(t)]
        hh = (F.dequantize(w13[e], torch.float64) * xin).sum(dim=1)
        if b13 is not None:
            hh = hh + b13[e].double()
        return act(hh)

    y = torch.zeros(m, h, dtype=torch.float64)
    magnitude = torch.zeros(m, h, dtype=torch.float64)  # sum over slots of |weight * output|
    for t in range(m):
        wt = weights[t].double()
        if renormalize:
            wt = wt / wt.sum()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            group = [tt for tt in range(m) if e in ids[tt].tolist()]
            a = intermediate(e, group, t)
            if not a16:  # quantized again, as one tensor with the other tokens of expert e
                inter = torch.stack([intermediate(e, group, tt) for tt in group]).float()
                aq = F.quantize(inter, w2[e].fmt, role="activation", **per_expert(o2, e))
                a = F.dequantize(aq, torch.float64)[group.index(t)]
            o = (F.dequantize(w2[e], torch.float64) * a).sum(dim=1)
            if b2 is not None:
                o = o + b2[e].double()
            y[t] += wt[j] * o
            magnitude[t] += (wt[j] * o).abs()
    return y, magnitude


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("name,fmt,a16,o13,o2", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_matches_per_token_loop(name, fmt, a16, o13, o2, activation):
    h, i = (128, 128) if fmt == "fp8_block" else (64, 32)
    bias = activation == "swigluoai"  # gpt-oss's experts have biases; Qwen3's have none
    w13, w2, b13, b2 = _layer(fmt, h, i, bias=bias)
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    o13, o2 = _opts(o13, fmt), _opts(o2, fmt)
    renormalize = activation == "silu"
    y = reference_moe(x, w13, w2, ids, weights, activation=activation, renormalize=renormalize, w13_bias=b13,
                      w2_bias=b2, a16=a16, w13_act_opts=o13, w2_act_opts=o2, out_dtype=torch.float64)
    want, magnitude = _loop(x, w13, w2, ids, weights, activation=activation, renormalize=renormalize, b13=b13,
                            b2=b2, a16=a16, o13=o13, o2=o2)
    # Both are float64 throughout, in other summation orders: every dot product of n <= 256 terms
    # differs by at most 2 n 2^-53 of its sum of |terms| (Higham's gamma_n), the activation is
    # Lipschitz with a factor of at most ~(1.1 |up| + |gate|), so the W13 differences reach the output
    # at the same relative order; the quantized intermediate is cast to float32 first, so a float64
    # last-bit difference can at most move it one float32 ulp (2^-24 relative) where it does not
    # change a code. 2^-20 of the sum of |weight * expert output| covers all of this with room,
    # and a wrong expert, gate/up order, scale or weight moves the output by O(1) of it.
    assert torch.all((y - want).abs() <= 2.0**-20 * magnitude + 1e-300), (y - want).abs().max()
    assert torch.isfinite(y).all()
    # one rounding at the end: the bf16 output is the float64 one rounded once
    yb = reference_moe(x, w13, w2, ids, weights, activation=activation, renormalize=renormalize, w13_bias=b13,
                       w2_bias=b2, a16=a16, w13_act_opts=o13, w2_act_opts=o2)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


def test_uninterleave_is_swigluoai_over_gate_rows_first():
    """swigluoai_uninterleave reads gate = rows [0, I), up = rows [I, 2I): the same layer as swigluoai
    with W13's rows (and bias) interleaved, bit for bit (mxfp8 rows are quantized independently)."""
    h, i = 64, 32
    w_gate_up = [torch.randn(2 * i, h) for _ in range(E)]
    perm = torch.stack([torch.arange(i), torch.arange(i) + i], dim=1).reshape(-1)  # g0, u0, g1, u1, ...
    b13 = torch.randn(E, 2 * i)
    w2 = [F.quantize(torch.randn(h, i), "mxfp8") for _ in range(E)]
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    packed = reference_moe(x, [F.quantize(w, "mxfp8") for w in w_gate_up], w2, ids, weights,
                           activation="swigluoai_uninterleave", w13_bias=b13)
    inter = reference_moe(x, [F.quantize(w[perm], "mxfp8") for w in w_gate_up], w2, ids, weights,
                          activation="swigluoai", w13_bias=b13[:, perm])
    assert torch.equal(packed, inter)
    silu = reference_moe(x, [F.quantize(w, "mxfp8") for w in w_gate_up], w2, ids, weights, activation="silu")
    assert not torch.equal(packed, silu)


# ---------------------------------------------------------------------------------------------
# transformers' own expert modules (weight-only, float64): an implementation we did not write.
# ---------------------------------------------------------------------------------------------
def test_weight_only_matches_transformers_qwen3_moe_experts():
    transformers = pytest.importorskip("transformers", reason="transformers' Qwen3MoeExperts is the reference here")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    h, i = 64, 32
    w13, w2, _, _ = _layer("nvfp4", h, i)
    cfg = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=E, hidden_act="silu")
    experts = Qwen3MoeExperts(cfg).double()
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([F.dequantize(w, torch.float64) for w in w13]))
        experts.down_proj.copy_(torch.stack([F.dequantize(w, torch.float64) for w in w2]))
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    want = experts(x.double(), ids, weights.double())
    y = reference_moe(x, w13, w2, ids, weights, a16=True, out_dtype=torch.float64)
    # float64 both, other summation orders: a few n 2^-53 of the magnitudes (n <= 64), 1e-12 relative
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


def test_weight_only_matches_transformers_gpt_oss_experts():
    transformers = pytest.importorskip("transformers", reason="transformers' GptOssExperts is the reference here")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    h, i = 64, 32
    w13, w2, b13, b2 = _layer("mxfp4", h, i, bias=True)
    # large enough that the clamps at +-7 are reached
    w13 = [F.quantize(torch.randn(2 * i, h) * 2, "mxfp4") for _ in range(E)]
    cfg = transformers.GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=E, swiglu_limit=7.0)
    experts = GptOssExperts(cfg).double()
    with torch.no_grad():  # gpt-oss stores [E, H, 2I] and [E, I, H]: our [N, K] weights transposed
        experts.gate_up_proj.copy_(torch.stack([F.dequantize(w, torch.float64).T for w in w13]))
        experts.gate_up_proj_bias.copy_(b13.double())
        experts.down_proj.copy_(torch.stack([F.dequantize(w, torch.float64).T for w in w2]))
        experts.down_proj_bias.copy_(b2.double())
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    want = experts(x.double(), ids, weights.double())
    y = reference_moe(x, w13, w2, ids, weights, activation="swigluoai", w13_bias=b13, w2_bias=b2, a16=True,
                      out_dtype=torch.float64)
    assert (F.dequantize(w13[0]).abs().max() > 7)  # the clamp is exercised
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)  # as above


# ---------------------------------------------------------------------------------------------
# Scales per expert: the dynamic scale covers the expert's tokens; static scales may be per expert.
# ---------------------------------------------------------------------------------------------
def test_dynamic_per_tensor_scale_covers_the_experts_own_tokens():
    h, i = 64, 32
    w13, w2, _, _ = _layer("fp8_tensor", h, i)
    x = torch.randn(3, h).to(torch.bfloat16)
    ids = torch.tensor([[0], [0], [1]])
    weights = torch.ones(3, 1)
    y = reference_moe(x, w13, w2, ids, weights)
    louder = x.clone()
    louder[2] *= 64  # token 2 goes to expert 1 alone: expert 0's scale does not see it
    y2 = reference_moe(louder, w13, w2, ids, weights)
    assert torch.equal(y[:2], y2[:2])
    louder = x.clone()
    louder[1] *= 64  # token 1 shares expert 0 with token 0: token 0's scale grows, its output moves
    y3 = reference_moe(louder, w13, w2, ids, weights)
    assert not torch.equal(y[0], y3[0])
    # expert 0 over its two tokens is formats.reference_linear twice, with the activation between
    h0 = F.reference_linear(x[:2], w13[0], out_dtype=torch.float64)
    dense = F.reference_linear(moe_activation(h0).float(), w2[0], out_dtype=torch.float64)
    assert torch.equal(reference_moe(x, w13, w2, ids, weights, out_dtype=torch.float64)[:2], dense)


def test_static_scales_per_expert_reach_only_their_expert():
    h, i = 64, 32
    w13, w2, _, _ = _layer("nvfp4", h, i)
    x = torch.randn(4, h).to(torch.bfloat16)
    ids = torch.tensor([[0], [1], [2], [3]])
    weights = torch.ones(4, 1)
    g = torch.full((E,), 300.0)
    y = reference_moe(x, w13, w2, ids, weights, w13_act_opts={"global_scale": g})
    g2 = g.clone()
    g2[2] = 37.0
    y2 = reference_moe(x, w13, w2, ids, weights, w13_act_opts={"global_scale": g2})
    changed = (y != y2).any(dim=1).tolist()
    assert changed == [False, False, True, False]
    # one scalar is every expert's
    y3 = reference_moe(x, w13, w2, ids, weights, w13_act_opts={"global_scale": 300.0})
    assert torch.equal(y, y3)


@given(perm_seed=st.integers(0, 2**31 - 1), shift=st.integers(-20, 20))
def test_slot_order_and_weight_scale_do_not_matter(perm_seed, shift):
    """Permuting a token's top-k slots changes only the float64 summation order; scaling the router
    weights by 2^shift changes nothing after renormalization (both scalings are exact)."""
    g = torch.Generator().manual_seed(perm_seed)
    h, i = 32, 32
    w13 = [F.quantize(torch.randn(2 * i, h, generator=g), "mxfp8") for _ in range(E)]
    w2 = [F.quantize(torch.randn(h, i, generator=g), "mxfp8") for _ in range(E)]
    x = torch.randn(3, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(3)])
    weights = torch.rand(3, 3, generator=g) + 0.1
    y = reference_moe(x, w13, w2, ids, weights, renormalize=True, out_dtype=torch.float64)
    p = torch.randperm(3, generator=g)
    yp = reference_moe(x, w13, w2, ids[:, p], weights[:, p], renormalize=True, out_dtype=torch.float64)
    # Each expert's output o_j is computed the same way in both; only the renormalizing sum of the
    # three weights is added in another order (at most 2 * 2^-53 relative apart, Higham), so each
    # normalized weight (<= 1) moves by at most ~4 2^-53 relative and y by 8 2^-53 sum_j |o_j|.
    ones = torch.ones(3, 1)
    mag = sum(reference_moe(x, w13, w2, ids[:, j:j + 1], ones, out_dtype=torch.float64).abs() for j in range(3))
    assert torch.all((y - yp).abs() <= 8 * U64 * mag)
    ys = reference_moe(x, w13, w2, ids, weights * 2.0**shift, renormalize=True, out_dtype=torch.float64)
    assert torch.equal(y, ys)


# ---------------------------------------------------------------------------------------------
# vLLM's stacked layout
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_experts_from_stacked_is_the_same_layer(fmt):
    h, i = (128, 128) if fmt == "fp8_block" else (64, 32)
    w13, w2, _, _ = _layer(fmt, h, i)

    def stacked(ws):
        data = torch.stack([w.data for w in ws])
        scale = torch.stack([w.scale for w in ws])
        g = torch.stack([w.global_scale for w in ws]) if ws[0].global_scale is not None else None
        return data, scale, g

    s13 = experts_from_stacked(fmt, *stacked(w13), name="w13")
    s2 = experts_from_stacked(fmt, *stacked(w2), name="w2")
    assert [q.shape for q in s13] == [(2 * i, h)] * E and [q.shape for q in s2] == [(h, i)] * E
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    assert torch.equal(reference_moe(x, s13, s2, ids, weights), reference_moe(x, w13, w2, ids, weights))


def test_experts_from_stacked_errors():
    data = torch.zeros(4, 64, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"w13 scale must hold one per-tensor scale per expert \(\[4\] or \[4, 1\]\)"):
        experts_from_stacked("fp8_tensor", data, torch.ones(4, 2))  # vLLM's unmerged gate/up scales
    with pytest.raises(ValueError, match="first dimension is the expert count 4"):
        experts_from_stacked("fp8_tensor", data, torch.ones(3))
    with pytest.raises(ValueError, match=r"w13 data must be a 3-D tensor"):
        experts_from_stacked("fp8_tensor", data[0], torch.ones(4))
    with pytest.raises(ValueError, match="fmt must be one of"):
        experts_from_stacked("int4", data, torch.ones(4))
    with pytest.raises(ValueError, match=r"w2\[0\]\.scale must have shape \(64, 2\)"):
        experts_from_stacked("mxfp4", torch.zeros(4, 64, 32, dtype=torch.uint8),
                             torch.zeros(4, 64, 4, dtype=torch.uint8), name="w2")
    with pytest.raises(ValueError, match=r"global_scale must hold one value per expert \(4\)"):
        experts_from_stacked("nvfp4", torch.zeros(4, 64, 32, dtype=torch.uint8),
                             torch.zeros(4, 64, 4, dtype=torch.float8_e4m3fn), torch.ones(2))


# ---------------------------------------------------------------------------------------------
# Non-finite values never become finite
# ---------------------------------------------------------------------------------------------
def _small(fmt="mxfp8"):
    h, i = 64, 32
    w13, w2, _, _ = _layer(fmt, h, i)
    x = torch.randn(3, h).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [0, 2], [3, 2]])
    return x, w13, w2, ids, torch.full((3, 2), 0.5)


@pytest.mark.parametrize("v", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_x_poisons_its_token_with_block_scales(v):
    x, w13, w2, ids, weights = _small("mxfp8")
    x[1, 5] = v
    y = reference_moe(x, w13, w2, ids, weights)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()


def test_nonfinite_x_poisons_the_experts_tokens_with_a_dynamic_tensor_scale():
    x, w13, w2, ids, weights = _small("fp8_tensor")
    x[1, 5] = float("inf")
    y = reference_moe(x, w13, w2, ids, weights)
    # token 1 -> experts 0, 2: expert 0 also serves token 0, expert 2 token 2: all three NaN
    assert y.isnan().all(dim=1).tolist() == [True, True, True]
    x, w13, w2, ids, weights = _small("fp8_tensor")
    ids = torch.tensor([[0, 1], [0, 1], [2, 3]])
    x[1, 5] = float("nan")
    y = reference_moe(x, w13, w2, ids, weights)
    assert y.isnan().all(dim=1).tolist() == [True, True, False]


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_inf_stays_nonfinite_through_the_clamps(activation):
    """Weight-only, W13 all positive: an Inf in x gives +Inf gate and up, which gpt-oss's clamps
    would turn into the limit 7; the oracle gives NaN instead (silu keeps the Inf)."""
    h, i = 32, 32
    w13 = [F.quantize(torch.rand(2 * i, h) + 0.5, "mxfp4") for _ in range(2)]
    w2 = [F.quantize(torch.rand(h, i) + 0.5, "mxfp4") for _ in range(2)]
    x = torch.rand(2, h).to(torch.bfloat16)
    x[0, 3] = float("inf")
    y = reference_moe(x, w13, w2, torch.tensor([[0], [1]]), torch.ones(2, 1), activation=activation, a16=True)
    assert not torch.isfinite(y[0]).any() and torch.isfinite(y[1]).all()
    a = moe_activation(torch.tensor([[float("inf"), 1.0], [1.0, float("-inf")]], dtype=torch.float64), "swigluoai")
    assert a.isnan().all()


def test_nan_router_weight_and_zero_sum_renormalization_give_nan():
    x, w13, w2, ids, weights = _small()
    weights[2, 1] = float("nan")
    y = reference_moe(x, w13, w2, ids, weights)
    assert y[2].isnan().all() and torch.isfinite(y[:2]).all()
    weights = torch.full((3, 2), 0.5)
    weights[0] = 0.0
    y = reference_moe(x, w13, w2, ids, weights, renormalize=True)
    assert y[0].isnan().all() and torch.isfinite(y[1:]).all()


def test_nan_weight_code_reaches_its_experts_tokens():
    x, w13, w2, ids, weights = _small()
    bad = w13[2].data.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F  # the e4m3 NaN code
    w13 = list(w13)
    w13[2] = dataclasses.replace(w13[2], data=bad)
    y = reference_moe(x, w13, w2, ids, weights, a16=True)
    assert y.isnan().any(dim=1).tolist() == [False, True, True]  # expert 2 serves tokens 1 and 2


# ---------------------------------------------------------------------------------------------
# Named errors
# ---------------------------------------------------------------------------------------------
def _ok():
    h, i = 64, 32
    w13, w2, _, _ = _layer("mxfp8", h, i)
    x = torch.randn(M, h).to(torch.bfloat16)
    ids, weights = _router(M)
    return dict(x=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)


def _call(**change):
    kw = _ok()
    kw.update(change)
    return reference_moe(kw.pop("x"), kw.pop("w13"), kw.pop("w2"), kw.pop("topk_ids"), kw.pop("topk_weights"), **kw)


def test_the_valid_call_passes():
    assert _call().shape == (M, 64)


@pytest.mark.parametrize("bad,match", [
    (E, r"topk_ids must lie in \[0, 4\) \(the expert count\), got 4"),
    (-1, r"topk_ids must lie in \[0, 4\) \(the expert count\), got -1"),
])
def test_topk_ids_out_of_range(bad, match):
    ids, w = _router(M)
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=match):
        _call(topk_ids=ids, topk_weights=w)


def test_topk_shape_mismatches():
    ids, w = _router(M)
    with pytest.raises(ValueError, match=r"topk_weights must have topk_ids' shape \(6, 2\), got \(6, 3\)"):
        _call(topk_ids=ids, topk_weights=torch.rand(M, 3))
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[M=6, top_k >= 1\], got \(5, 2\)"):
        _call(topk_ids=ids[:5], topk_weights=w[:5])
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[M=6, top_k >= 1\], got \(12,\)"):
        _call(topk_ids=ids.reshape(-1), topk_weights=w.reshape(-1))
    with pytest.raises(ValueError, match="topk_ids must be an integer tensor"):
        _call(topk_ids=ids.float())
    with pytest.raises(ValueError, match="topk_weights must be a float32/bfloat16/float16 tensor"):
        _call(topk_weights=w.double())


def test_weights_of_the_wrong_shape():
    h, i = 64, 32
    w13, w2, _, _ = _layer("mxfp8", h, i)
    with pytest.raises(ValueError, match=r"w13 must have 2 \* I = 64 rows \(gate and up\) for w2's I=32"):
        _call(w13=[F.quantize(torch.randn(i, h), "mxfp8") for _ in range(E)])
    with pytest.raises(ValueError, match=r"w13's K \(hidden\) must equal x.shape\[1\]=64"):
        _call(w13=[F.quantize(torch.randn(2 * i, 2 * h), "mxfp8") for _ in range(E)])
    with pytest.raises(ValueError, match=r"w2's rows \(hidden\) must equal x.shape\[1\]=64"):
        _call(w2=[F.quantize(torch.randn(h + 32, i), "mxfp8") for _ in range(E)])
    with pytest.raises(ValueError, match=r"every expert of w2 must have one shape: w2\[0\] is \(64, 32\), w2\[3\] is \(64, 64\)"):
        _call(w2=w2[:3] + [F.quantize(torch.randn(h, 2 * i), "mxfp8")])
    with pytest.raises(ValueError, match=r"w2\[1\]\.scale must have shape"):  # a malformed expert
        broken = dataclasses.replace(w2[1], scale=w2[1].scale[:32])
        _call(w2=[w2[0], broken, w2[2], w2[3]])
    with pytest.raises(ValueError, match="x must be a 2-D"):
        _call(x=torch.randn(2, M, h).to(torch.bfloat16))


def test_expert_counts_and_formats_must_agree():
    h, i = 64, 32
    w13, w2, _, _ = _layer("mxfp8", h, i)
    with pytest.raises(ValueError, match="w13 and w2 must have the same expert count, got 4 and 3"):
        _call(w13=w13, w2=w2[:3])
    with pytest.raises(ValueError, match="w13 and w2 must have one format, got mxfp8 and mxfp4"):
        _call(w2=[F.quantize(torch.randn(h, i), "mxfp4") for _ in range(E)])
    with pytest.raises(ValueError, match=r"every expert of w13 must have one format: w13\[0\] is mxfp8, w13\[1\] is mxfp4"):
        _call(w13=[w13[0], F.quantize(torch.randn(2 * i, h), "mxfp4"), w13[2], w13[3]])
    with pytest.raises(ValueError, match="w13 must be a non-empty sequence of weight QuantizedTensors"):
        _call(w13=[])
    with pytest.raises(ValueError, match="experts_from_stacked"):
        _call(w13=w13[0])


def test_bias_activation_options_and_out_dtype_errors():
    with pytest.raises(ValueError, match=r"w13_bias must be a tensor of shape \(4, 64\)"):
        _call(w13_bias=torch.zeros(64))
    with pytest.raises(ValueError, match=r"w2_bias must be a tensor of shape \(4, 64\)"):
        _call(w2_bias=torch.zeros(3, 64))
    with pytest.raises(ValueError, match="activation must be one of"):
        _call(activation="gelu")
    with pytest.raises(ValueError, match=r"w13_act_opts\['global_scale'\] must be one value or one per expert \(4\)"):
        h, i = 64, 32
        w13, w2, _, _ = _layer("nvfp4", h, i)
        _call(w13=w13, w2=w2, w13_act_opts={"global_scale": torch.ones(3)})
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        _call(out_dtype=torch.int32)
