"""The implementation table through the registry: every known device x variant x shape class,
B12X_IMPL, forced errors. The cute rows use kernels_cute's real, pure shape predicates (no stub)."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels_cute
from dispatch import api, backends, policy, registry
from dispatch.devices import CPU, KNOWN_DEVICES, DeviceInfo, current_device, interpreting
from dispatch.policy import ImplementationUnavailable, InvalidImplementation, use_impl
from dispatch.registry import choose

VARIANTS = tuple(registry.VARIANTS)
SHAPES = {"decode M=1": (1, 4096, 4096), "decode M=16": (16, 4096, 4096), "prefill M=4096": (4096, 4096, 4096)}
SM12X = tuple(k for k, d in KNOWN_DEVICES.items() if d.is_sm12x)
SM90 = tuple(k for k, d in KNOWN_DEVICES.items() if d.capability == (9, 0))
# Where the Triton kernels run in this process: the CPU under the interpreter (CI), else the GPU.
HERE = CPU if interpreting() else current_device()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No B12X_IMPL from the environment, a fresh decision cache and log."""
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _b12x(monkeypatch, installed: bool, version: str = "1.5.1"):
    probe = backends.B12xProbe(object(), version, None) if installed else \
        backends.B12xProbe(None, None, "ModuleNotFoundError: No module named 'b12x'")
    monkeypatch.setattr(backends, "b12x_probe", lambda: probe)


def _needs_b12x():
    """Skip, naming what is missing, where b12x's GEMMs cannot be imported (the cute backend then
    refuses every call with that reason, whatever the probe says)."""
    err = kernels_cute._common.b12x_import_error()
    if err:
        pytest.skip(f"needs b12x with CuTe DSL importable for the cute rows: {err}")


def _cute_shape_rule(variant, M, N, K):
    """kernels_cute's own predicate for the shape (the production rule, called directly)."""
    spec = registry.VARIANTS[variant]
    if kernels_cute.not_served(variant):
        return False, f"cute does not implement {variant}: {kernels_cute.not_served(variant)}"
    mod = kernels_cute.module(spec.fmt)
    return mod.supported(M, N, K, a16=True) if spec.a16 else mod.supported(M, N, K)


# ---------------------------------------------------------------------------------------------
# The table: every device x variant x shape class
# ---------------------------------------------------------------------------------------------
def _expected_without_b12x(key, variant="fp8_tensor"):
    """(implementation auto picks, the reasons of the ones skipped before it, "" for none): the
    device's priority list, each declared-unsupported cell skipped with its reason, cute skipped
    for the missing b12x, triton on the CPU skipped where the interpreter is off (a GPU machine)."""
    skipped = []
    for impl in registry.priority(KNOWN_DEVICES[key]):
        entry = registry.entries()[(impl, variant)]
        if isinstance(entry, registry.UnsupportedEntry):
            skipped.append(f"{impl} does not implement {variant}: {entry.reason}")
        elif impl == "cute":
            skipped.append("b12x is not installed (ModuleNotFoundError: No module named 'b12x'); "
                           "install it with: pip install 'b12x-dual[cute]'")
        elif impl == "triton" and key == "cpu" and not interpreting():
            # on a GPU machine the interpreter is off, so CPU tensors can only go to the oracle
            skipped.append(registry.get("triton", "fp8_tensor").is_supported(CPU)[1])
        else:
            return impl, "; ".join(skipped)
    raise AssertionError(f"nothing serves {variant} on {key}")


def _needs_hopper(variant="fp8_tensor"):
    """Skip, naming the module, where kernels_triton.hopper is not in this installation."""
    ok, why = registry.get("hopper", variant).is_supported(KNOWN_DEVICES["h200"])
    if not ok:
        pytest.skip(f"needs kernels_triton.hopper: {why}")


