"""dispatch.bound.BoundLinear: one bound call under dispatch.linear, QuantLinear and the vLLM op.

One cache (prepare runs once per backend on each path), the decision per M bucket, the request read
once per call, x validated once at the door and never again on the trusted path, a reload that
keeps every prepared address, a sealed layer that refuses a changed request by name, and a bare
weight that the cache does not keep alive. Values are checked against formats.reference_linear.
"""

from __future__ import annotations

import gc
import re
import sys
import types
import weakref

import pytest
import torch

import formats
from dispatch import QuantLinear, linear, policy, registry
from dispatch.bound import BoundLinear, bound_weight
from dispatch.contract import DECODE_MAX_M, M_BUCKETS, MAX_BUCKET_M, m_bucket
from dispatch.devices import CPU, current_device, interpreting
from dispatch.vllm_plugin import ops

from conftest import DEVICE

N, K = 64, 256
# The Triton kernels run here: the CPU under the interpreter (CI), else the GPU.
HERE = CPU if interpreting() else current_device()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No B12X_IMPL from the environment, a fresh decision cache."""
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _qweight(fmt: str = "nvfp4", seed: int = 0) -> formats.QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    return formats.quantize((torch.randn(N, K, generator=g) * 0.05).to(DEVICE), fmt, role="weight")


def _x(m: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, K, generator=g).to(device=DEVICE, dtype=torch.bfloat16)


def _layer_state(qw, variant: str = "nvfp4", name: str = "test.layer") -> ops.LayerState:
    """A vLLM layer's state as the plugin's load makes it: every M bucket's backend prepared, sealed."""
    st = ops.LayerState(qw, variant, name=name, device=current_device(qw.device), dtype=torch.bfloat16)
    st.prepare_buckets()
    st.seal()
    return st


def _op(st: ops.LayerState, x: torch.Tensor, bias=None) -> torch.Tensor:
    return torch.ops.b12x_dual.linear(x, bias, ops.new_handle(st), st.n)


def _count(monkeypatch, name: str) -> list:
    """Count the calls of function ``name`` wherever a loaded dispatch / formats / kernels module
    holds it (modules bind it by name at import): returns the list each call appends to."""
    calls: list = []
    original = None
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").split(".")[0] in ("dispatch", "formats", "kernels_triton", "kernels_cute"):
            fn = getattr(mod, name, None)
            if callable(fn):
                original = original or fn

                def counted(*a, _fn=fn, **k):
                    calls.append(a)
                    return _fn(*a, **k)

                monkeypatch.setattr(mod, name, counted)
    assert original is not None, f"no loaded module holds {name}"
    return calls


@pytest.fixture
def prepares(monkeypatch):
    """{backend name: prepare calls} of the reference and triton backends."""
    counts: dict[str, int] = {}
    for impl in ("reference", "triton"):
        cls = type(registry.get(impl, "nvfp4"))

        def prepare(self, qweight, into=None, _orig=cls.prepare):
            counts[self.name] = counts.get(self.name, 0) + 1
            return _orig(self, qweight, into)

        monkeypatch.setattr(cls, "prepare", prepare)
    return counts


# ---------------------------------------------------------------------------------------------
# One cache
# ---------------------------------------------------------------------------------------------
def test_linear_prepares_once_per_backend_and_computes_the_oracles_values(prepares):
    # The reference backend computes formats.reference_linear exactly (same float64 product, one
    # rounding), so equality is the bound; triton is checked against it in test_registry.
    qw, x = _qweight(), _x()
    for _ in range(3):
        for impl in ("reference", "triton"):
            y = linear(x, qw, impl=impl)
            if impl == "reference":
                assert torch.equal(y, formats.reference_linear(x, qw))
    assert prepares == {"reference:nvfp4": 1, "triton:nvfp4": 1}
    assert set(bound_weight(qw, "nvfp4").backends) == {"reference:nvfp4", "triton:nvfp4"}


