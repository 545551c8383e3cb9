"""kernels_triton.hopper.mxfp8's W8A16 path (the "mxfp8_w8a16" variant on sm_90: MXFP8 weights, bf16/fp16
x as it is): route(..., a16=True, x_dtype=) as data, its kernels against formats.reference_linear(...,
a16=True) (the float64 oracle), the argument errors, the sm_90 build, and the registry gate
(dispatch.backends.MXFP8_W8A16_GPU_RAN).

Where it runs: on the CPU each sm_90 route (132 SMs, the H200) is executed under the interpreter by
``execute`` (what ``linear`` runs after ``route``), tiny shapes; on an sm_90 GPU ``linear(a16=True)``
itself at the same shapes and at real sizes (those skip elsewhere, naming the device found).

Bounds (conftest.gemm_bound with x the float activation): every product is exact (bf16 x has 8
significant bits, fp16 x 11, a decoded weight code * 2^e 4: at most 15 bits, within fp32's 24; on a
GPU bf16 x is dotted in bf16 as it is, fp16 x as its exact bf16 halves hi = bf16(x) and lo = x - hi,
lo having <= 3 significant bits), the K products are summed in fp32 (K 2^-24 sum |x| |w|, Higham's
gamma_K; split-K adds its partials in fp32 too, within the same bound), the bias is added in fp32
(one rounding), and y and the oracle are each rounded once to the output dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import formats
from _sm90_build import PRELUDE, run_sm90_build
from conftest import DEVICE, assert_within_bound, device_name, gemm_bound, make_input
from kernels_triton import hopper, interpreting, record_launches
from kernels_triton.hopper import _e4m3_decode, _twopass
from kernels_triton.hopper import mxfp8 as H

FMT = "mxfp8"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H200_SMS = 132
SM90 = (9, 0)
A16_GEMMS = {"a16_decode": "e4m3_decode_gemm_kernel", "a16_fused": "_gemm_kernel", "a16_prepass": "bf16_gemm_kernel"}


def _on_sm90() -> bool:
    return (DEVICE == "cuda" and not interpreting()
            and tuple(torch.cuda.get_device_capability()) == SM90)


def _require_sm90():
    if not torch.cuda.is_available() or interpreting():
        pytest.skip(f"the hopper kernels run on sm_90 only; found {device_name()}")
    cap = tuple(torch.cuda.get_device_capability())
    if cap != SM90:
        pytest.skip(f"the hopper kernels run on sm_90 only; found {device_name()} (sm_{cap[0]}{cap[1]})")


def _weight(n: int, k: int, scale: float = 1.0) -> formats.QuantizedTensor:
    return formats.quantize(make_input((n, k), FP32) * scale, FMT).to(DEVICE)


def _route(M, N, K, x_dtype):
    if _on_sm90():
        return H.route(M, N, K, capability=SM90, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                       a16=True, x_dtype=x_dtype)
    return H.route(M, N, K, capability=SM90, sm_count=H200_SMS, a16=True, x_dtype=x_dtype)


def _run(x, qw, bias=None):
    """The W8A16 linear of x on this machine, and the launches: linear(a16=True) on an sm_90 GPU,
    else the same sm_90 route run by execute() under the interpreter."""
    r = _route(x.numel() // x.shape[-1], qw.shape[0], qw.shape[1], x.dtype)
    with record_launches() as log:
        y = H.linear(x, qw, bias, a16=True) if _on_sm90() else H.execute(r, x, qw, bias)
    return y, r, log


def _check(y, x, qw, bias, what):
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), None if bias is None else bias.cpu(), a16=True,
                                   out_dtype=y.dtype)
    assert y.shape == ref.shape, (y.shape, ref.shape)
    assert ref.abs().max() > 0
    assert_within_bound(y, ref, gemm_bound(x, qw, None if bias is None else bias.cpu(), y.dtype, ref), what)


# ---------------------------------------------------------------------------------------------
# The route as data (pure)
# ---------------------------------------------------------------------------------------------
def _expected_kind(M: int, x_dtype) -> str:
    if x_dtype == FP16:
        return "a16_fused"
    return "a16_decode" if M <= 16 else "a16_fused" if M <= 128 else "a16_prepass"


@pytest.mark.parametrize("x_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [0, 1, 5, 16, 17, 64, 128, 129, 300, 4096])
def test_route_by_m_and_dtype(M, x_dtype):
    """bf16: the decode GEMM to 16 rows, the fused kernel to 128, the weight pre-pass above; fp16:
    the fused kernel (exact hi/lo halves) at every M. No quantizer, only kernels of the package,
    split-K exactly where the reduction is launched."""
    N, K = 4096, 4096
    r = H.route(M, N, K, capability=SM90, sm_count=H200_SMS, a16=True, x_dtype=x_dtype)
    assert r.impl == "hopper"
    if M == 0:
        assert r.kernels == ()
        return
    kind = dict(r.options)["gemm"]
    assert kind == _expected_kind(M, x_dtype), r.describe()
    assert A16_GEMMS[kind] in r.kernels and "_quantize_kernel" not in r.kernels, r.describe()
    assert ("act_decoded_kernel" in r.kernels) == (kind == "a16_decode")
    assert r.kernels.count("_dequantize_kernel") == (kind == "a16_prepass")  # the weight's only
    assert (r.split_k > 1) == ("splitk_reduce_kernel" in r.kernels), r.describe()
    assert "W8A16" in r.why
    names = {n for m in (H, _e4m3_decode, _twopass) for n in dir(m) if n.endswith("_kernel")}
    assert set(r.kernels) <= names, r.describe()
    if M in (1, 16) and x_dtype == BF16:  # the decode tile splits K over the 132 SMs
        assert r.split_k > 1 and dict(r.options)["config"] == _e4m3_decode.decode_tile(M, N, K, H200_SMS)


def test_w8a8_routes_do_not_change():
    """a16 and x_dtype are new arguments; the W8A8 route (quantizer first) is what it was."""
    for M in (1, 16, 17, 300):
        a = H.route(M, 4096, 4096, capability=SM90, sm_count=H200_SMS)
        b = H.route(M, 4096, 4096, capability=SM90, sm_count=H200_SMS, x_dtype=FP16)
        assert a == b and a.kernels[0] in ("_quantize_kernel", "act_decoded_kernel"), a.describe()


def test_route_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"decode_kernel must be 'bf16' with a16=True .* got 'fp8'"):
        H.route(4, 64, 256, capability=SM90, sm_count=H200_SMS, a16=True, decode_kernel="fp8")
    with pytest.raises(ValueError, match=r"x_dtype must be torch.bfloat16 or torch.float16, got torch.float32"):
        H.route(4, 64, 256, capability=SM90, sm_count=H200_SMS, a16=True, x_dtype=FP32)
    with pytest.raises(ValueError, match="sm_90"):
        H.route(4, 64, 256, capability=(12, 0), sm_count=H200_SMS, a16=True)
    with pytest.raises(ValueError, match=r"a16=True \(W4A16 / W8A16\) exists for nvfp4, mxfp4, mxfp8, got 'fp8_block'"):
        hopper.module("fp8_block").route(4, 64, 256, capability=SM90, sm_count=H200_SMS, a16=True)


# ---------------------------------------------------------------------------------------------
# Against the oracle: every route, bf16 and fp16, bias on and off, K not a multiple of the tile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("x_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 300])
def test_linear_matches_the_oracle(M, x_dtype, has_bias):
    """K = 160: five 32-blocks, a multiple of no K step (decode 128, fused 64, pre-pass GEMM 64),
    so every kernel's K tail is masked; N = 40 fills no tile. The launches are the route's."""
    N, K = 40, 160
    x = make_input((M, K), x_dtype)
    qw = _weight(N, K)
    bias = torch.randn(N, device=DEVICE) if has_bias else None
    y, r, log = _run(x, qw, bias)
    assert log == list(r.kernels), (r.describe(), log)
    assert dict(r.options)["gemm"] == _expected_kind(M, x_dtype)
    assert y.dtype == x_dtype
    _check(y, x, qw, bias, f"W8A16 {x_dtype} M={M} {r.describe()}")


@pytest.mark.parametrize("M,x_dtype", [(5, BF16), (5, FP16), (40, BF16)], ids=["decode", "fused-fp16", "fused"])
def test_split_k_matches_the_oracle(M, x_dtype):
    """K = 1024: the decode tile splits K in two (8 steps of 128), the fused kernel's M <= 64 tiles
    too; the fp32 partials are added in order by splitk_reduce_kernel, which adds the bias."""
    N, K = 40, 1024
    x = make_input((M, K), x_dtype)
    qw = _weight(N, K)
    bias = torch.randn(N, device=DEVICE).to(BF16)
    y, r, log = _run(x, qw, bias)
    assert r.split_k > 1 and "splitk_reduce_kernel" in r.kernels, r.describe()
    assert log == list(r.kernels)
    _check(y, x, qw, bias, f"split-K {r.describe()}")


def test_leading_dims_strides_and_empty_x():
    """x [2, 3, K] (6 rows: the decode route) and a transposed x (K stride != 1: the fused and
    pre-pass kernels read any strides; the decode layout kernel too); no rows: an empty result."""
    N, K = 24, 96
    qw = _weight(N, K)
    x = make_input((2, 3, K), BF16)
    y, _, _ = _run(x, qw)
    assert y.shape == (2, 3, N)
    _check(y.reshape(6, N), x.reshape(6, K), qw, None, "leading dims")
    for M in (8, 33, 200):  # decode, fused, pre-pass
        xt = make_input((K, M), BF16).T
        assert xt.stride(1) != 1
        y, r, _ = _run(xt, qw)
        _check(y, xt, qw, None, f"transposed x {r.describe()}")
    r = _route(0, N, K, BF16)
    assert r.kernels == ()
    y = H.execute(r, torch.empty(2, 0, K, dtype=FP16, device=DEVICE), qw)
    assert y.shape == (2, 0, N) and y.dtype == FP16


@pytest.mark.parametrize("M", [4, 40, 200])
def test_fp16_keeps_its_low_bits_and_weights_beyond_fp16_range(M):
    """fp16 x with all 11 significant bits used (a bf16 copy errs by ~2^-9) and weight scales
    around 2^40 (past fp16's 65504): within the fp32 bound, which a kernel that rounds x to bf16 or
    casts the decoded weight to fp16 misses (on a GPU; the interpreter dots fp32)."""
    N, K = 16, 128
    x = (1 + torch.arange(M * K, dtype=FP32).reshape(M, K) % 2047 / 2048).to(FP16).to(DEVICE)
    qw = _weight(N, K, 2.0 ** 40)
    r = _route(M, N, K, FP16)
    assert dict(r.options)["gemm"] == "a16_fused"
    if _on_sm90():
        y = H.gemm_w8a16(x, qw, out_dtype=FP32)
    else:  # the route's GEMM plan, as gemm_w8a16 launches it, under the interpreter
        y = torch.empty((M, N), dtype=FP32)
        H._run_a16("a16_fused", dict(r.options)["config"], x, qw, None, y)
    _check(y, x, qw, None, f"fp16 x, weights ~2^40, M={M}")
    assert bool(y.isfinite().all())


@pytest.mark.parametrize("M,x_dtype", [(3, BF16), (3, FP16), (40, BF16), (200, BF16)],
                         ids=["decode", "fused-fp16", "fused", "prepass"])
def test_nan_and_inf_stay_non_finite_where_the_oracle_is(M, x_dtype):
    """A NaN or Inf in x makes its row of y non-finite, a NaN weight (E8M0 byte 0xFF, e4m3 code
    0x7F) its column; a NaN of the oracle is NaN here (fp16's hi/lo split may turn the oracle's
    Inf into NaN: non-finite either way); the rest is within the bound."""
    N, K = 24, 96
    x = make_input((M, K), x_dtype)
    x[1, 5] = float("nan")
    x[2, 70] = float("inf")
    qw = formats.quantize(make_input((N, K), FP32), FMT)
    qw.scale[7, 1] = 0xFF
    qw.data.view(torch.uint8)[11, 40] = 0x7F
    qw = qw.to(DEVICE)
    y, r, _ = _run(x, qw)
    y = y.float().cpu()
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), a16=True, out_dtype=FP32)
    bad = ~ref.isfinite()
    assert bad[[1, 2]].all() and bad[:, [7, 11]].all()
    assert torch.equal(~y.isfinite(), bad), f"non-finite elements differ from the oracle's ({r.describe()})"
    assert bool(y[ref.isnan()].isnan().all()), "a NaN of the oracle came out as a number or Inf"
    rows = [i for i in range(M) if i not in (1, 2)]
    cols = [c for c in range(N) if c not in (7, 11)]
    w = qw.to("cpu")
    sub = dataclasses.replace(w, data=w.data[cols], scale=w.scale[cols], shape=(len(cols), K))
    r_ok = formats.reference_linear(x[rows].cpu(), sub, a16=True, out_dtype=x_dtype)
    assert_within_bound(y[rows][:, cols].to(x_dtype), r_ok, gemm_bound(x[rows], sub, None, x_dtype, r_ok), "finite")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    x, qw = make_input((2, 64), BF16), _weight(8, 64)
    cases = [
        (lambda: H.linear(x, qw, a16=True, decode_kernel="fp8"), r"decode_kernel must be 'bf16' with a16=True"),
        (lambda: H.linear(x.float(), qw, a16=True), r"x must be bfloat16 or float16.*float32"),
        (lambda: H.linear(make_input((2, 96), BF16), qw, a16=True), r"K=64"),
        (lambda: H.gemm_w8a16(make_input((2, 4, 64), BF16), qw), r"x2d must be 2-D"),
        (lambda: H.gemm_w8a16(x, qw, out_dtype=torch.float64), r"out_dtype.*float64"),
        (lambda: H.gemm_w8a16(x, qw, torch.ones(7, device=DEVICE)), r"bias"),
        (lambda: H.gemm_w8a16(x, formats.quantize(make_input((8, 64)), "mxfp4").to(DEVICE)), r"mxfp8"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
    # a bf16 route run on fp16 x: its decode GEMM and pre-pass dot x as bf16, which would round it
    for M in (4, 200):
        r = H.route(M, 8, 64, capability=SM90, sm_count=H200_SMS, a16=True)
        with pytest.raises(ValueError, match=r"x must be bfloat16 for the W8A16 route 'a16_(decode|prepass)'"):
            H.execute(r, make_input((M, 64), FP16), qw)
    y = torch.empty(4, 8, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be bfloat16 with a16=True .* got torch.float16"):
        _e4m3_decode.launch_e4m3_decode_linear(make_input((4, 64), FP16), qw.data, qw.scale, None, y, a16=True)


def test_linear_refuses_a_device_that_is_not_sm90():
    if _on_sm90():
        pytest.skip(f"this device is sm_90 ({device_name()}): the hopper kernels run here")
    with pytest.raises(ValueError, match=r"kernels_triton.hopper.mxfp8 runs on sm_90 only"):
        H.linear(make_input((2, 64), BF16), _weight(8, 64), a16=True)


# ---------------------------------------------------------------------------------------------
# The registry gate
# ---------------------------------------------------------------------------------------------
def test_the_registry_cell_is_a_named_gap_until_a_gpu_ran_it(monkeypatch):
    """dispatch.backends.MXFP8_W8A16_GPU_RAN False: (hopper, mxfp8_w8a16) is an UnsupportedEntry
    that says the path is written and not yet run on a GPU; True: a HopperBackend whose route is
    this module's route(..., a16=True, x_dtype=) on the device."""
    from dispatch import backends
    from dispatch.contract import Problem, UnsupportedEntry
    from dispatch.devices import KNOWN_DEVICES

    monkeypatch.setattr(backends, "MXFP8_W8A16_GPU_RAN", False)
    cell = backends.make("hopper", "mxfp8_w8a16")
    assert isinstance(cell, UnsupportedEntry)
    assert cell.reason.startswith("kernels_triton.hopper.mxfp8 W8A16 is written, not yet run on a GPU")
    assert isinstance(backends.make("hopper", "mxfp4_w4a16"), backends.HopperBackend)  # the gate is this cell's
    monkeypatch.setattr(backends, "MXFP8_W8A16_GPU_RAN", True)
    b = backends.make("hopper", "mxfp8_w8a16")
    assert isinstance(b, backends.HopperBackend)
    h200 = KNOWN_DEVICES["h200"]
    assert b.is_supported(h200)[0]
    ok, why = b.can_implement(Problem("mxfp8_w8a16", 16, 4096, 4096, BF16))
    assert ok and why == "kernels_triton.hopper.mxfp8 W8A16", why
    for M, dt in ((16, BF16), (16, FP16), (300, BF16)):
        r = b.route(Problem("mxfp8_w8a16", M, 4096, 4096, dt), h200)
        assert r == H.route(M, 4096, 4096, capability=h200.capability, sm_count=h200.sm_count, a16=True,
                            x_dtype=dt), r.describe()
        assert dict(r.options)["gemm"] == _expected_kind(M, dt)


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU at real sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("x_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 16, 17, 128, 300, 4096])
def test_linear_on_sm90_at_real_sizes(M, x_dtype):
    """N = K = 4096 and K = 4128 (a K tail in every kernel) on the GPU: the launches are the route's,
    y within the oracle's bound, with a bias."""
    _require_sm90()
    for N, K in ((4096, 4096), (1024, 4128)):
        x = make_input((M, K), x_dtype)
        qw = _weight(N, K, 0.05)
        bias = torch.randn(N, device=DEVICE)
        y, r, log = _run(x, qw, bias)
        assert log == list(r.kernels), (r.describe(), log)
        _check(y, x, qw, bias, f"M={M} N={N} K={K} {x_dtype} {r.describe()}")


# ---------------------------------------------------------------------------------------------
# The sm_90 build, without a GPU
# ---------------------------------------------------------------------------------------------
_BUILD = PRELUDE + r'''
import torch
from kernels_triton.hopper import _e4m3_decode as D, mxfp8 as H
cfg = H._a16_plan(16, 4096, 4096, 132, torch.bfloat16)[1]
rows["act"] = build(D.act_decoded_kernel,
                    {"x_ptr": "*bf16", "p_ptr": "*bf16", **i32("M K stride_xm stride_xk stride_pm")},
                    dict(FLOOR_RULE=False, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K, USE_PDL=True, A16=True),
                    num_warps=4, launch_pdl=True)
sig = {"x_ptr": "*bf16", "sx_ptr": "*u8", "w_ptr": "*u8", "sw_ptr": "*u8", "bias_ptr": "*fp32", "y_ptr": "*bf16",
       "ws_ptr": "*fp32", **i32("M N K K_PER stride_xm stride_sxm stride_wn stride_swn stride_ym")}
rows["decode"] = build(D.e4m3_decode_gemm_kernel, sig, dict(
    HAS_BIAS=True, USE_ASM=True, DOT_DTYPE=tl.bfloat16, ROUND_BF16=False, EVEN_K=True, BLOCK_N=cfg.BLOCK_N,
    BLOCK_M=16, BLOCK_K=cfg.BLOCK_K, SPLIT_K=cfg.SPLIT_K, USE_PDL=True, X_DECODED=True),
    num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=True)
for name, xt, split in (("fused_bf16", "*bf16", False), ("fused_fp16", "*fp16", True)):
    c = H._a16_plan(40, 4096, 4096, 132, torch.float16 if split else torch.bfloat16)[1]
    sig = {"x_ptr": xt, "w_ptr": "*u8", "sx_ptr": "*u8", "sw_ptr": "*u8", "bias_ptr": "*fp32", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", **i32("M N K K_PER stride_xm stride_xk stride_wn stride_wk stride_sxm stride_sxk "
                                    "stride_swn stride_swk stride_ym stride_yn")}
    rows[name] = build(H._gemm_kernel, sig, dict(
        HAS_BIAS=True, DOT_BF16=True, ROUND_BF16=False, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
        GROUP_M=c.GROUP_M, SPLIT_K=2, USE_PDL=True, A16=True, SPLIT_A16=split),
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=True)
json.dump(rows, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_sm90_build_of_the_w8a16_kernels(tmp_path):
    """Compile-only (no GPU): the decode GEMM on the laid-out bf16 x and the fused kernel (bf16 x;
    fp16 x as two bf16 halves: twice the wgmmas of the bf16 build) issue wgmma for sm_90, and the
    layout kernel and the GEMMs carry PDL's griddepcontrol."""
    out = tmp_path / "build.json"
    run_sm90_build(["-c", _BUILD, out], tmp_path)
    import json

    rows = json.loads(out.read_text())
    for name in ("decode", "fused_bf16", "fused_fp16"):
        assert rows[name]["wgmma"] > 0, f"{name}: no wgmma ({rows[name]})"
    assert rows["fused_fp16"]["wgmma"] == 2 * rows["fused_bf16"]["wgmma"], rows
    for name, r in rows.items():
        assert r["pdl"] > 0, f"{name}: no griddepcontrol ({r})"