def _reason_of(impl, variant, M, N, K, dev):
    ok, why = registry.verdict(registry.entries()[(impl, variant)], registry.Problem(variant, M, N, K), dev)
    assert ok
    return why


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_auto_without_b12x_picks_triton_everywhere_and_says_why(monkeypatch, key, variant, shape):
    _b12x(monkeypatch, installed=False)
    M, N, K = SHAPES[shape]
    dev = KNOWN_DEVICES[key]
    if key in SM90:
        _needs_hopper()
    c = choose(variant, M, N, K, dev)
    impl, skipped = _expected_without_b12x(key, variant)
    assert c.impl == impl
    own = _reason_of(impl, variant, M, N, K, dev)
    assert c.reason == (f"{skipped}; {own}" if skipped else own)
    assert (c.requested, c.source) == ("auto", "default")
    assert [name for name, _, _ in c.considered] == list(registry.priority(dev)[:len(c.considered)])


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_auto_with_b12x_picks_cute_on_sm12x_for_the_supported_set(monkeypatch, key, variant, shape):
    _b12x(monkeypatch, installed=True)
    M, N, K = SHAPES[shape]
    dev = KNOWN_DEVICES[key]
    if key in SM90:
        _needs_hopper()
    if key not in SM12X:
        assert choose(variant, M, N, K, dev).impl == _expected_without_b12x(key, variant)[0]
        return
    _needs_b12x()
    c = choose(variant, M, N, K, dev)
    head = f"b12x 1.5.1 targets {dev.arch} (described device, not probed)"
    ok, why = _cute_shape_rule(variant, M, N, K)
    after_cute = next(i for i in registry.priority(dev)[1:]
                      if not isinstance(registry.entries()[(i, variant)], registry.UnsupportedEntry))
    assert c.impl == ("cute" if ok else after_cute)
    assert c.considered[0] == ("cute", ok, f"{head}; {why}" if ok else why)


def test_an_unaligned_shape_on_sm12x_goes_to_triton_with_kernels_cute_reason(monkeypatch):
    _b12x(monkeypatch, installed=True)
    _needs_b12x()
    c = choose("nvfp4", 16, 4100, 4096, KNOWN_DEVICES["gb10"])
    assert c.impl == "triton"
    assert c.reason.startswith("nvfp4: b12x needs N % 8 == 0, got N=4100; ")
    with pytest.raises(ImplementationUnavailable, match=r"b12x needs N % 8 == 0, got N=4100"):
        choose("nvfp4", 16, 4100, 4096, KNOWN_DEVICES["gb10"], impl="cute")


def test_auto_without_the_triton_module_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setattr(backends, "_triton_module_present", lambda fmt: fmt != "mxfp8")
    c = choose("mxfp8", 16, 256, 256, CPU)
    assert c.impl == "reference"
    assert "kernels_triton.mxfp8 is not in this installation" in c.reason
    with pytest.raises(ImplementationUnavailable, match="kernels_triton.mxfp8 is not in this installation"):
        choose("mxfp8", 16, 256, 256, CPU, impl="triton")


def test_auto_with_nothing_that_serves_lists_every_reason():
    # K = 100 is not a multiple of any format's block: every backend refuses, each says why, in
    # the order of the sm_90 priority list (hopper, triton, reference).
    with pytest.raises(registry.NoBackend) as e:
        choose("nvfp4", 4, 64, 100, KNOWN_DEVICES["h200"])
    msg = str(e.value)
    hopper_why = registry.verdict(registry.entries()[("hopper", "nvfp4")], registry.Problem("nvfp4", 4, 64, 100),
                                KNOWN_DEVICES["h200"])[1]
    lines = [f"hopper: {hopper_why}",
             "triton: triton: nvfp4 needs K to be a positive multiple of 16, got K=100",
             "reference: reference: nvfp4 needs K to be a positive multiple of 16, got K=100"]
    assert msg.endswith("; ".join(lines))
    assert "cute" not in msg  # not in the sm_90 priority list


# ---------------------------------------------------------------------------------------------
# Forced implementations
# ---------------------------------------------------------------------------------------------
def test_forced_cute_on_this_cpu_raises_naming_impl_device_and_reason():
    with pytest.raises(ImplementationUnavailable) as e:
        choose("nvfp4", 16, 4096, 4096, CPU, impl="cute")
    assert (e.value.impl, e.value.device) == ("cute", CPU)
    assert str(e.value) == ("implementation 'cute' cannot serve this call on CPU (Triton interpreter) "
                            "(no CUDA device): cute needs an SM120/SM121 GPU; this call runs on the CPU")
    assert isinstance(e.value, ValueError)


def test_forced_cute_through_the_environment_on_a_real_call_raises(monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "cute")
    qw = api.quantize_weight(torch.randn(64, 128), "fp8_block")
    with pytest.raises(ImplementationUnavailable, match="'cute' cannot serve this call on CPU"):
        api.linear(torch.randn(2, 128, dtype=torch.bfloat16), qw)


def test_forced_cute_on_sm12x_without_b12x_says_how_to_install(monkeypatch):
    _b12x(monkeypatch, installed=False)
    with pytest.raises(ImplementationUnavailable, match=r"RTX 5090 \(sm_120, 170 SMs\).*pip install 'b12x-dual\[cute\]'"):
        choose("mxfp8", 16, 4096, 4096, KNOWN_DEVICES["rtx_5090"], impl="cute")


