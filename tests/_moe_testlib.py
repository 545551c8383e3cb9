"""Inputs and the element-wise bound shared by the MoE tests (the lesson's tests/kernels_triton/test_moe.py,
the sm_90 MoE's tests/kernels_triton/hopper/test_hopper_moe.py, the MoE table's
tests/dispatch/test_moe_dispatch.py);
it sits in tests/, which pytest puts on sys.path for tests/conftest.py. Values are seeded by conftest's
per-test seed."""

from __future__ import annotations

import math
from typing import Optional

import torch

import formats
from conftest import DEVICE, make_input


def moe_experts(fmt: str, E: int, H: int, I: int, *, scale: float = 1.0, on: Optional[str] = None):
    """E experts of W13 [2I, H] and W2 [H, I] quantized to ``fmt`` (formats.quantize), entries of order
    ``scale`` / sqrt(K) so that W13's output and W2's are of order ``scale`` for x of order 1; drawn on
    the CPU and moved to the test device, or drawn on ``on`` (a large GPU layer)."""
    def q(rows, K):
        w = torch.randn(rows, K, device=on or "cpu") * (scale / math.sqrt(K))
        return formats.quantize(w, fmt) if on else formats.quantize(w, fmt).to(DEVICE)
    return [q(2 * I, H) for _ in range(E)], [q(H, I) for _ in range(E)]


def moe_routing(M: int, E: int, top_k: int):
    """topk_ids int32 [M, top_k] (top_k distinct experts per token) and positive router weights
    float32 [M, top_k] in [0.05, 1.05), on the test device."""
    ids = torch.rand(M, E).argsort(dim=1)[:, :top_k].to(torch.int32)
    return ids.to(DEVICE), (torch.rand(M, top_k) + 0.05).to(DEVICE)


def expert_opts(opts, e: int) -> dict:
    """Expert e's activation options: a tensor value with one element per expert is indexed, others kept."""
    return {k: (v.reshape(-1)[e] if isinstance(v, torch.Tensor) and v.numel() > 1 else v)
            for k, v in (opts or {}).items()}


U = 2.0 ** -24


