"""A bad argument of a whole linear call is reported as a bad argument: a ValueError naming the
argument, the value found and what is allowed, raised before any implementation is asked whether it
can serve the call (so it never reads as a device problem), by dispatch.linear, QuantLinear and
every backend's apply, under every implementation request. Positive controls check that the
allowed calls still give the oracle's values."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import formats
from dispatch import QuantLinear, linear, registry
from dispatch.api import device_of
from dispatch.backends import copy_quantized_into
from dispatch.policy import ImplementationUnavailable

from conftest import DEVICE, device_name

N, K = 64, 256
REQUESTS = ("auto", "reference", "triton", "cute")
# What each request takes: the forced implementation's dtypes; under auto the union over the
# priority list (the reference also takes float32).
ALLOWED = {"auto": "bfloat16, float16, float32", "reference": "bfloat16, float16, float32",
           "triton": "bfloat16, float16", "cute": "bfloat16, float16"}


def _qweight(fmt: str = "nvfp4", seed: int = 0) -> formats.QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    return formats.quantize(torch.randn(N, K, generator=g).to(DEVICE), fmt, role="weight")


def _x(dtype=torch.bfloat16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, K, generator=g).to(device=DEVICE, dtype=dtype)


def _entry_points(qw, request: str):
    """(name, call(x, bias)) of dispatch.linear and QuantLinear under ``request``."""
    impl = None if request == "auto" else request
    layer = QuantLinear(qw, impl=impl)
    return [("dispatch.linear", lambda x, b=None: linear(x, qw, b, impl=request)),
            ("QuantLinear", lambda x, b=None: (setattr(layer, "bias", b), layer(x))[1])]


def _raises_value_error(fn, pattern: str) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    assert not isinstance(e.value, ImplementationUnavailable), f"a bad argument read as a device problem: {e.value}"
    assert re.search(pattern, str(e.value)), str(e.value)
    return str(e.value)


def _applicable_backends(qw):
    """(impl, backend, prepared) for every backend the registry says serves the call on this
    device: reference and triton everywhere, cute only on an SM120/SM121 GPU with b12x."""
    dev = device_of(_x())
    problem = registry.Problem("nvfp4", 3, N, K, torch.bfloat16)
    out = []
    for impl in ("reference", "triton", "cute"):
        b = registry.get(impl, "nvfp4")
        if registry.verdict(b, problem, dev)[0]:
            out.append((impl, b, b.prepare(qw)))
    return out


@pytest.mark.parametrize("request_", REQUESTS)
def test_a_wrong_activation_dtype_names_x_its_dtype_and_the_allowed_ones(request_):
    qw = _qweight()
    for name, call in _entry_points(qw, request_):
        _raises_value_error(lambda: call(_x(torch.float64)),
                            rf"^x must be one of \({ALLOWED[request_]}\) here, got dtype float64$")
        _raises_value_error(lambda: call(_x(torch.int32)),
                            rf"x must be one of \({ALLOWED[request_]}\) here, got dtype int32")
    if request_ in ("triton", "cute"):
        for name, call in _entry_points(qw, request_):
            _raises_value_error(lambda: call(_x(torch.float32)),
                                r"x must be one of \(bfloat16, float16\) here, got dtype float32")


def test_every_backends_apply_names_a_wrong_activation_dtype():
    qw = _qweight()
    backends = _applicable_backends(qw)
    assert {impl for impl, _, _ in backends} >= {"reference", "triton"}
    for impl, b, prepared in backends:
        _raises_value_error(lambda: b.apply(_x(torch.float64), prepared),
                            rf"x must be one of \({ALLOWED[impl]}\) here, got dtype float64")


def test_float32_is_served_by_the_reference_with_the_oracles_values():
    # positive control of the dtype check: the reference takes float32 and computes exactly what
    # formats.reference_linear computes (the same float64 product, rounded once to float32)
    qw, x = _qweight(), _x(torch.float32)
    want = formats.reference_linear(x, qw)
    for _, call in _entry_points(qw, "reference"):
        y = call(x)
        assert y.dtype == torch.float32 and torch.equal(y, want)


@pytest.mark.parametrize("request_", REQUESTS)
def test_a_quantized_tensor_as_x_is_named(request_):
    qw = _qweight()
    xq = formats.quantize(_x(), "nvfp4", role="activation")
    for _, call in _entry_points(qw, request_):
        _raises_value_error(lambda: call(xq), r"x must be an unquantized float tensor \[\.\.\., K\], got a "
                                              r"formats\.QuantizedTensor \(nvfp4 activation of shape \(3, 256\)\)")
    for _, b, prepared in _applicable_backends(qw):
        _raises_value_error(lambda: b.apply(xq, prepared), r"got a formats\.QuantizedTensor")


@pytest.mark.parametrize("request_", ("auto", "reference", "triton"))
def test_a_weight_on_the_meta_device_is_refused_never_nan_or_zeros(request_):
    meta = _qweight().to("meta")
    _raises_value_error(lambda: linear(_x(), meta, impl=request_), r"qweight is on the meta device")
    _raises_value_error(lambda: formats.reference_linear(_x(), meta), r"qweight is on the meta device")
    _raises_value_error(lambda: QuantLinear(meta), r"meta device")
    _raises_value_error(lambda: registry.get(request_ if request_ != "auto" else "reference", "nvfp4").prepare(meta),
                        r"qweight is on the meta device")


@pytest.mark.parametrize("request_", ("auto", "reference", "triton"))
def test_a_bias_or_x_on_the_meta_device_is_named(request_):
    qw = _qweight()
    bias = torch.zeros(N, device="meta")
    for _, call in _entry_points(qw, request_):
        _raises_value_error(lambda: call(_x(), bias), rf"^bias must be on {DEVICE}\S*, got meta$")
        _raises_value_error(lambda: call(torch.empty(3, K, dtype=torch.bfloat16, device="meta")),
                            r"^x is on the meta device")
    _raises_value_error(lambda: formats.reference_linear(_x(), qw, bias), r"^bias is on the meta device")


def test_prepare_into_names_both_layouts_and_refuses_meta_storage():
    for impl in ("reference", "triton"):
        b = registry.get(impl, "fp8_block")
        old, new = b.prepare(_qweight("fp8_block", 0)), _qweight("fp8_block", 1)
        other = dataclasses.replace(old, scale=old.scale.double())
        msg = _raises_value_error(lambda: b.prepare(new, into=other),
                                  r"into= must be a fp8_block weight of shape \(64, 256\)")
        assert "scale float32 (1, 2)" in msg and "scale float64 (1, 2)" in msg, msg  # what is expected, what came
        _raises_value_error(lambda: b.prepare(new, into=old.to("meta")),
                            r"into= has storage on the meta device \(data, scale\)")
        # the refusals changed nothing; a good into= takes the new values in place
        assert b.prepare(new, into=old) is old and torch.equal(old.data.view(torch.uint8), new.data.view(torch.uint8))
    _raises_value_error(lambda: copy_quantized_into("storage", _qweight()),
                        r"into= must be a nvfp4 weight QuantizedTensor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"cute apply needs a GPU; {device_name()}")
def test_cute_apply_names_a_wrong_dtype_where_it_runs():
    qw = _qweight()
    impls = [impl for impl, _, _ in _applicable_backends(qw)]
    if "cute" not in impls:
        pytest.skip(f"cute does not run here ({device_name()})")
    _, b, prepared = next(t for t in _applicable_backends(qw) if t[0] == "cute")
    _raises_value_error(lambda: b.apply(_x(torch.float32), prepared), r"x must be one of \(bfloat16, float16\) here")


def test_a_quantlinear_act_dtype_its_implementation_does_not_take_is_named():
    # act_dtype casts x for the call: the cast dtype is what the implementation must take
    qw = _qweight()
    layer = QuantLinear(qw, impl="triton", act_dtype=torch.float32)
    _raises_value_error(lambda: layer(_x()), r"^act_dtype must be one of \(bfloat16, float16\) here, got float32$")
    ok = QuantLinear(qw, impl="reference", act_dtype=torch.float32)  # the reference takes float32
    y = ok(_x())
    assert y.dtype == torch.bfloat16 and torch.equal(y, formats.reference_linear(_x().float(), qw).to(torch.bfloat16))