def test_forced_cute_outside_the_supported_set_raises_with_kernels_cute_reason(monkeypatch):
    _b12x(monkeypatch, installed=True)
    _needs_b12x()
    with pytest.raises(ImplementationUnavailable, match=r"mxfp4: b12x needs K % 256 == 0, got K=4160"):
        choose("mxfp4", 8, 4096, 4160, KNOWN_DEVICES["gb10"], impl="cute")
    with pytest.raises(ImplementationUnavailable, match="b12x 1.5.1 has no W4A16 kernel for MXFP4"):
        choose("mxfp4_w4a16", 8, 4096, 4096, KNOWN_DEVICES["gb10"], impl="cute")
    assert choose("mxfp4", 4096, 4096, 4096, KNOWN_DEVICES["gb10"], impl="cute").impl == "cute"


def test_forced_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ImplementationUnavailable, match="TRITON_INTERPRET='0'"):
        choose("nvfp4", 1, 64, 64, CPU, impl="triton")


@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_forced_reference_serves_every_device(key):
    c = choose("mxfp4_w4a16", 1, 64, 64, KNOWN_DEVICES[key], impl="reference")
    assert (c.impl, c.requested, c.source) == ("reference", "reference", "impl=")


def test_a16_is_only_defined_for_the_fp4_formats_and_mxfp8():
    assert registry.variant_name("nvfp4", True) == "nvfp4_w4a16"
    assert registry.variant_name("mxfp4", True) == "mxfp4_w4a16"
    assert registry.variant_name("mxfp8", True) == "mxfp8_w8a16"
    with pytest.raises(ValueError, match=r"a16=True \(weight-only W4A16 / W8A16\) is defined for "
                                         r"\['mxfp4', 'mxfp8', 'nvfp4'\], not 'fp8_tensor'"):
        registry.variant_name("fp8_tensor", True)
    with pytest.raises(ValueError, match="format must be one of"):
        choose("int8", 1, 64, 64, CPU)


# ---------------------------------------------------------------------------------------------
# B12X_IMPL, use_impl, impl=
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,parsed", [("auto", "auto"), ("CUTE", "cute"), (" triton ", "triton"),
                                        ("Reference", "reference"), ("Hopper", "hopper")])
def test_b12x_impl_values_are_case_and_blank_insensitive(monkeypatch, raw, parsed):
    monkeypatch.setenv(policy.ENV_VAR, raw)
    assert policy.requested_impl() == (parsed, "B12X_IMPL")


def test_empty_b12x_impl_means_auto(monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "")
    assert policy.requested_impl() == ("auto", "default")


@pytest.mark.parametrize("raw", ["cuda", "tritonn", "cute,triton", "0"])
def test_invalid_b12x_impl_names_the_variable_the_value_and_the_allowed_set(monkeypatch, raw):
    monkeypatch.setenv(policy.ENV_VAR, raw)
    with pytest.raises(InvalidImplementation) as e:
        choose("nvfp4", 1, 64, 64, CPU)
    assert str(e.value) == f"B12X_IMPL={raw!r} is not an implementation; allowed: auto, cute, hopper, triton, reference"
    assert isinstance(e.value, ValueError)


def test_invalid_use_impl_and_impl_argument_are_named():
    with pytest.raises(InvalidImplementation, match=r"use_impl\(\)='fast'"):
        with use_impl("fast"):
            pass
    with pytest.raises(InvalidImplementation, match="impl='fast'"):
        choose("nvfp4", 1, 64, 64, CPU, impl="fast")