def test_quantlinear_prepares_once_per_backend(prepares):
    layer, x = QuantLinear(_qweight()), _x()
    for _ in range(3):
        for impl in ("reference", "triton"):
            with policy.use_impl(impl):
                layer(x)
    assert prepares == {"reference:nvfp4": 1, "triton:nvfp4": 1}
    assert set(layer._bound.backends) == {"reference:nvfp4", "triton:nvfp4"}


def _auto_keys() -> set:
    """The backends auto chooses here over every M bucket (a CPU: triton, the interpreter; an H200:
    hopper), from the registry."""
    return {f"{registry.choose('nvfp4', m, N, K, HERE).impl}:nvfp4" for m in M_BUCKETS}


def test_the_op_prepares_at_load_only(prepares):
    st = _layer_state(_qweight())
    want = _auto_keys()
    assert not interpreting() or want == {"triton:nvfp4"}  # a CPU: every bucket is the lesson's
    assert prepares == dict.fromkeys(want, 1) and set(st.backends) == want
    for m in (1, 16, 17, 40):
        assert _op(st, _x(m)).shape == (m, N)
    assert prepares == dict.fromkeys(want, 1)


def test_a_bare_weight_is_not_kept_alive_by_its_bound_cache():
    # The cache of a weakly bound weight stores a marker, not the weight, where prepare returned the
    # weight itself (reference, triton): dropping the caller's weight frees it and its entry.
    qw, x = _qweight(), _x()
    linear(x, qw, impl="triton")
    key = (id(qw), "nvfp4")
    from dispatch import bound as B

    assert key in B._BARE
    ref = weakref.ref(qw)
    del qw
    gc.collect()
    assert ref() is None and key not in B._BARE


# ---------------------------------------------------------------------------------------------
# M buckets
# ---------------------------------------------------------------------------------------------
def test_m_buckets_are_one_definition_covering_every_m_up_to_2_20():
    assert ops.LOAD_M is M_BUCKETS
    assert [m_bucket(m) for m in M_BUCKETS] == list(M_BUCKETS)  # each M is its bucket's own value
    assert M_BUCKETS[:DECODE_MAX_M] == tuple(range(1, DECODE_MAX_M + 1)) and M_BUCKETS[-1] == MAX_BUCKET_M
    buckets = set(M_BUCKETS)
    for e in range(21):  # powers of two and their neighbours: every bucket boundary up to 2^20
        for m in (2**e - 1, 2**e, 2**e + 1):
            if 1 <= m <= MAX_BUCKET_M:
                assert m_bucket(m) in buckets, m


def test_the_bound_choice_is_the_registrys_decision_per_m_bucket():
    b = BoundLinear(_qweight(), "nvfp4", device=HERE)
    assert b.choice(17) is b.choice(32) is registry.choose("nvfp4", 20, N, K, HERE)  # 17..32: one bucket
    assert b.choice(33) is not b.choice(32)
    assert b.choice(16) is not b.choice(15)  # decode Ms are buckets of their own
    assert b.choice(17, request=policy.Request("reference", "impl=")).impl == "reference"


def test_a_sealed_layer_serves_every_bucket_and_refuses_a_changed_request_by_name(monkeypatch):
    st = _layer_state(_qweight(), name="model.layers.0.o_proj")
    x = _x(5)
    want = _op(st, x)
    prepared = re.escape(str(sorted(_auto_keys())))
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    with pytest.raises(RuntimeError, match=r"layer model\.layers\.0\.o_proj \(nvfp4, N=64, K=256\) was prepared for "
                                           + prepared + r", but a 5-token call now chooses reference:nvfp4 "
                                           r"\(B12X_IMPL=reference\).*must not change after the model is loaded"):
        _op(st, x)
    monkeypatch.delenv(policy.ENV_VAR)
    assert torch.equal(_op(st, x), want)


