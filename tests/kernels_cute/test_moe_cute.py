"""kernels_cute.moe: MoE on SM120/SM121 through b12x's fused MoE.

Three kinds of test:

- CPU (b12x installed; the b12x-free ones anywhere): ``supports`` for every variant x activation x
  capability; the layout conversion, decoded the way b12x's own torch reference reads its kernels'
  operands (``b12x.moe._shared.kernels.reference``: ``_dequant_fp4``, ``unswizzle_block_scale``,
  ``_gated_row_slices``) and compared with ``formats.dequantize`` of every expert; the A4 alphas;
  ``route``; argument errors; the import without b12x.
- Compile (b12x installed, no GPU needed; about 2-3 minutes on the 2-core CI machine):
  kernels_cute._compile compiles, for sm_120a and sm_121a, b12x's programs for the Caps that
  ``fused_moe`` plans, through b12x's own compile job (``compile_fused_moe``).
- SM12x GPU only (skips elsewhere, naming the device found): ``fused_moe`` against
  ``formats.reference_moe``.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import formats
from conftest import device_name
from formats import MOE_ACTIVATIONS, reference_moe
from kernels_cute import moe

ROOT = Path(__file__).resolve().parents[2]
HAS_B12X = moe._b12x_import_error() is None
needs_b12x = pytest.mark.skipif(not HAS_B12X, reason=f"b12x is not importable: {moe._b12x_import_error()}")
IS_SM12X = torch.cuda.is_available() and torch.cuda.get_device_capability() in ((12, 0), (12, 1))


def _experts(fmt, E, rows, K, *, swizzled=(), device="cpu", scale=1.0):
    """E random weight QuantizedTensors [rows, K] (formats.quantize); the experts listed in
    ``swizzled`` get their block scales in the flat 128x4 layout."""
    out = []
    for e in range(E):
        q = formats.quantize(torch.randn(rows, K, device=device) * scale, fmt, role="weight")
        if e in swizzled:
            from dataclasses import replace

            q = replace(q, scale=formats.swizzle_128x4(q.scale), scale_layout="swizzled_128x4")
        out.append(q)
    return out


# ---------------------------------------------------------------------------------------------
# supports(), route(): pure
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", MOE_ACTIVATIONS)
@pytest.mark.parametrize("variant", moe.VARIANTS)
def test_supports_every_variant_and_activation(variant, activation):
    ok, why = moe.supports(variant, activation, (12, 0))
    if variant in moe.SERVED:
        assert ok == HAS_B12X, why
        if ok:
            assert moe.SERVED[variant][0] in why and moe.B12X_ACTIVATION[activation] in why
    else:
        assert not ok
        needle = "no FP8 weight source" if variant in moe.FP8_VARIANTS else "no MXFP4-activation recipe"
        assert needle in why and repr(variant) in why, why


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (8, 9), None])
def test_supports_refuses_other_devices_naming_the_capability(capability):
    ok, why = moe.supports("nvfp4", "silu", capability)
    assert not ok and "SM120/SM121" in why and str(capability if capability is None else tuple(capability)) in why


def test_supports_refuses_unknown_names():
    ok, why = moe.supports("nvfp4", "gelu", (12, 1))
    assert not ok and "activation must be one of" in why and "'gelu'" in why
    ok, why = moe.supports("fp6", "silu", (12, 1))
    assert not ok and "'fp6'" in why


def test_every_formats_variant_is_answered():
    """Every format of formats/ (and each weight-only variant) is served or a named gap."""
    for v in moe.VARIANTS:
        assert (v in moe.SERVED) != (v in moe.GAPS), v
    assert set(formats.FORMAT_NAMES) <= set(moe.VARIANTS)


@needs_b12x
def test_route_names_b12x_backend():
    r = moe.route(2, 8, 2, 2048, 768, variant="nvfp4")
    assert r.kernels == ("b12x.moe.fused_moe.run[nvfp4:micro]",) and r.impl == "cute", r
    r = moe.route(64, 8, 8, 2048, 768, variant="nvfp4")
    assert r.kernels == ("b12x.moe.fused_moe.run[nvfp4:dynamic]",), r  # b12x's select_tp_moe_backend
    r = moe.route(64, 8, 8, 2048, 96, variant="nvfp4_w4a16")
    assert r.kernels == ("b12x.moe.fused_moe.run[w4a16:w4a16]",) and "padded to 128" in r.why, r
    assert moe.route(0, 8, 2, 256, 128, variant="mxfp4_w4a16").kernels == ()


def test_route_errors():
    with pytest.raises(ValueError, match="does not serve 'fp8_block': b12x 1.5.1's fused MoE has no FP8"):
        moe.route(4, 8, 2, 256, 128, variant="fp8_block")
    with pytest.raises(ValueError, match=r"E, top_k, H, I > 0"):
        moe.route(4, 0, 2, 256, 128, variant="nvfp4")


def test_module_imports_no_b12x_and_no_kernels_triton_at_top_level():
    """b12x is imported lazily (the module loads without it); kernel packages never import each other."""
    tree = ast.parse((ROOT / "kernels_cute" / "moe.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(n.startswith(("b12x", "kernels_triton")) for n in names), names
    src = (ROOT / "kernels_cute" / "moe.py").read_text()
    assert "kernels_triton" not in "".join(ln for ln in src.splitlines() if "import" in ln)


def test_imports_and_answers_without_b12x():
    """In a process where b12x cannot be imported, the module loads and supports() says why."""
    code = ("import sys; sys.modules['b12x'] = None\n"
            "from kernels_cute import moe\n"
            "ok, why = moe.supports('nvfp4', 'silu', (12, 0)); assert not ok and 'not importable' in why, why\n"
            "assert moe.route(1, 8, 2, 256, 128, variant='nvfp4').kernels == "
            "('b12x.moe.fused_moe.run[nvfp4:micro|dynamic]',)\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# The layout conversion, read as b12x reads it
# ---------------------------------------------------------------------------------------------
def _b12x_decode(arrays, e, variant, rows, K, which):
    """Expert e's FC1 (``which`` = "w1") or FC2 ("w2") weight [rows, K] in float64, decoded by
    b12x's torch reference of its kernels: packed e2m1 (low nibble first) x block scale (nvfp4:
    unswizzled from the 128x4 swizzle; mxfp4: the linear E8M0 grid) x global scale (b12x's
    dequantization factor)."""
    from b12x.moe._shared.kernels import reference as ref

    lut = ref._make_fp4_lut(torch.device("cpu"))
    raw = ref._dequant_fp4(arrays[f"{which}_fp4"][e], rows, K, lut).double()
    if moe.SERVED[variant][2] == "nvfp4":
        sf = ref.unswizzle_block_scale(arrays[f"{which}_blockscale"][e].reshape(-1), rows, K // 16).double()
        block = 16
    else:
        sf = ref._e8m0_scales_to_float(arrays[f"{which}_blockscale"][e]).double()
        block = 32
    w = raw * sf.repeat_interleave(block, dim=1)[:, :K]
    return w * float(arrays[f"{which}_global_scale"][e])


@needs_b12x
@pytest.mark.parametrize("activation", MOE_ACTIVATIONS)
@pytest.mark.parametrize("variant", tuple(moe.SERVED))
def test_b12x_arrays_decode_to_formats_dequantize(variant, activation):
    """Every byte b12x reads, decoded as b12x's reference decodes it and ordered as b12x's
    ``_gated_row_slices`` takes the gate and up halves for the declared w13_layout, equals
    formats.dequantize of our experts; padding rows / columns are zero.

    Bound: nvfp4's value is code * s / g in formats and code * s * fl32(1 / g) here: one float32
    rounding of 1 / g, so a relative difference <= 2^-24 (0 for mxfp4, no global scale)."""
    from b12x.moe._shared.kernels import reference as ref

    fmt = moe.SERVED[variant][2]
    E, H = 3, 256
    I = 96 if fmt == "nvfp4" else 64  # nvfp4: padded to 128 (two 16-wide K blocks of W2 are padding)
    w13 = _experts(fmt, E, 2 * I, H, swizzled=(1,))
    w2 = _experts(fmt, E, H, I, swizzled=(2,))
    arrays, E_, H_, I_, ip = moe._b12x_arrays(w13, w2, variant, activation)
    assert (E_, H_, I_) == (E, H, I) and ip == (128 if fmt == "nvfp4" else I)
    layout = moe._w13_rows(activation, 1)[1]
    gate_rows, up_rows = ref._gated_row_slices(moe.B12X_ACTIVATION[activation], ip, w13_layout=layout)
    rtol = 2.0 ** -24 if fmt == "nvfp4" else 0.0
    for e in range(E):
        ours13 = formats.dequantize(w13[e], torch.float64)
        if activation == "swigluoai":
            gate, up = ours13[0::2], ours13[1::2]
        else:
            gate, up = ours13[:I], ours13[I:]
        w1 = _b12x_decode(arrays, e, variant, 2 * ip, H, "w1")
        torch.testing.assert_close(w1[gate_rows][:I], gate, rtol=rtol, atol=0)
        torch.testing.assert_close(w1[up_rows][:I], up, rtol=rtol, atol=0)
        assert not w1[gate_rows][I:].any() and not w1[up_rows][I:].any()  # the padding rows
        w2e = _b12x_decode(arrays, e, variant, H, ip, "w2")
        torch.testing.assert_close(w2e[:, :I], formats.dequantize(w2[e], torch.float64), rtol=rtol, atol=0)
        assert not w2e[:, I:].any()
    assert arrays["w1_fp4"].dtype == torch.uint8 and arrays["w1_fp4"].shape == (E, 2 * ip, H // 2)
    assert arrays["w2_fp4"].shape == (E, H, ip // 2)


@needs_b12x
def test_nvfp4_prepared_by_b12x_on_cpu_holds_our_arrays_and_alphas():
    """b12x's prepare_weights keeps our arrays (no copy) and the A4 alphas follow the activation
    scales written per call: alpha = (1 / g_w) / g_x, a1/a2_gscale = g_x (b12x's
    _prepare_modelopt_nvfp4_runtime_alphas convention); the same option objects are not rewritten."""
    E, H, I = 3, 256, 64
    w13, w2 = _experts("nvfp4", E, 2 * I, H), _experts("nvfp4", E, H, I)
    p = moe.prepare_experts(w13, w2, variant="nvfp4", activation="silu")
    ex = p.experts
    assert ex.w1_fp4.data_ptr() == p.arrays["w1_fp4"].data_ptr()
    assert ex.w2_blockscale.data_ptr() == p.arrays["w2_blockscale"].data_ptr()
    g13, g2 = torch.rand(E) * 100 + 1, torch.tensor(37.5)
    moe._set_activation_scales(p, {"global_scale": g13}, {"global_scale": g2})
    gw13 = torch.stack([q.global_scale.double() for q in w13])
    gw2 = torch.stack([q.global_scale.double() for q in w2])
    torch.testing.assert_close(ex.w1_alphas.double(), 1 / gw13 / g13.double(), rtol=2 * 2.0 ** -24, atol=0)
    torch.testing.assert_close(ex.w2_alphas.double(), 1 / gw2 / 37.5, rtol=2 * 2.0 ** -24, atol=0)
    assert torch.equal(ex.a1_gscale, g13) and torch.equal(ex.a2_gscale, torch.full((E,), 37.5))
    ex.a1_gscale.fill_(-1.0)  # the same objects again: skipped (their key is unchanged)
    moe._set_activation_scales(p, {"global_scale": g13}, {"global_scale": g2})
    assert (ex.a1_gscale == -1.0).all()
    g13.mul_(2)  # an in-place change bumps the tensor's version: rewritten
    moe._set_activation_scales(p, {"global_scale": g13}, {"global_scale": g2})
    assert torch.equal(ex.a1_gscale, g13)
    for _ in range(3):  # fresh temporaries each call (as a caller building them per call): always rewritten
        g = torch.rand(E) + 1
        moe._set_activation_scales(p, {"global_scale": g}, {"global_scale": 2.0})
        assert torch.equal(ex.a1_gscale, g) and (ex.a2_gscale == 2.0).all()
        del g
    moe._set_activation_scales(p, {"global_scale": 5.0}, {"global_scale": 3.0})  # numbers compare by value
    assert (ex.a1_gscale == 5.0).all() and (ex.a2_gscale == 3.0).all()


# ---------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------
@needs_b12x
def test_prepare_experts_errors():
    E, H, I = 2, 256, 64
    w13, w2 = _experts("nvfp4", E, 2 * I, H), _experts("nvfp4", E, H, I)
    with pytest.raises(ValueError, match="variant must be one of .*got 'fp8_tensor': b12x 1.5.1's fused MoE has no F"):
        moe.prepare_experts(w13, w2, variant="fp8_tensor")
    with pytest.raises(ValueError, match="got 'mxfp4': b12x 1.5.1's fused MoE has no MXFP4-activation recipe"):
        moe.prepare_experts(w13, w2, variant="mxfp4")
    with pytest.raises(ValueError, match="activation must be one of .*'relu'"):
        moe.prepare_experts(w13, w2, variant="nvfp4", activation="relu")
    with pytest.raises(ValueError, match="dtype must be one of .*torch.float32"):
        moe.prepare_experts(w13, w2, variant="nvfp4", dtype=torch.float32)
    with pytest.raises(ValueError, match="w13 must hold mxfp4 experts for variant 'mxfp4_w4a16', got nvfp4"):
        moe.prepare_experts(w13, w2, variant="mxfp4_w4a16")
    with pytest.raises(ValueError, match="w13 must be a non-empty sequence"):
        moe.prepare_experts(w13[0], w2, variant="nvfp4")
    with pytest.raises(ValueError, match=r"w13 must have 2 \* I = 64 rows"):
        moe.prepare_experts(w13, _experts("nvfp4", E, H, 32), variant="nvfp4")
    with pytest.raises(ValueError, match="same expert count, got 2 and 1"):
        moe.prepare_experts(w13, w2[:1], variant="nvfp4")
    bad = list(w13)
    from dataclasses import replace

    bad[1] = replace(bad[1], global_scale=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match=r"w13\[1\]"):
        moe.prepare_experts(bad, w2, variant="nvfp4")


@needs_b12x
def test_fused_moe_errors():
    E, H, I = 2, 256, 64
    p = moe.prepare_experts(_experts("nvfp4", E, 2 * I, H), _experts("nvfp4", E, H, I), variant="nvfp4")
    x = torch.randn(3, H, dtype=torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2)
    with pytest.raises(ValueError, match="prepared must be a CuteMoEExperts"):
        moe.fused_moe(x, p.arrays, ids, w)
    with pytest.raises(ValueError, match=r"x must be a 2-D \[M, H=256\] torch.bfloat16 tensor .*got torch.float16"):
        moe.fused_moe(x.half(), p, ids, w)
    with pytest.raises(ValueError, match="topk_ids must be an integer tensor"):
        moe.fused_moe(x, p, ids.float(), w)
    with pytest.raises(ValueError, match="topk_weights must be a float tensor of topk_ids' shape"):
        moe.fused_moe(x, p, ids, w[:, :1])
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 2\) .*got \[0, 2\]"):
        moe.fused_moe(x, p, ids + torch.tensor([[0, 1], [0, 0], [0, 0]]), w)
    with pytest.raises(ValueError, match="w13_bias must be None: b12x's fused MoE has no expert bias"):
        moe.fused_moe(x, p, ids, w, w13_bias=torch.zeros(E, 2 * I))
    with pytest.raises(RuntimeError, match="runs on an SM120/SM121 GPU; these experts are on cpu"):
        moe.fused_moe(x, p, ids, w, w13_act_opts={"global_scale": 1.0}, w2_act_opts={"global_scale": 1.0})
    pa = moe.prepare_experts(_experts("mxfp4", E, 2 * I, H), _experts("mxfp4", E, H, I), variant="mxfp4_w4a16")
    assert pa.experts is None  # b12x's W4A16 preparation repacks on the GPU
    with pytest.raises(ValueError, match="w13_act_opts must be empty for mxfp4_w4a16"):
        moe.fused_moe(x, pa, ids, w, w13_act_opts={"scale_rule": "ceil"})


@needs_b12x
def test_nvfp4_activation_scale_errors():
    E, H, I = 2, 256, 64
    p = moe.prepare_experts(_experts("nvfp4", E, 2 * I, H), _experts("nvfp4", E, H, I), variant="nvfp4")
    one = {"global_scale": 1.0}
    with pytest.raises(ValueError, match=r"w13_act_opts\['global_scale'\] is required for nvfp4 .*no dynamic"):
        moe._set_activation_scales(p, None, one)
    with pytest.raises(ValueError, match=r"w2_act_opts takes only 'global_scale' for nvfp4, got \['global_scale', 'x"):
        moe._set_activation_scales(p, one, {"global_scale": 1.0, "x": 1})
    for bad in (0.0, -2.0, float("inf"), torch.tensor([1.0, float("nan")])):
        with pytest.raises(ValueError, match=r"w13_act_opts\['global_scale'\] must be finite and > 0"):
            moe._set_activation_scales(p, {"global_scale": bad}, one)
    with pytest.raises(ValueError, match=r"one positive number or a float tensor of 1 or 2 .*values"):
        moe._set_activation_scales(p, {"global_scale": torch.ones(3)}, one)


# ---------------------------------------------------------------------------------------------
# Compile for sm_120a / sm_121a without a GPU
# ---------------------------------------------------------------------------------------------
GEOMETRY = dict(E=8, H=2048, I=768)  # a Qwen3-30B-A3B-like shard (I 768), fewer experts
SMALL = dict(E=8, H=256, I=128)  # the SM12x numeric test's geometry
COMPILE_CELLS = [  # (variant, activation, M, top_k, geometry): b12x's micro and dynamic A4 backends, W4A16
    ("nvfp4", "silu", 1, 2, GEOMETRY), ("nvfp4", "silu", 64, 8, GEOMETRY), ("nvfp4", "swigluoai", 1, 2, GEOMETRY),
    ("nvfp4_w4a16", "silu", 1, 2, GEOMETRY), ("nvfp4_w4a16", "swigluoai_uninterleave", 64, 8, GEOMETRY),
    ("mxfp4_w4a16", "silu", 1, 2, GEOMETRY), ("mxfp4_w4a16", "swigluoai", 64, 8, GEOMETRY),
    ("nvfp4", "silu", 7, 2, SMALL), ("nvfp4", "swigluoai", 64, 2, SMALL), ("mxfp4_w4a16", "swigluoai", 1, 2, SMALL),
]


def _cell_id(cell):
    v, a, m, k, g = cell
    return f"{v}-{a}-M{m}-top{k}-H{g['H']}"


@pytest.fixture(scope="module")
def moe_compiled(tmp_path_factory):
    if not HAS_B12X:
        pytest.skip(f"b12x is not importable: {moe._b12x_import_error()}")
    from kernels_cute import _compile

    cells = [dict(variant=v, activation=a, M=m, top_k=k, **g) for v, a, m, k, g in COMPILE_CELLS]
    reports, walls = _compile.compile_many({arch: cells for arch in _compile.TARGETS}, moe=True,
                                           cache_dir=str(tmp_path_factory.mktemp("moe-compile")))
    print(f"\nkernels_cute.moe compile: {len(reports)} cells, wall per arch {walls}")
    return {(r.arch, r.fmt, r.M, r.N): r for r in reports}  # N, K of a report: H, I


@pytest.mark.parametrize("arch", ("sm_120a", "sm_121a"))
@pytest.mark.parametrize("cell", COMPILE_CELLS, ids=_cell_id)
def test_fused_moe_programs_compile_for_sm12x(moe_compiled, arch, cell):
    """b12x's programs for the plan fused_moe makes compile for ``arch`` (artifacts say -arch
    ``arch``), with the backend b12x's planner picks (micro for a few routed rows, dynamic for 128
    and more; W4A16 its own), which route() names."""
    variant, activation, M, top_k, g = cell
    r = moe_compiled[(arch, f"moe:{variant}:{activation}", M, g["H"])]
    assert r.ok, f"{variant} {activation} M={M} top_k={top_k} {g} for {arch}: {r.error}"
    assert r.programs and r.targets == [arch], (r.programs, r.targets)
    want = "w4a16" if moe.SERVED[variant][0] == "w4a16" else ("micro" if M * top_k <= 16 else "dynamic")
    assert r.lowering["implementation"] == want, r.lowering
    assert r.lowering["implementation"] in moe.route(M, g["E"], top_k, g["H"], g["I"], variant=variant).kernels[0]


# ---------------------------------------------------------------------------------------------
# SM12x GPU: fused_moe against the float64 oracle
# ---------------------------------------------------------------------------------------------
def _moe_bound(variant):
    """Norm-relative bound of fused_moe vs reference_moe, from the roundings b12x makes and the
    oracle does not: FC1's output h, the activated intermediate a and the output y each rounded to
    bf16 (<= 2^-9 relative each); silu(g) * u passes h's error with a gain <= 1.1 * |u| / |a| + 1 on
    each half (|silu'| <= 1.1), so <= 4.2 * 2^-9 ~ 0.82 % of the output; doubled: 2^-6. A4 adds the
    e2m1 codes of x and the intermediate that land on the other side of a rounding boundary (b12x
    quantizes the bf16 intermediate, scales as amax * g / 6 in fp32): one e2m1 step on a few % of
    elements at most, <= 1.5 % of the output in norm; so 2^-5 for nvfp4. A gate/up swap, a
    misplaced scale or a wrong global scale gives errors of order 100 %."""
    return 2.0 ** -5 if variant == "nvfp4" else 2.0 ** -6


@pytest.mark.skipif(not IS_SM12X, reason=f"needs an SM120/SM121 GPU; found {device_name()}")
@pytest.mark.skipif(not HAS_B12X, reason=f"b12x is not importable: {moe._b12x_import_error()}")
@pytest.mark.parametrize("M", (1, 7, 64))
@pytest.mark.parametrize("activation", ("silu", "swigluoai"))
@pytest.mark.parametrize("variant", tuple(moe.SERVED))
def test_fused_moe_matches_reference_moe_on_sm12x(variant, activation, M):
    fmt = moe.SERVED[variant][2]
    E, top_k, H, I = 8, 2, 256, 128
    w13 = _experts(fmt, E, 2 * I, H, device="cuda", scale=0.1)
    w2 = _experts(fmt, E, H, I, device="cuda", scale=0.1)
    p = moe.prepare_experts(w13, w2, variant=variant, activation=activation)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:top_k] for _ in range(M)])
    w = torch.rand(M, top_k, device="cuda")
    opts = {}
    if variant == "nvfp4":  # static per-expert activation global scales (b12x has no dynamic one)
        opts = dict(w13_act_opts={"global_scale": 448 * 6 / (x.float().abs().amax() * torch.ones(E, device="cuda"))},
                    w2_act_opts={"global_scale": torch.full((E,), 448 * 6 / 64.0, device="cuda")})  # |a| <= 64
    y = moe.fused_moe(x, p, ids, w, renormalize=True, **opts)
    ref = reference_moe(x, w13, w2, ids, w, activation=activation, renormalize=True, a16=variant != "nvfp4",
                        out_dtype=torch.float64, **opts)
    assert y.shape == (M, H) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err <= _moe_bound(variant), f"{variant} {activation} M={M}: norm-relative error {err:.3e}"
    x2 = x.clone()
    x2[0, 3] = float("nan")  # a NaN row gives a NaN output row, the other rows unchanged
    y2 = moe.fused_moe(x2, p, ids, w, renormalize=True, **opts)
    assert torch.isnan(y2[0]).all()
    torch.testing.assert_close(y2[1:], y[1:], rtol=2.0 ** -8, atol=0)  # 1 bf16 ulp: b12x may sum in another order
