"""Contract tests (CPU): what kernels_cute hands b12x decodes, through b12x's own pure-PyTorch
helpers, to exactly the oracle's values; plus the facts behind our quantizer choices.

The CUDA-only parts (b12x's pack_weight refuses CPU tensors: fp8_tensor and mxfp8 weights) are
marked ``gpu`` and run on any CUDA GPU, the H200 included (no SM12x instruction is involved).

Modules: kernels_cute/fp8_tensor.py, kernels_cute/fp8_block.py, kernels_cute/mxfp8.py, kernels_cute/nvfp4.py,
kernels_cute/mxfp4.py (the weight preparation each hands b12x).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("b12x", reason="b12x is not installed (pip install -e '.[dev]' brings b12x==1.5.1)")

import formats  # noqa: E402
import kernels_cute  # noqa: E402
from conftest import device_name, make_input  # noqa: E402

intr = pytest.importorskip("b12x._lib.intrinsics")
a16 = pytest.importorskip("b12x.gemm.blockscaled._a16")

SHAPES = [(256, 512), (200, 1024), (8, 256)]  # (rows, K): full tiles, a partial 128-row tile, few rows


def _b12x_scale_matrix(flat, rows, k, vec):
    """Our flat scale storage -> [rows, K/vec] bytes, read the way b12x's kernels read it:
    scale_storage() (its run-time check) -> as_grouped_scale_view(_mx) 6D MMA view -> element
    (r, c) at [r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, 0]."""
    storage = a16.scale_storage(flat, rows, k, vec)
    view = (intr.as_grouped_scale_view if vec == 16 else intr.as_grouped_scale_view_mx)(storage.view(1, -1), rows, k)
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(k // vec).view(1, -1)
    return view[r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, 0].contiguous().view(torch.uint8)


def _b12x_fp4_values(data):
    """uint8 [rows, K/2] -> float32 [rows, K] with b12x's E2M1 magnitude table, low nibble first,
    bit 3 the sign (b12x _lib/intrinsics._FP4_MAG_LUT / pack_grouped_fp4_values order)."""
    lut = torch.tensor(intr._FP4_MAG_LUT, dtype=torch.float32)
    nib = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(data.shape[0], -1).long()
    return torch.where(nib >= 8, -lut[nib & 7], lut[nib & 7])


@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_weight_decodes_through_b12x_to_the_oracle(fmt, rows, k):
    if fmt == "mxfp4" and k % 256:
        k = 512
    w = make_input((rows, k), torch.float32, device="cpu", generator=torch.Generator().manual_seed(rows + k))
    q = formats.quantize(w, fmt)
    p = kernels_cute.prepare_weight(q)
    vec = 16 if fmt == "nvfp4" else 32
    # The flat storage equals b12x's own swizzle of the linear scales, byte for byte.
    assert torch.equal(p.scale.view(torch.uint8), intr.swizzle_block_scale(q.scale.view(torch.uint8)).flatten())
    sf = _b12x_scale_matrix(p.scale, rows, k, vec)
    assert torch.equal(sf, q.scale.view(torch.uint8))
    # Decode values x scales with b12x's tables; equals the oracle's dequantization exactly.
    scale = (sf.view(torch.float8_e4m3fn).float() if fmt == "nvfp4"
             else torch.ldexp(torch.ones(sf.shape), sf.int() - 127))
    y = _b12x_fp4_values(p.data) * scale.repeat_interleave(vec, 1)
    if fmt == "nvfp4":
        y = y / p.global_scale
    assert torch.equal(y, formats.dequantize(q))


@pytest.mark.parametrize("rows,k", SHAPES)
def test_fp4_codes_match_b12x_packer(rows, k):
    """Our nibble order is b12x's: re-packing the oracle's E2M1 values with b12x's
    fp4_quantize_values_torch + pack_grouped_fp4_values gives the same bytes, except that the oracle
    keeps the sign of a value that rounds to zero (code 8, -0) where b12x writes +0 (code 0); both
    are zero to the MMA."""
    w = make_input((rows, k), torch.float32, device="cpu", generator=torch.Generator().manual_seed(7))
    q = formats.quantize(w, "nvfp4")
    values = _b12x_fp4_values(q.data)
    repacked = intr.pack_grouped_fp4_values(intr.fp4_quantize_values_torch(values)[None])[:, :, 0]
    lo, hi = q.data & 0xF, q.data >> 4
    canon = torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)
    assert torch.equal(repacked.view(torch.uint8), canon.to(torch.uint8))
    assert bool(((lo == 8) | (hi == 8)).any()), "the input should exercise -0 codes"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_activation_scales_pass_b12x_storage_check(fmt):
    """The swizzled activation scales gemm() hands b12x (kernels_cute._common.swizzled_scale of a
    linear-layout activation, as formats.quantize or the Triton quantizer give it) are the flat
    storage b12x's run-time check (scale_storage) accepts for any M, and decode to the oracle's
    scales. (Our CuTe quantizers write the same bytes directly: test_cute_quant.py, on a GPU.)"""
    from kernels_cute._common import swizzled_scale

    k = 512
    for m in (1, 8, 130):
        x = make_input((m, k), torch.bfloat16, device="cpu", generator=torch.Generator().manual_seed(m))
        ref = formats.quantize(x, fmt, role="activation")
        sfa = swizzled_scale(ref)
        assert torch.equal(_b12x_scale_matrix(sfa, m, k, 16 if fmt == "nvfp4" else 32), ref.scale.view(torch.uint8))


def test_fp8_block_weight_is_b12x_compact_layout():
    w = make_input((256, 512), torch.float32, device="cpu")
    q = formats.quantize(w, "fp8_block")
    p = kernels_cute.prepare_weight(q)
    assert p.scale.shape == (256 // 128, 512 // 128) and p.scale.dtype == torch.float32 and p.scale.is_contiguous()
    assert torch.equal(p.scale, q.scale) and torch.equal(p.data.view(torch.uint8), q.data.view(torch.uint8))


def test_reload_copies_into_existing_storage():
    """prepare_weight(q2, into=p) keeps p's tensors (addresses) and holds q2's bytes."""
    gen = torch.Generator().manual_seed(3)
    q1 = formats.quantize(make_input((256, 512), torch.float32, device="cpu", generator=gen), "nvfp4")
    q2 = formats.quantize(make_input((256, 512), torch.float32, device="cpu", generator=gen), "nvfp4")
    p = kernels_cute.prepare_weight(q1)
    ptrs = [t.data_ptr() for t in p.tensors().values()]
    out = kernels_cute.prepare_weight(q2, into=p)
    assert out is p and [t.data_ptr() for t in p.tensors().values()] == ptrs
    fresh = kernels_cute.prepare_weight(q2)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(p.tensors().values(), fresh.tensors().values()))
    q3 = formats.quantize(make_input((128, 512), torch.float32, device="cpu"), "nvfp4")
    with pytest.raises(ValueError, match="into="):
        kernels_cute.prepare_weight(q3, into=p)


def test_b12x_nvfp4_scale_rule_differs_from_the_oracle():
    """Why nvfp4 uses our quantizer: b12x's quantizers form the block scale as
    e4m3(amax * (1/6) * g); the oracle as e4m3((amax / 6) * g). They differ, e.g. here:"""
    amax = torch.tensor(0.00152587890625)  # a bf16 value
    g = torch.tensor(26.88)
    ours = formats.codecs.encode_e4m3((amax / 6) * g).view(torch.uint8)
    b12x_rule = formats.codecs.encode_e4m3((amax * (1 / 6)) * g).view(torch.uint8)
    assert int(ours) != int(b12x_rule)


def test_b12x_mxfp8_scale_rule_matches_the_oracle_except_zero_blocks():
    """b12x's MXFP8 scale rule (its torch twin pow2_ceil_ue8m0_torch(amax * (1/448))) gives the
    oracle's byte for every positive finite bf16 and fp16 amax; an all-zero block gets byte 0 there
    and the amax floor's byte here (docs/cute.md; why mxfp8 uses our CuTe DSL quantizer)."""
    from formats.codecs import ceil_log2

    for dt, top in ((torch.bfloat16, 0x7F80), (torch.float16, 0x7C00)):
        a = torch.arange(1, top, dtype=torch.int32).to(torch.int16).view(dt).float()
        _, b12x_byte = intr.pow2_ceil_ue8m0_torch(a * (1 / 448))
        oracle_byte = (ceil_log2(a / 448).clamp(-127, 127) + 127).to(torch.uint8)
        assert torch.equal(b12x_byte, oracle_byte), dt
    _, zero = intr.pow2_ceil_ue8m0_torch(torch.zeros(1))
    assert int(zero) == 0
    assert int(formats.quantize(torch.zeros(1, 32), "mxfp8", role="activation").scale) != 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"b12x pack_weight needs CUDA; found {device_name()}")