# ---------------------------------------------------------------------------------------------
# The request read once, x validated once
# ---------------------------------------------------------------------------------------------
class _CountingEnv(dict):
    def __init__(self, env, reads):
        super().__init__(env)
        self.reads = reads

    def get(self, key, default=None):
        if key == policy.ENV_VAR:
            self.reads.append(key)
        return super().get(key, default)


def test_b12x_impl_is_read_once_per_call(monkeypatch):
    import os

    monkeypatch.setenv(policy.ENV_VAR, "triton")
    reads: list = []
    monkeypatch.setattr(policy, "os", types.SimpleNamespace(environ=_CountingEnv(os.environ, reads)))
    qw, x = _qweight(), _x()
    layer, st = QuantLinear(qw), _layer_state(qw)
    for name, call in (("dispatch.linear", lambda: linear(x, qw)), ("QuantLinear", lambda: layer(x)),
                       ("the vLLM op", lambda: _op(st, x))):
        call()  # the first call of each path prepares; the count is of a call like every other
        reads.clear()
        call()
        assert len(reads) == 1, (name, len(reads))


def test_x_is_validated_once_at_the_door_and_never_on_the_trusted_path(monkeypatch):
    qw, x = _qweight(), _x()
    layer, st = QuantLinear(qw), _layer_state(qw)
    for path in (lambda: linear(x, qw), lambda: layer(x), lambda: _op(st, x)):
        path()  # warm: prepare and decide
    calls = _count(monkeypatch, "check_linear_input")
    for name, path, want in (("dispatch.linear", lambda: linear(x, qw), 1), ("QuantLinear", lambda: layer(x), 1),
                             ("the vLLM op (checked at load)", lambda: _op(st, x), 0)):
        calls.clear()
        path()
        assert len(calls) == want, (name, len(calls))
    # the public Backend.apply keeps its own check for direct callers
    b = registry.get("triton", "nvfp4")
    calls.clear()
    b.apply(x, b.prepare(qw))
    assert len(calls) == 1


def test_the_trusted_path_runs_the_kernels_linear_unchecked(monkeypatch):
    # Backend.run calls the kernel module's trusted entry where it has one (kernels_cute's modules
    # do; kernels_triton's get theirs beside their linear), and its linear otherwise.
    import kernels_triton

    mod = kernels_triton.module("nvfp4")
    seen = []

    def spy(*a, _target=getattr(mod, "linear_unchecked", mod.linear), **k):
        seen.append(a[0].shape)
        return _target(*a, **k)

    monkeypatch.setattr(mod, "linear_unchecked", spy, raising=False)
    qw, x = _qweight(), _x()
    y = linear(x, qw, impl="triton")
    assert seen == [x.shape]
    assert torch.equal(y, kernels_triton.module("nvfp4").linear(x, qw))


# ---------------------------------------------------------------------------------------------
# Reload, act_dtype, names
# ---------------------------------------------------------------------------------------------
def test_reload_keeps_every_prepared_address_and_serves_the_new_weight():
    old, new = _qweight(seed=0), _qweight(seed=1)
    b = BoundLinear(old, "nvfp4")
    x = _x()
    for impl in ("reference", "triton"):
        b(x, impl=impl)
    ptrs = {n: [t.data_ptr() for t in p.tensors().values()] for n, (_, p) in b.backends.items()}
    b.reload(new)
    assert {n: [t.data_ptr() for t in p.tensors().values()] for n, (_, p) in b.backends.items()} == ptrs
    assert torch.equal(b(x, impl="reference"), formats.reference_linear(x, new))
    with pytest.raises(ValueError, match=r"a reload must keep the format and shape: nvfp4 \(64, 256\), got mxfp4"):
        b.reload(_qweight("mxfp4"))