def moe_bound(x, w13, w2, ids, wt, a_kernel, *, a16=False, activation="silu", renormalize=False, w13_bias=None,
              w2_bias=None, w13_act_opts=None, w2_act_opts=None, swiglu_alpha=1.702, swiglu_limit=7.0):
    """(the oracle's float64 y [M, H], its element-wise bound [M, H]) for a fused MoE kernel whose
    W13 stage produced ``a_kernel`` (float64 [M * top_k, I], one row per slot token * top_k + j: W13's
    output, activated, before any quantization); both on a_kernel's device, where the bound is computed.
    The arguments are fused_moe's (x bf16/fp16 [M, H], w13 / w2 the E experts as QuantizedTensors,
    ids [M, top_k], wt [M, top_k]). Asserts the W13 stage on the way (a_kernel within da of the
    oracle's intermediate). The derivation, stage by stage (the lesson's roundings, which the sm_90
    kernels share up to the order of fp32 additions):

    * W13: the kernel's fp32 h differs from the oracle's float64 h by its fp32 sum and epilogue,
      dh = H 2^-24 |x|.|W13|^T + 6 2^-24 (|h| + |b13|) (formats/bounds.py's terms, before any output
      rounding); the activation moves that by at most its Lipschitz constants (silu' <= 1.1; gpt-oss's
      g sigmoid(alpha g) has slope in [-0.23, 1.23] for any alpha; the clamps are 1-Lipschitz) plus its
      own fp32 evaluation (exp, one division, three products: 32 2^-24 |a| covers a GPU's approximate exp):
          da = L_g (|up| + du + c) dg + (|act_g| + L_g dg) du + 32 2^-24 |a|      (c = 1 for SwiGLU's +1)
      Weight-only: the kernel's intermediate is rounded to bf16 as well, + 2^-8 (|a| + da).
    * The intermediate: quantized by the kernel from its fp32 value, by the oracle from float64. Where
      the two round differently (a value within da of a code boundary, a block scale or per-tensor value
      that moved), the difference is taken exactly: |dq(kernel's) - dq(oracle's)| . |W2|^T, both
      quantized by formats.quantize. Weight-only: da enters directly.
    * W2: I 2^-24 |a|.|W2|^T + 6 2^-24 (|o| + |b2|); the router weight (renormalized in fp32: top_k + 1
      roundings), its product and the top_k sum in fp32: (2 top_k + 2) 2^-24 sum_j |w_j o_j|.
    * y is rounded once to bf16/fp16: half a spacing, 2^-p |y|, plus the smallest subnormal spacing."""
    fmt, E, (H, I) = w13[0].fmt, len(w13), w2[0].shape
    M, top_k = ids.shape
    dev = a_kernel.device
    alpha, limit = swiglu_alpha, swiglu_limit
    kw = dict(activation=activation, renormalize=renormalize, w13_bias=w13_bias, w2_bias=w2_bias, a16=a16,
              w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts, swiglu_alpha=alpha, swiglu_limit=limit)
    ref = formats.reference_moe(x, w13, w2, ids, wt, out_dtype=torch.float64, **kw).to(dev)
    w = wt.double().to(dev)
    w = w / w.sum(dim=-1, keepdim=True) if renormalize else w
    ids_d = ids.to(dev)
    bound = torch.zeros(M, H, dtype=torch.float64, device=dev)
    lip = 1.25 if activation != "silu" else 1.1
    for e in range(E):
        tokens, js = torch.nonzero(ids_d == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        xe = x[tokens.to(x.device)]
        X = (xe.double() if a16 else formats.dequantize(formats.quantize(
            xe, fmt, role="activation", **expert_opts(w13_act_opts, e)), torch.float64)).to(dev)
        W13, W2 = (formats.dequantize(q, torch.float64).to(dev) for q in (w13[e], w2[e]))
        b13 = torch.zeros(2 * I, dtype=torch.float64, device=dev) if w13_bias is None else w13_bias[e].double().to(dev)
        b2 = torch.zeros(H, dtype=torch.float64, device=dev) if w2_bias is None else w2_bias[e].double().to(dev)
        h = X @ W13.T + b13
        dh = H * U * (X.abs() @ W13.abs().T) + 6 * U * (h.abs() + b13.abs())
        sel = (slice(0, None, 2), slice(1, None, 2)) if activation == "swigluoai" else (slice(0, I), slice(I, None))
        g, up, dg, du = h[:, sel[0]], h[:, sel[1]], dh[:, sel[0]], dh[:, sel[1]]
        a = formats.moe_activation(h, activation, swiglu_alpha=alpha, swiglu_limit=limit)
        act_g = torch.nn.functional.silu(g) if activation == "silu" else g.clamp(max=limit) * torch.sigmoid(
            alpha * g.clamp(max=limit))
        c = 0.0 if activation == "silu" else 1.0
        da = lip * (up.abs() + du + c) * dg + (act_g.abs() + lip * dg) * du + 32 * U * a.abs() + 1e-30
        if a16:  # the kernel's intermediate is rounded to bf16: half a spacing, 2^-8 |a|
            da = da + 2.0 ** -8 * (a.abs() + da)
        ak = a_kernel[tokens * top_k + js]
        assert bool(((ak - a).abs() <= da).all()), \
            f"W13 stage of expert {e}: |a - ref| - bound max {((ak - a).abs() - da).max().item():.3e}"
        if a16:
            A, dA = a, da
        else:
            def dq(v):
                return formats.dequantize(formats.quantize(v.float(), fmt, role="activation",
                                                           **expert_opts(w2_act_opts, e)), torch.float64)
            A = dq(a)
            dA = (dq(ak) - A).abs()  # the rounding boundaries the two sides took differently, exactly
        o = A @ W2.T + b2
        do = dA @ W2.abs().T + I * U * ((A.abs() + dA) @ W2.abs().T) + 6 * U * (o.abs() + b2.abs())
        we = w[tokens, js].abs().unsqueeze(1)
        bound.index_add_(0, tokens, we * (do + (2 * top_k + 2) * U * (o.abs() + do)))
    p_out = {torch.bfloat16: 8, torch.float16: 11}[x.dtype]
    tiny = torch.finfo(x.dtype).smallest_normal * 2.0 ** (1 - p_out)
    return ref, bound + 2.0 ** -p_out * (ref.abs() + bound) + tiny


def assert_within(y, ref, bound, what=""):
    """y (bf16/fp16 [M, H]) finite and within ``bound`` of the oracle's ``ref`` element by element
    (on ref's device), naming the worst element otherwise."""
    assert y.dtype in (torch.bfloat16, torch.float16) and y.shape == ref.shape
    y = y.double().to(ref.device)
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output"
    assert ref.abs().max() > 0
    err = (y - ref).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: |y - ref| = {err.view(-1)[worst]:.3e} > bound "
                                        f"{bound.view(-1)[worst]:.3e} at flat index {worst}")