def test_priority_is_call_then_context_then_environment(monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    assert choose("fp8_tensor", 1, 64, 64, HERE).source == "B12X_IMPL"
    with use_impl("triton"):
        c = choose("fp8_tensor", 1, 64, 64, HERE)
        assert (c.impl, c.source) == ("triton", "use_impl()")
        with use_impl("auto"):
            assert choose("fp8_tensor", 1, 64, 64, HERE).requested == "auto"
        assert choose("fp8_tensor", 1, 64, 64, HERE, impl="reference").source == "impl="
    assert choose("fp8_tensor", 1, 64, 64, HERE).impl == "reference"


def test_auto_choices_are_logged_once_per_format_and_reason(monkeypatch, caplog):
    _b12x(monkeypatch, installed=False)
    gb10 = KNOWN_DEVICES["gb10"]
    with caplog.at_level(logging.INFO, logger="dispatch.registry"):
        for m in (1, 16, 4096):
            choose("nvfp4", m, 4096, 4096, gb10)
            choose("mxfp8", m, 4096, 4096, gb10)
        choose("nvfp4", 2, 4096, 4096, gb10, log_choice=False)
    records = [r for r in caplog.records if r.name == "dispatch.registry"]
    assert len(records) == 2
    assert {r.levelno for r in records} == {logging.WARNING}  # SM12x: the production path was missed
    assert "nvfp4 on NVIDIA DGX Spark GB10 (sm_121, 48 SMs): auto chose triton" in records[0].getMessage()
    assert "pip install 'b12x-dual[cute]'" in records[0].getMessage()


def test_a_decision_is_cached_per_m_bucket_and_request(monkeypatch):
    dev = KNOWN_DEVICES["h200"]
    a = choose("mxfp8", 17, 256, 256, dev)
    assert choose("mxfp8", 32, 256, 256, dev) is a          # 17..32 share a bucket
    assert choose("mxfp8", 33, 256, 256, dev) is not a
    assert choose("mxfp8", 17, 256, 256, dev, impl="reference").impl == "reference"
    monkeypatch.setenv(policy.ENV_VAR, "reference")
    assert choose("mxfp8", 17, 256, 256, dev).impl == "reference"  # the request is part of the key


def test_the_cache_key_holds_every_field_of_the_decision(monkeypatch):
    # Key: (device, variant, M bucket, N, K, dtype, request, source). Changing any one field gives a
    # decision of its own (a key missing a field would hand back the cached one: the same object).
    base = dict(variant_="mxfp8", M=17, N=256, K=256, device=KNOWN_DEVICES["h200"], dtype=torch.bfloat16)
    first = choose(**base, impl="triton")
    assert choose(**base, impl="triton") is first
    changes = {"device": KNOWN_DEVICES["h100_sxm"], "variant_": "fp8_block", "M": 33, "N": 512, "K": 512,
               "dtype": torch.float16}
    for name, value in changes.items():
        c = choose(**{**base, name: value}, impl="triton")
        assert c is not first, name
        assert c.impl == "triton", name
    assert choose(**base, impl="reference").impl == "reference"          # the request
    with use_impl("triton"):
        c = choose(**base)                                               # same request, another source
        assert c is not first and (c.impl, c.source) == ("triton", "use_impl()")
    assert choose(**base, impl="triton") is first                        # and the first is still cached


# ---------------------------------------------------------------------------------------------
# The priority per device, and the hopper implementation
# ---------------------------------------------------------------------------------------------
ADA = DeviceInfo("NVIDIA L40S", (8, 9), 142, 101_376, 864.0, "cuda")


@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_priority_is_hopper_on_sm90_cute_on_sm12x_and_triton_elsewhere(key):
    dev = KNOWN_DEVICES[key]
    expected = {"sm_90": ("hopper", "triton", "reference"), "sm_12x": ("cute", "triton", "reference")}
    want = expected["sm_90"] if dev.capability == (9, 0) and dev.kind == "cuda" else \
        expected["sm_12x"] if dev.is_sm12x else ("triton", "reference")
    assert registry.priority(dev) == want
    assert registry.PRIORITY[registry.device_class(dev)] == want
    assert set(want) <= set(registry.IMPLS)


def test_another_cuda_gpu_walks_triton_then_the_reference():
    assert registry.priority(ADA) == ("triton", "reference")
    c = choose("nvfp4", 16, 4096, 4096, ADA)
    assert (c.impl, [n for n, _, _ in c.considered]) == ("triton", ["triton"])


@pytest.mark.parametrize("key", list(KNOWN_DEVICES))
def test_hopper_is_supported_on_sm90_only(key):
    dev = KNOWN_DEVICES[key]
    ok, why = registry.get("hopper", "nvfp4_w4a16").is_supported(dev)
    if dev.kind == "cpu":
        assert (ok, why) == (False, "hopper needs an sm_90 GPU; this call runs on the CPU")
    elif dev.capability != (9, 0):
        assert (ok, why) == (False, f"hopper needs an sm_90 GPU; {dev.name} is {dev.arch}")
    else:
        _needs_hopper("nvfp4")
        assert ok, why
    assert registry.get("hopper", "nvfp4").is_supported(ADA) == (False,
                                                                "hopper needs an sm_90 GPU; NVIDIA L40S is sm_89")


def test_b12x_impl_hopper_forces_hopper(monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "hopper")
    with pytest.raises(ImplementationUnavailable, match="'hopper' cannot serve this call on CPU .*: hopper needs an "
                                                        "sm_90 GPU; this call runs on the CPU"):
        choose("mxfp8", 16, 256, 256, CPU)
    with pytest.raises(ImplementationUnavailable, match="hopper needs an sm_90 GPU; NVIDIA GeForce RTX 5090 is sm_120"):
        choose("mxfp8", 16, 256, 256, KNOWN_DEVICES["rtx_5090"])
    _needs_hopper("mxfp8")
    c = choose("mxfp8", 16, 256, 256, KNOWN_DEVICES["h200"])
    assert (c.impl, c.requested, c.source) == ("hopper", "hopper", "B12X_IMPL")


def test_explain_reports_device_versions_every_reason_of_the_walk_and_the_route(monkeypatch):
    _b12x(monkeypatch, installed=False)
    text = api.explain("nvfp4", 8, 4096, 4096, device="gb10")
    assert text.splitlines()[0] == ("device: NVIDIA DGX Spark GB10 (sm_121, 48 SMs, 101376 B shared memory per "
                                    "block, 273 GB/s)")
    versions = api.library_versions()
    assert text.splitlines()[1] == "libraries: " + ", ".join(f"{k} {v}" for k, v in versions.items())
    assert list(versions) == ["torch", "triton", "b12x", "nvidia-cutlass-dsl", "numpy", "python", "cuda"]
    for label in ("M=8 ", "decode M=1 ", "decode M=16 ", "prefill M=4096 "):
        assert f"nvfp4 {label}" in text
    install = "b12x is not installed (ModuleNotFoundError: No module named 'b12x'); install it with: " \
              "pip install 'b12x-dual[cute]'"
    assert f"auto -> triton: {install}; Triton kernels on sm_121; kernels_triton.nvfp4" in text
    assert f"    cute: no: {install}" in text
    assert "    triton: yes: Triton kernels on sm_121; kernels_triton.nvfp4" in text
    for m in (8, 1, 16, 4096):  # every shape's route, as the backend reports it
        r = registry.get("triton", "nvfp4").route(registry.Problem("nvfp4", m, 4096, 4096), KNOWN_DEVICES["gb10"])
        assert f"    route: {api.route_text(r)}" in text
    monkeypatch.setenv(policy.ENV_VAR, "cute")
    assert "B12X_IMPL=cute -> error: implementation 'cute' cannot serve" in api.explain("nvfp4", 8, 64, 64, "h200")


def test_explain_on_sm90_reports_the_hopper_route():
    _needs_hopper("fp8_tensor")
    text = api.explain("fp8_tensor", 1, 8192, 8192, device=KNOWN_DEVICES["h200"])
    hopper = registry.get("hopper", "fp8_tensor")
    for m in (1, 16, 4096):
        r = hopper.route(registry.Problem("fp8_tensor", m, 8192, 8192), KNOWN_DEVICES["h200"])
        assert r.impl == "hopper" and r.kernels
        assert f"    route: {api.route_text(r)}" in text
    assert "auto -> hopper: " in text and "triton portable path" not in text


def test_missing_the_hopper_path_on_sm90_warns(monkeypatch, caplog):
    # sm_90's production implementation is hopper: auto settling for another one is a WARNING.
    monkeypatch.setattr(backends, "_hopper_module_present", lambda fmt: False)
    with caplog.at_level(logging.INFO, logger="dispatch.registry"):
        c = choose("mxfp8", 16, 4096, 4096, KNOWN_DEVICES["h200"])
    assert c.impl == "triton" and "kernels_triton.hopper.mxfp8 is not in this installation" in c.reason
    records = [r for r in caplog.records if r.name == "dispatch.registry"]
    assert [r.levelno for r in records] == [logging.WARNING]


# What explain's first line for an asked M says: its shape class label where it is one, and the
# Ms that share its decision (exact up to 16, then (2^(b-1), 2^b]).
ASKED = {1: ("decode M=1", "M bucket 1"), 8: ("M=8", "M bucket 8"), 16: ("decode M=16", "M bucket 16"),
         17: ("M=17", "M bucket 17-32"), 4096: ("prefill M=4096", "M bucket 2049-4096"),
         5000: ("M=5000", "M bucket 4097-8192")}


@pytest.mark.parametrize("M", list(ASKED))
def test_explain_shows_the_asked_m_first_then_each_other_class_once(M):
    text = api.explain("mxfp8", M, 256, 256, device=CPU)
    heads = [line for line in text.splitlines() if line.startswith("mxfp8 ")]
    labels = [h.split(" N=")[0].removeprefix("mxfp8 ") for h in heads]
    label, bucket = ASKED[M]
    assert labels[0] == label and f"({bucket}, asked): auto -> " in heads[0], heads[0]
    others = [c for c, m in (("decode M=1", 1), ("decode M=16", 16), ("prefill M=4096", 4096)) if m != M]
    assert labels[1:] == others
