"""The backend registry: a complete table, the four verbs, storage kept on reload, the M buckets."""

from __future__ import annotations

import pytest
import torch

import formats
from dispatch import api, registry
from dispatch.backends import copy_quantized_into
from dispatch.devices import KNOWN_DEVICES, interpreting
from dispatch.registry import Backend, Problem, UnsupportedEntry
from kernels_cute._common import b12x_import_error

from conftest import DEVICE, device_name

VARIANTS = tuple(registry.VARIANTS)
# b12x's pack_weight (tensor FP8, MXFP8, NVFP4 W4A16) checks that the weight is on a CUDA device.
PREPARE_NEEDS_CUDA = {("cute", "fp8_tensor"), ("cute", "mxfp8"), ("cute", "nvfp4_w4a16"), ("cute", "mxfp8_w8a16")}


def test_every_format_of_formats_has_one_registry_entry():
    assert set(registry.FORMATS) == set(formats.FORMAT_NAMES)
    assert {v.fmt for v in registry.VARIANTS.values()} == set(formats.FORMAT_NAMES)
    assert [v for v, s in registry.VARIANTS.items() if s.a16] == ["mxfp8_w8a16", "nvfp4_w4a16", "mxfp4_w4a16"]


def test_weight_only_variants_are_named_by_the_weights_bits():
    """W4A16 for the e2m1 formats, W8A16 for MXFP8 (a per-format suffix); a16 variants keep their format."""
    assert registry.variant_name("mxfp8", True) == "mxfp8_w8a16"
    assert registry.variant_name("nvfp4", True) == "nvfp4_w4a16"
    assert registry.variant_name("fp8_channel", False) == "fp8_channel"
    assert Problem("mxfp8_w8a16", 1, 8, 32).fmt == "mxfp8" and Problem("mxfp8_w8a16", 1, 8, 32).a16
    with pytest.raises(ValueError, match=r"is defined for \['mxfp4', 'mxfp8', 'nvfp4'\], not 'fp8_channel'"):
        registry.variant_name("fp8_channel", True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("impl", registry.IMPLS)
def test_every_cell_is_a_backend_or_says_why_not(impl, variant):
    entry = registry.entries()[(impl, variant)]
    if isinstance(entry, UnsupportedEntry):
        assert len(entry.reason) > 20, "an unsupported cell must say why"
        with pytest.raises(registry.Unsupported, match=entry.reason[:30]):
            registry.get(impl, variant)
        return
    assert isinstance(entry, Backend)
    assert (entry.impl, entry.variant, entry.name) == (impl, variant, f"{impl}:{variant}")
    for verb in ("is_supported", "can_implement", "prepare", "run", "route"):
        assert getattr(type(entry), verb) is not getattr(Backend, verb), f"{entry} does not implement {verb}"
    assert registry.get(impl, variant) is entry
    # every verdict comes with a reason, on every known device
    for dev in KNOWN_DEVICES.values():
        ok, why = entry.is_supported(dev)
        assert isinstance(ok, bool) and why
    ok, why = entry.can_implement(Problem(variant, 16, 256, 512))
    assert isinstance(ok, bool) and why


HOPPER_W8A16_GAP = "kernels_triton.hopper.mxfp8 W8A16 is written, not yet run on a GPU"


def test_the_unsupported_cells_are_the_named_gaps():
    """b12x has no MXFP4 W4A16 and no per-channel FP8 GEMM; the hopper W8A16 path is a gap until a
    GPU has run it (dispatch.backends.MXFP8_W8A16_GPU_RAN: sm_90 runs the lesson's until then).
    hopper serves fp8_channel (kernels_triton.hopper.fp8_channel)."""
    from dispatch import backends

    cells = {k: e.reason for k, e in registry.entries().items() if isinstance(e, UnsupportedEntry)}
    gaps = {("cute", "mxfp4_w4a16"), ("cute", "fp8_channel")}
    if not backends.MXFP8_W8A16_GPU_RAN:
        gaps.add(("hopper", "mxfp8_w8a16"))
        assert cells[("hopper", "mxfp8_w8a16")].startswith(HOPPER_W8A16_GAP)
    assert set(cells) == gaps
    assert cells[("cute", "fp8_channel")].startswith("b12x 1.5.1 has no per-channel FP8 GEMM")


def test_auto_serves_the_gaps_with_the_next_implementation():
    """fp8_channel: triton on SM12x (after cute's reason), hopper on sm_90; mxfp8_w8a16 on sm_90:
    hopper once its W8A16 path ran on a GPU, the lesson (triton) after hopper's reason before."""
    from dispatch import backends
    from dispatch.policy import ImplementationUnavailable

    c = registry.choose("fp8_channel", 16, 4096, 4096, KNOWN_DEVICES["rtx_pro_6000"])
    assert c.impl == "triton", c.reason
    assert "fp8_channel" in c.considered[0][2] and not c.considered[0][1]
    c = registry.choose("fp8_channel", 16, 4096, 4096, KNOWN_DEVICES["h200"])
    assert c.impl == "hopper", c.reason
    c = registry.choose("mxfp8_w8a16", 16, 4096, 4096, KNOWN_DEVICES["h200"])
    if backends.MXFP8_W8A16_GPU_RAN:
        assert c.impl == "hopper" and "kernels_triton.hopper.mxfp8 W8A16" in c.reason, c.reason
    else:
        assert c.impl == "triton" and HOPPER_W8A16_GAP in c.reason, c.reason
        assert "kernels_triton.mxfp8 W8A16" in c.reason
        with pytest.raises(ImplementationUnavailable, match=HOPPER_W8A16_GAP):
            registry.choose("mxfp8_w8a16", 16, 4096, 4096, KNOWN_DEVICES["h200"], impl="hopper")
    with pytest.raises(ImplementationUnavailable, match="b12x 1.5.1 has no per-channel FP8 GEMM"):
        registry.choose("fp8_channel", 16, 4096, 4096, KNOWN_DEVICES["rtx_pro_6000"], impl="cute")


@pytest.mark.parametrize("variant", VARIANTS)
def test_can_implement_is_the_same_for_every_m_of_a_bucket(variant):
    # choose caches per M bucket, which is only right if no backend's verdict changes inside one.
    ms = list(range(0, 40)) + [63, 64, 65, 127, 128, 129, 130, 255, 256, 257, 4095, 4096, 4097]
    for impl in registry.IMPLS:
        entry = registry.entries()[(impl, variant)]
        if isinstance(entry, UnsupportedEntry):
            continue
        for n, k in ((256, 512), (4096, 4096), (264, 4352), (200, 4096)):
            seen: dict[int, bool] = {}
            for m in ms:
                ok = entry.can_implement(Problem(variant, m, n, k))[0]
                assert seen.setdefault(registry.m_bucket(m), ok) == ok, (impl, variant, m, n, k)


def test_m_buckets():
    assert [registry.m_bucket(m) for m in (0, 1, 7, 16, 17, 32, 33, 4096, 4097)] == [0, 1, 7, 16, 32, 32, 64, 4096, 8192]


def test_problem_checks_its_variant():
    assert Problem("nvfp4_w4a16", 1, 8, 16).fmt == "nvfp4"
    assert Problem("nvfp4_w4a16", 1, 8, 16).a16
    with pytest.raises(ValueError, match="format must be one of"):
        Problem("int4", 1, 8, 16).fmt


def _weight(variant: str, seed: int, n: int = 128, k: int = 256) -> formats.QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    return api.quantize_weight(torch.randn(n, k, generator=g), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("impl", registry.IMPLS)
def test_prepare_into_keeps_every_address_and_takes_the_new_values(impl, variant):
    entry = registry.entries()[(impl, variant)]
    if isinstance(entry, UnsupportedEntry):
        pytest.skip(f"{impl}:{variant} is declared unsupported: {entry.reason}")
    dev = "cpu"
    if (impl, variant) in PREPARE_NEEDS_CUDA:
        if not torch.cuda.is_available():
            pytest.skip(f"{impl}:{variant} prepares through b12x's pack_weight, which needs a CUDA device; "
                        f"found {device_name()}")
        err = b12x_import_error()
        if err:
            pytest.skip(f"{impl}:{variant} prepares through b12x's pack_weight, which needs b12x: {err}")
        dev = "cuda"
    old = entry.prepare(_weight(variant, 0).to(dev))
    ptrs = [t.data_ptr() for t in _leaves(old)]
    new_qw = _weight(variant, 1).to(dev)
    fresh = entry.prepare(new_qw)
    again = entry.prepare(new_qw, into=old)
    assert again is old
    assert [t.data_ptr() for t in _leaves(again)] == ptrs
    for a, b in zip(_leaves(again), _leaves(fresh), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


def _leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, formats.QuantizedTensor):
        return list(obj.tensors().values())
    return [t for t in obj.tensors().values()]


def test_prepare_refuses_another_format_or_shape():
    b = registry.get("triton", "nvfp4")
    with pytest.raises(ValueError, match="qweight must be a nvfp4 weight, got mxfp4"):
        b.prepare(_weight("mxfp4", 0))
    with pytest.raises(ValueError, match=r"into= must be a nvfp4 weight of shape \(64, 256\)"):
        copy_quantized_into(_weight("nvfp4", 0), _weight("nvfp4", 1, n=64))


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_and_triton_backends_agree_through_apply(variant):
    if isinstance(registry.entries()[("triton", variant)], UnsupportedEntry):
        pytest.skip(f"triton:{variant} is declared unsupported: {registry.entries()[('triton', variant)].reason}")
    # The Triton products of exact decoded operands are exact in fp32; bf16 output rounding allows
    # 1 bf16 ulp (2^-8 relative) per element, so ||diff|| / ||ref|| <= 2^-8 (rounding both ways).
    qw = _weight(variant, 3, n=64, k=256).to(DEVICE)  # the GPU when there is one, else the interpreter
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    ref = registry.get("reference", variant)
    tri = registry.get("triton", variant)
    y_ref = ref.apply(x, ref.prepare(qw)).double()
    y_tri = tri.apply(x, tri.prepare(qw)).double()
    assert torch.isfinite(y_tri).all()
    assert ((y_tri - y_ref).norm() / y_ref.norm()).item() <= 2 ** -8


@pytest.mark.parametrize("impl,variant,opt", [
    ("triton", "nvfp4", "scale_rule"),      # an MX option given to NVFP4
    ("triton", "mxfp4", "ue8m0"),           # a block-FP8 option given to MXFP4
    ("triton", "fp8_block", "out_dtype"),   # the reference's option given to a kernel
    ("reference", "mxfp4_w4a16", "scale_rule"),  # W4A16 quantizes no activation
])
def test_an_option_meant_for_another_format_or_implementation_is_named(impl, variant, opt):
    b = registry.get(impl, variant)
    qw = _weight(variant, 0, n=64, k=256)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{impl}:{variant}: unknown option\(s\) \['{opt}'\].*allowed: "):
        b.apply(x, b.prepare(qw), **{opt: None})


def test_each_backend_takes_its_formats_activation_options():
    assert registry.get("triton", "nvfp4").act_options == {"global_scale"}
    assert registry.get("reference", "fp8_tensor").act_options == {"scale", "out_dtype"}
    assert registry.get("cute", "mxfp8").act_options == {"scale_rule", "quantizer"}
    assert registry.get("triton", "mxfp4_w4a16").act_options == frozenset()


def test_a_bad_static_fp8_scale_tensor_gives_nan_never_zeros():
    # A tensor scale is not read on the host (no sync per call); a bad one becomes NaN on the device.
    b = registry.get("triton", "fp8_tensor")
    qw = _weight("fp8_tensor", 0, n=64, k=256).to(DEVICE)
    x = torch.randn(3, 256).to(torch.bfloat16).to(DEVICE)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        assert bool(b.apply(x, b.prepare(qw), scale=torch.tensor(bad, device=DEVICE)).isnan().all()), bad


@pytest.mark.parametrize("impl", ["triton", "hopper"])
@pytest.mark.parametrize("verb", ["apply", "quantize_activation", "gemm"])
def test_cpu_tensors_without_the_interpreter_get_the_registrys_error_not_tritons(monkeypatch, impl, verb):
    # A GPU machine runs Triton without its interpreter; CPU tensors must be refused by name before
    # any kernel (Triton's own message, "Pointer argument cannot be accessed from Triton", names
    # neither the implementation nor the fix). TRITON_INTERPRET=0 describes that machine here.
    b = registry.get(impl, "fp8_block")
    qw = _weight("fp8_block", 0, n=64, k=256)
    x = torch.randn(3, 256).to(torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = ("CPU tensors need Triton's interpreter but TRITON_INTERPRET='0'" if impl == "triton"
              else "hopper needs an sm_90 GPU; this call runs on the CPU")
    call = {"apply": lambda: b.apply(x, b.prepare(qw)),
            "quantize_activation": lambda: b.quantize_activation(x),
            "gemm": lambda: b.gemm(formats.quantize(x, "fp8_block", role="activation"), qw)}[verb]
    with pytest.raises(api.policy.ImplementationUnavailable) as e:
        call()
    assert str(e.value).startswith(f"implementation {impl!r} cannot serve this call on CPU (Triton interpreter) "
                                   f"(no CUDA device): {reason}")


def test_cuda_tensors_under_the_interpreter_get_the_registrys_error(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA device for CUDA tensors; found {device_name()}")
    b = registry.get("triton", "mxfp8")
    qw = _weight("mxfp8", 0, n=64, k=256).to("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(api.policy.ImplementationUnavailable,
                       match="Triton's interpreter is on .* got a tensor on cuda"):
        b.apply(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), qw)


def test_real_cpu_tensors_on_a_gpu_machine_get_the_registrys_error():
    if not torch.cuda.is_available() or interpreting():
        pytest.skip(f"needs a CUDA device with Triton's interpreter off; found {device_name()}")
    b = registry.get("triton", "nvfp4")
    qw = _weight("nvfp4", 0, n=64, k=256)
    with pytest.raises(api.policy.ImplementationUnavailable, match="CPU tensors need Triton's interpreter"):
        b.apply(torch.randn(3, 256, dtype=torch.bfloat16), qw)


def test_cute_quantizer_option_is_checked_before_any_kernel():
    b = registry.get("cute", "nvfp4_w4a16")
    with pytest.raises(ValueError, match=r"cute:nvfp4_w4a16: quantizer must be 'cute' \(W4A16 quantizes no activation\)"):
        b.apply(torch.randn(2, 256).to(torch.bfloat16), None, quantizer="triton")
    with pytest.raises(ValueError, match="quantizer must be 'cute' or 'triton', got 'fast'"):
        registry.get("cute", "mxfp8").apply(torch.randn(2, 256).to(torch.bfloat16), None, quantizer="fast")


def test_choose_takes_a_device_name_and_names_a_bad_device():
    """choose accepts what explain accepts: a KNOWN_DEVICES key is the described device; anything
    else is a ValueError naming the argument and what is allowed (never an AttributeError)."""
    by_name = registry.choose("nvfp4", 16, 4096, 4096, "h200", log_choice=False)
    assert by_name is registry.choose("nvfp4", 16, 4096, 4096, KNOWN_DEVICES["h200"], log_choice=False)
    assert registry.choose("nvfp4", 16, 4096, 4096, "rtx_pro_6000", log_choice=False).impl != by_name.impl
    with pytest.raises(ValueError, match=r"device must be a DeviceInfo, one of \(.*'h200'.*\) or a torch device, "
                                         r"got 'h999'"):
        registry.choose("nvfp4", 16, 4096, 4096, "h999")
