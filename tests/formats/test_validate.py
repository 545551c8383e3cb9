"""formats.validate: every well-formed operand passes, and each malformed one of the bad-input classes in docs/errors.md
raises a ValueError naming the argument (and the field), instead of reaching a kernel."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import make_input

import formats
from formats import validate as V

FMTS = formats.FORMAT_NAMES
K = 256
N = 192  # not a multiple of 128: the fp8_block weight has a partial last block row


def weight(fmt, n=N, k=K, seed=0):
    return formats.quantize(make_input((n, k), torch.float32, device="cpu",
                                       generator=torch.Generator().manual_seed(seed)), fmt)


def act(fmt, m=5, k=K):
    return formats.quantize(make_input((m, k), torch.bfloat16, device="cpu"), fmt, role="activation")


def raises(fn, *words):
    """fn() raises ValueError whose message contains every word (in order)."""
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert re.search(".*".join(re.escape(w) for w in words), msg), msg
    return msg


@pytest.mark.parametrize("fmt", FMTS)
def test_good_operands_pass(fmt):
    w = weight(fmt)
    V.check_weight(w)
    V.check_weight(w, fmt, name="w")
    V.check_scale_values(w)
    xq = act(fmt)
    V.check_quantized_activation(xq, fmt, K, device="cpu")
    V.check_quantized_activation(act(fmt, m=0), fmt, K)
    V.check_activation(make_input((2, 3, K), device="cpu"), K, fmt, device="cpu")
    V.check_bias(torch.zeros(N), N, "cpu")
    V.check_bias(None, N, "cpu")
    if fmt in ("mxfp8", "nvfp4", "mxfp4"):  # 1-byte scales may come swizzled
        sw = dataclasses.replace(w, scale=formats.swizzle_128x4(w.scale), scale_layout="swizzled_128x4")
        V.check_weight(sw)
        raises(lambda: V.check_weight(sw, layouts=("linear",)), "qweight.scale_layout", "'swizzled_128x4'")


@pytest.mark.parametrize("fmt", ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "fp8_channel"))
def test_wrong_kind_format_role_raise(fmt):
    w = weight(fmt)
    other = "mxfp4" if fmt != "mxfp4" else "nvfp4"
    raises(lambda: V.check_weight(w, other), "qweight must be a", other, "got", fmt)
    raises(lambda: V.check_weight(act(fmt)), "qweight must be a formats.QuantizedTensor with role 'weight'", "activation")
    raises(lambda: V.check_weight(torch.zeros(2, 2), name="w"), "w must be a formats.QuantizedTensor", "Tensor")
    raises(lambda: V.check_quantized_activation(w, fmt), "xq must be", "role 'activation'")


def test_per_channel_scale_in_a_per_tensor_weight_raises():
    w = weight("fp8_tensor")
    bad = dataclasses.replace(w, scale=torch.full((N,), float(w.scale)))
    raises(lambda: V.check_weight(bad), "qweight.scale", "one per-tensor scale", f"({N},)")
    V.check_weight(dataclasses.replace(w, scale=w.scale.reshape(1)))  # [1] is one scale too


@pytest.mark.parametrize("fmt", ("fp8_block", "mxfp8", "nvfp4", "mxfp4"))
def test_too_few_scale_rows_or_columns_raise(fmt):
    w = weight(fmt)
    raises(lambda: V.check_weight(dataclasses.replace(w, scale=w.scale[:-1])), "qweight.scale must have shape",
           str(tuple(w.scale.shape)), str(tuple(w.scale[:-1].shape)))
    raises(lambda: V.check_weight(dataclasses.replace(w, scale=w.scale[:, :-1])), "qweight.scale must have shape",
           str(tuple(w.scale.shape)))
    xq = act(fmt)
    raises(lambda: V.check_quantized_activation(dataclasses.replace(xq, scale=xq.scale[:, :-1]), fmt),
           "xq.scale must have shape")
    if fmt != "fp8_block":  # a swizzled scale of the wrong size
        flat = formats.swizzle_128x4(w.scale)[:-512]
        bad = dataclasses.replace(w, scale=flat, scale_layout="swizzled_128x4")
        raises(lambda: V.check_weight(bad), "qweight.scale must be flat with", "128x4 swizzled")


@pytest.mark.parametrize("fmt", ("nvfp4",))
def test_e4m3_scales_stored_as_float32_raise(fmt):
    w = weight(fmt)
    bad = dataclasses.replace(w, scale=w.scale.float())
    raises(lambda: V.check_weight(bad), "qweight.scale must be float8_e4m3fn", "float32")


@pytest.mark.parametrize("fmt", ("mxfp8", "mxfp4"))
def test_e8m0_scales_stored_as_float32_powers_of_two_raise(fmt):
    w = weight(fmt)
    pow2 = torch.ldexp(torch.ones(w.scale.shape), w.scale.int() - 127)
    raises(lambda: V.check_weight(dataclasses.replace(w, scale=pow2)), "qweight.scale must be uint8", "E8M0", "float32")


@pytest.mark.parametrize("fmt", FMTS)
def test_bf16_in_place_of_codes_raises(fmt):
    w = weight(fmt)
    bf16 = make_input((N, K), torch.bfloat16, device="cpu")
    raises(lambda: V.check_weight(dataclasses.replace(w, data=bf16)), "qweight.data must be", "bfloat16")


@pytest.mark.parametrize("fmt", FMTS)
def test_declared_shape_larger_than_the_data_raises(fmt):
    w = weight(fmt)
    bigger_k = K + 256  # a multiple of every format's block
    raises(lambda: V.check_weight(dataclasses.replace(w, shape=(N + 128, K))), "qweight")
    msg = raises(lambda: V.check_weight(dataclasses.replace(w, shape=(N, bigger_k))), "qweight")
    assert "data" in msg or "scale" in msg, msg
    if formats.spec(fmt).k_multiple > 1:
        raises(lambda: V.check_weight(dataclasses.replace(w, shape=(N, K + 1))), "qweight.shape", "multiple")


@pytest.mark.parametrize("value", [0.0, float("nan"), -1.0, float("inf")])
def test_bad_global_scale_tensor_raises_where_the_weight_is_loaded(value):
    w = weight("nvfp4")
    bad = dataclasses.replace(w, global_scale=torch.tensor(value))
    V.check_weight(bad)  # metadata is fine: the value needs a read (a sync), done once at load
    raises(lambda: V.check_scale_values(bad), "qweight.global_scale must be finite and > 0", repr(value)
           if value != value or value in (float("inf"),) else str(value))


@pytest.mark.parametrize("fmt", ("fp8_tensor", "fp8_block"))
@pytest.mark.parametrize("value", [0.0, float("nan"), -2.0, float("inf")])
def test_bad_fp32_scale_values_raise(fmt, value):
    w = weight(fmt)
    s = w.scale.clone()
    s.view(-1)[0] = value
    raises(lambda: V.check_scale_values(dataclasses.replace(w, scale=s)), "qweight.scale must be finite and > 0")


def test_nan_or_negative_e4m3_and_e8m0_scale_codes_raise():
    w = weight("nvfp4")
    for byte in (0x7F, 0xFF, 0x90):
        s = w.scale.clone().view(torch.uint8)
        s[0, 0] = byte
        raises(lambda: V.check_scale_values(dataclasses.replace(w, scale=s.view(torch.float8_e4m3fn))), "qweight.scale")
    m = weight("mxfp4")
    s = m.scale.clone()
    s[1, 2] = 0xFF
    raises(lambda: V.check_scale_values(dataclasses.replace(m, scale=s)), "qweight.scale", "0xFF")


def test_missing_or_misshapen_global_scale_raises():
    w = weight("nvfp4")
    raises(lambda: V.check_weight(dataclasses.replace(w, global_scale=None)), "qweight.global_scale must be a float32", "None")
    raises(lambda: V.check_weight(dataclasses.replace(w, global_scale=torch.ones(2))), "qweight.global_scale", "(2,)")
    raises(lambda: V.check_weight(dataclasses.replace(w, global_scale=torch.ones((), dtype=torch.float64))),
           "qweight.global_scale", "float64")
    m = weight("mxfp4")
    raises(lambda: V.check_weight(dataclasses.replace(m, global_scale=torch.ones(()))), "qweight.global_scale must be None")


def test_block_shape_and_layout_must_be_the_formats():
    w = weight("fp8_block")
    raises(lambda: V.check_weight(dataclasses.replace(w, block_shape=(1, 128))), "qweight.block_shape", "(128, 128)")
    raises(lambda: V.check_weight(dataclasses.replace(w, scale_layout="swizzled_128x4")), "qweight.scale_layout")
    raises(lambda: V.check_weight(dataclasses.replace(w, scale_layout="tiled")), "qweight.scale_layout", "'tiled'")


def test_wrong_device_raises():
    meta = "meta"
    w = weight("nvfp4")
    raises(lambda: V.check_weight(dataclasses.replace(w, scale=w.scale.to(meta))), "qweight.scale must be on", "meta")
    raises(lambda: V.check_weight(dataclasses.replace(w, global_scale=w.global_scale.to(meta))),
           "qweight.global_scale must be on")
    xq = act("nvfp4")
    raises(lambda: V.check_quantized_activation(xq.to(meta), "nvfp4", K, device="cpu"), "xq must be on the weight's device")
    raises(lambda: V.check_activation(torch.empty(2, K, dtype=torch.bfloat16, device=meta), K, "nvfp4", device="cpu"),
           "x must be on the weight's device")
    raises(lambda: V.check_bias(torch.zeros(N, device=meta), N, "cpu"), "bias must be on")


def test_activation_and_bias_errors_name_the_argument():
    x = make_input((4, K))
    raises(lambda: V.check_activation(x.float(), K, "mxfp8"), "x must be bfloat16 or float16", "float32")
    raises(lambda: V.check_activation(x, K + 32, "mxfp8", name="inp"), "inp.shape[-1] must equal the weight's K=288", "256")
    raises(lambda: V.check_activation(make_input((4, 48)), None, "mxfp4"), "mxfp4 needs K (x.shape[-1])", "multiple of 32", "48")
    raises(lambda: V.check_activation(torch.tensor(1.0, dtype=torch.bfloat16), None, "fp8_tensor"), "x must have shape [..., K]")
    raises(lambda: V.check_activation([1.0], None, "fp8_tensor"), "x must be a torch.Tensor", "list")
    raises(lambda: V.check_bias(torch.zeros(N + 1), N, "cpu"), f"bias must be a tensor of shape ({N},)", f"({N + 1},)")
    raises(lambda: V.check_bias(torch.zeros(N, dtype=torch.int32), N, "cpu"), "bias must be float32", "int32")
    raises(lambda: V.check_quantized_activation(act("mxfp8", k=128), "mxfp8", K), "xq has K=128", "K=256")