def assert_diff_routes_as_the_model(rows, gates, xs, *, E, top_k, H, I, renormalize):
    """``b12x-dual diff``'s MoE rows (its --json "layers" of kind moe) read as MoE layers (E, top_k, H, I,
    renormalize) and routed as the model's own transformers routers ``gates`` (one per row, returning
    (logits, top-k weights, top-k ids)) route their captured inputs ``xs`` ({layer: x}, --save-inputs):
    the same ids, and weights that renormalize to the router's to 2^-22 relative (float32 sums in
    another order); every implementation within its bound."""
    assert len(rows) == len(gates)
    for r, gate in zip(rows, gates):
        assert (r["kind"], r["E"], r["top_k"], r["H"], r["I"]) == ("moe", E, top_k, H, I)
        assert r["routing"]["renormalize"] is renormalize
        with torch.no_grad():
            _, scores, idx = gate(xs[r["layer"]].float())
        assert r["routing"]["topk_ids"] == idx.tolist()
        w = torch.tensor(r["routing"]["topk_weights"])
        torch.testing.assert_close(w / w.sum(dim=1, keepdim=True) if renormalize else w, scores,
                                   rtol=2.0 ** -22, atol=0)
        assert {"reference", "triton"} <= set(r["results"])
        for res in r["results"].values():
            assert res["ok"] and res["moe"]["worst"] <= 1 and res["first"] is None


def diff_moe_folder(run, folder, model, layers: str, linear: str, tmp_path, *, E, top_k, H, I):
    """``b12x-dual diff`` (``run(*argv) -> (rc, out, err)``) of a transformers MoE folder built from
    ``model`` (--tokens 5), --layers ``layers`` selecting the linear ``linear`` of layer 0 and
    the MoE blocks of layers 0 and 1: exit 0, the rows in forward order, both MoE layers nvfp4 and routed
    as the model's own routers with renormalize (assert_diff_routes_as_the_model). Returns (out, the
    --json data)."""
    import json

    from safetensors.torch import load_file

    from dispatch.apps.diff import EXIT_OK

    rc, out, _ = run(folder, "--layers", layers, "--tokens", "5", "--json", tmp_path / "d.json",
                     "--save-inputs", tmp_path / "x.safetensors")
    data = json.loads((tmp_path / "d.json").read_text())
    assert rc == EXIT_OK, out
    assert [r["layer"] for r in data["layers"]] == [linear, "layers.0.mlp", "layers.1.mlp"]
    assert [r["variant"] for r in data["layers"][1:]] == ["nvfp4", "nvfp4"]
    xs = load_file(str(tmp_path / "x.safetensors"))
    assert_diff_routes_as_the_model(data["layers"][1:], [layer.mlp.gate for layer in model.model.layers], xs,
                                    E=E, top_k=top_k, H=H, I=I, renormalize=True)
    return out, data


def assert_nonfinite_where_the_oracle(fused_moe, w13, w2, prepared, *, a16: bool, M: int = 8) -> None:
    """``fused_moe(x, prepared, ids, wt, a16=a16, **kw)`` (E = 8 experts w13 / w2, top-2) on x with NaN
    in token 1's row and Inf in token 4's (both on experts 0 and 1 only, the other tokens on experts
    2-7), a NaN router weight (token 6), a zero weight sum (token 7) under renormalize, and with
    swigluoai an Inf gate bias (an even row, in expert 2): non-finite exactly where
    formats.reference_moe's outputs are, and those are neither all finite nor all not."""
    E, top_k, H, I = len(w13), 2, w13[0].k, w2[0].k
    x = make_input((M, H), block=32)
    x[1, 5], x[4, 0] = float("nan"), float("inf")
    ids = torch.tensor([[0, 1] if t in (1, 4) else [2 + t % 6, 2 + (t + 1) % 6] for t in range(M)],
                       dtype=torch.int32, device=DEVICE)
    wt = torch.rand(M, top_k, device=DEVICE) + 0.05
    wt[6, 1] = float("nan")
    wt[7] = 0.0
    b13 = torch.zeros(E, 2 * I, device=DEVICE)
    b13[2, 0] = float("inf")
    for kw in (dict(renormalize=True), dict(activation="swigluoai", w13_bias=b13)):
        y = fused_moe(x, prepared, ids, wt, a16=a16, **kw).cpu()
        ref = formats.reference_moe(x, w13, w2, ids, wt, a16=a16, **kw).cpu()
        assert 0 < int(torch.isfinite(ref).sum()) < ref.numel()
        assert torch.equal(torch.isfinite(y), torch.isfinite(ref)), kw