def test_packed_fp8_weights_decode_through_b12x_to_the_oracle():
    """mxfp8 / fp8_tensor: b12x's pack_weight output (CUDA, any GPU) holds the oracle's codes and
    scales: MXFP8 scale_mma read in the 6D MMA order equals the linear E8M0 bytes; tensor-FP8 keeps
    the codes and unit block scales."""
    w = make_input((256, 512), torch.float32, device="cuda")
    q = formats.quantize(w, "mxfp8")
    p = kernels_cute.prepare_weight(q)
    mma = p.packed.weight.scale_mma
    r = torch.arange(256, device="cuda").view(-1, 1)
    c = torch.arange(512 // 32, device="cuda").view(1, -1)
    got = mma[r % 32, (r // 32) % 4, r // 128, c % 4, c // 4, 0].contiguous().view(torch.uint8)
    assert torch.equal(got, q.scale)
    assert torch.equal(p.packed.weight.values[:, :512].view(torch.uint8), q.data.view(torch.uint8))
    qt = formats.quantize(w, "fp8_tensor")
    pt = kernels_cute.prepare_weight(qt)
    assert torch.equal(pt.packed.values.view(torch.uint8), qt.data.view(torch.uint8))
    assert float(pt.packed.output_scale) == float(qt.scale)


# ---------------------------------------------------------------------------------------------
# The prepared weight: frozen, checked once at prepare, what NVFP4 caches
# ---------------------------------------------------------------------------------------------
def test_prepared_weight_is_frozen_and_nvfp4_caches_the_reciprocal_global_scale():
    import dataclasses

    q = formats.quantize(make_input((256, 512), torch.float32, device="cpu"), "nvfp4")
    p = kernels_cute.prepare_weight(q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.scale = p.data
    # 1/g_w once at prepare, the same fp32 reciprocal the per-call alpha used to recompute
    assert p.inv_global_scale.shape == (1,) and p.inv_global_scale.dtype == torch.float32
    assert torch.equal(p.inv_global_scale, torch.reciprocal(q.global_scale.reshape(1)))
    q2 = formats.quantize(make_input((256, 512), torch.float32, device="cpu", generator=torch.Generator().manual_seed(9)),
                          "nvfp4")
    kernels_cute.prepare_weight(q2, into=p)  # a reload refreshes the cached reciprocal in place
    assert torch.equal(p.inv_global_scale, torch.reciprocal(q2.global_scale.reshape(1)))


@pytest.mark.parametrize("value", [0.0, float("nan"), -1.0, float("inf")])
def test_prepare_weight_refuses_a_bad_global_scale_value(value):
    import dataclasses

    q = formats.quantize(make_input((256, 512), torch.float32, device="cpu"), "nvfp4")
    bad = dataclasses.replace(q, global_scale=torch.tensor(value))
    with pytest.raises(ValueError, match="qweight.global_scale must be finite and > 0"):
        kernels_cute.prepare_weight(bad)


def test_prepare_weight_and_gemm_refuse_malformed_operands_before_b12x():
    """formats.validate runs at prepare (weight) and at every gemm() entry (xq): metadata only."""
    import dataclasses

    q = formats.quantize(make_input((256, 512), torch.float32, device="cpu"), "mxfp4")
    with pytest.raises(ValueError, match=r"qweight.scale must be uint8"):
        kernels_cute.prepare_weight(dataclasses.replace(q, scale=q.scale.float()))
    with pytest.raises(ValueError, match=r"qweight.data must have shape"):
        kernels_cute.prepare_weight(dataclasses.replace(q, shape=(256, 1024)))
    p = kernels_cute.prepare_weight(q)
    xq = formats.quantize(make_input((4, 512), torch.bfloat16, device="cpu"), "mxfp4", role="activation")
    with pytest.raises(ValueError, match=r"xq.scale must have shape \(4, 16\)"):
        kernels_cute.gemm(dataclasses.replace(xq, scale=xq.scale[:, :8]), p)
    with pytest.raises(ValueError, match=r"xq must be a mxfp4 activation, got nvfp4"):
        kernels_cute.gemm(formats.quantize(make_input((4, 512), torch.bfloat16, device="cpu"), "nvfp4",
                                           role="activation"), p)
    with pytest.raises(ValueError, match=r"xq has K=256 but qweight has K=512"):
        kernels_cute.gemm(formats.quantize(make_input((4, 256), torch.bfloat16, device="cpu"), "mxfp4",
                                           role="activation"), p)
    with pytest.raises(ValueError, match=r"out_dtype must be one of"):
        kernels_cute.gemm(xq, p, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(256,\)"):
        kernels_cute.gemm(xq, p, torch.zeros(3))