def test_act_dtype_casts_x_for_the_call_and_the_door_names_a_bad_one():
    qw = _qweight()
    x = _x().float()
    b = BoundLinear(qw, "nvfp4", impl="reference", act_dtype=torch.bfloat16)
    y = b(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, formats.reference_linear(x.to(torch.bfloat16), qw))
    with pytest.raises(ValueError, match=r"^act_dtype must be one of \(bfloat16, float16\) here, got float32$"):
        BoundLinear(qw, "nvfp4", impl="triton", act_dtype=torch.float32)(x)
    with pytest.raises(ValueError, match=r"variant 'mxfp4' needs a mxfp4 weight, got a nvfp4 one"):
        BoundLinear(qw, "mxfp4")


def test_a_bound_option_is_checked_once_per_backend_before_it_is_prepared(prepares):
    b = BoundLinear(_qweight(), "nvfp4", act_opts={"scale_rule": "ceil"})
    with pytest.raises(ValueError, match=r"triton:nvfp4: unknown option\(s\) \['scale_rule'\]"):
        b(_x(), impl="triton")
    assert prepares == {} and b.backends == {}  # nothing prepared, so the next call checks again
    with pytest.raises(ValueError, match="unknown option"):
        b(_x(), impl="triton")


def test_quantlinear_names_its_bound_call_for_the_watchdog():
    layer = QuantLinear(_qweight())
    assert layer._bound.name == layer.b12x_name == f"QuantLinear(64x256)@{id(layer):x}"
    layer.b12x_name = "encoder.up"
    assert layer._bound.name == "encoder.up"
    layer(_x())
    layer.to(DEVICE)  # rebinding (new buffers) keeps the name and the last implementation
    assert layer._bound.name == "encoder.up" and layer.last_impl is not None


# ---------------------------------------------------------------------------------------------
# The old names, kept for one release (docs/dispatch.md)
# ---------------------------------------------------------------------------------------------
def test_the_old_names_still_work(monkeypatch):
    import dispatch
    from dispatch import api, backends, describe

    qw, x = _qweight(), _x()
    b = registry.get("triton", "nvfp4")
    assert registry.check is registry.verdict and registry.m_bucket is m_bucket
    bad = r"^x must be one of \(bfloat16, float16\) here, got dtype float64$"
    with pytest.raises(ValueError, match=bad):
        api.check_input(x.double(), "nvfp4", K, "triton")
    with pytest.raises(ValueError, match=bad):
        backends.check_call(b, x.double(), qw, None)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['scale_rule'\]"):
        b.check_options({"scale_rule": "ceil"})
    with pytest.warns(DeprecationWarning, match="REQUESTS"):
        assert dispatch.IMPLS == ("auto", "cute", "hopper", "triton", "reference") == dispatch.REQUESTS
    with pytest.warns(DeprecationWarning, match="REQUESTS"):
        assert policy.IMPLS == policy.REQUESTS
    assert registry.IMPLS == ("cute", "hopper", "triton", "reference")
    assert (api.tokens(x), api.device_of(x), api.act_dtypes("nvfp4", "triton")) == (3, current_device(x.device),
                                                                                       (torch.bfloat16, torch.float16))
    assert (api.library_versions, api.describe_device, api.route_text) == (
        describe.library_versions, describe.describe_device, describe.route_text)
    if x.device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(policy.ImplementationUnavailable, match="CPU tensors need Triton's interpreter"):
            b.check_tensor_device(x)


def test_a_quantlinear_copies_and_pickles_bound_to_its_own_buffers():
    import copy

    layer, x = QuantLinear(_qweight(), impl="triton"), _x()
    layer.b12x_name = "encoder.up"
    y = layer(x)
    for other in (copy.deepcopy(layer), _reloaded(layer)):
        assert other._bound.qweight.data.data_ptr() == other.weight_data.data_ptr() != layer.weight_data.data_ptr()
        assert (other.b12x_name, other.last_impl, other._bound.backends) == ("encoder.up", "triton", {})
        assert torch.equal(other(x), y)


def _reloaded(module):
    import io

    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
