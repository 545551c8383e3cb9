"""One test per patch in dispatch/vllm_plugin/patches.py: each fails when vLLM changes what the
patch works around (then the patch must be revisited), and checks the patch itself."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from _vllm_env import dist  # noqa: F401


def test_kernel_lists_register_linear_kernel_still_appends(dist):
    """Why we insert at the front: register_linear_kernel appends, and every CUDA list we join
    ends in a kernel that is always supported, so an appended kernel is never reached."""
    import vllm.model_executor.kernels.linear as lin
    from vllm.platforms import PlatformEnum

    from dispatch.vllm_plugin import kernels as K
    from dispatch.vllm_plugin import patches

    class Probe:
        pass

    table = lin._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CUDA]
    lin.register_linear_kernel(Probe, PlatformEnum.CUDA, "mxfp8")
    try:
        assert table[-1] is Probe, "register_linear_kernel no longer appends: revisit patches.kernel_lists"
    finally:
        table.remove(Probe)
    always = {"nvfp4": lin.EmulationNvFp4LinearKernel, "mxfp8": lin.EmulationMxfp8LinearKernel,
              "mxfp4": lin.EmulationMxfp4LinearKernel, "fp8_block": lin.BlockWiseTorchFP8ScaledMMLinearKernel}
    for kind, cls in always.items():
        lst = getattr(lin, patches.LIST_NAMES[kind])[PlatformEnum.CUDA]
        assert cls in lst and lst.index(cls) > 0
    assert lin.EmulationNvFp4LinearKernel.is_supported()[0]  # supported everywhere: blocks what follows
    # the patch: ours first on CUDA and CPU, once
    for kind, classes in patches._kinds().items():
        for platform in (PlatformEnum.CUDA, PlatformEnum.CPU):
            lst = getattr(lin, patches.LIST_NAMES[kind])[platform]
            assert lst[:len(classes)] == list(classes) and all(lst.count(c) == 1 for c in classes)
    patches.apply()  # idempotent
    assert lin._POSSIBLE_FP8_KERNELS[PlatformEnum.CUDA].count(K.B12xDualFp8TensorKernel) == 1
    assert lin._POSSIBLE_FP8_KERNELS[PlatformEnum.CUDA].count(K.B12xDualFp8ChannelKernel) == 1


def test_backend_map_b12x_name_and_in_tree_classes(dist):
    """LinearBackend is a closed Literal (a new name is refused by vLLM's config), so we answer to
    "b12x"; the in-tree classes we displace still exist under their names."""
    import vllm.model_executor.kernels.linear as lin
    from vllm.config import KernelConfig
    from vllm.config.kernel import LinearBackend

    from dispatch.vllm_plugin import kernels as K
    from dispatch.vllm_plugin import patches

    assert "b12x" in typing.get_args(LinearBackend)
    with pytest.raises(Exception, match="literal_error|Input should be"):
        KernelConfig(linear_backend="b12x_dual")
    for name in patches.IN_TREE_B12X:
        assert hasattr(lin, name), f"vLLM renamed {name}: revisit patches.IN_TREE_B12X"
    assert {c.__name__ for c in patches.removed_in_tree} == set(patches.IN_TREE_B12X)
    assert lin._LINEAR_BACKEND_KERNEL_MAP["b12x"] == set(K.KERNELS)


def test_nvfp4_w4a16_vllm_still_forces_marlin(dist):
    """vLLM's own init_nvfp4_linear_kernel(use_a16=True) forces Marlin under auto and filters
    everything else through its weight-only tuple: neither reaches our class."""
    import vllm.model_executor.kernels.linear as lin
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config

    from dispatch.vllm_plugin import patches

    original = lin.init_nvfp4_linear_kernel.__b12x_dual_original__
    src = inspect.getsource(original)
    assert "force_kernel = MarlinNvFp4LinearKernel" in src and "a16_kernels" in src
    with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig(linear_backend="auto"))):
        with pytest.raises(ValueError, match="Forced NVFP4 kernel MarlinNvFp4LinearKernel"):
            original(use_a16=True)
    with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig(linear_backend="b12x"))):
        with pytest.raises(ValueError, match="Failed to find a kernel"):
            original(use_a16=True)  # our W4A4 class is in the list, but filtered out
        assert type(lin.init_nvfp4_linear_kernel(use_a16=True)).__name__ == "B12xDualNvFp4W4A16Kernel"
    import importlib

    assert patches.ONLINE_LM_HEAD in patches.nvfp4_importers()  # 0.33 has it (0.32 does not)
    for name in patches.nvfp4_importers():  # every importer by name holds the wrapper
        mod = importlib.import_module(name)
        assert mod.init_nvfp4_linear_kernel is lin.init_nvfp4_linear_kernel, name


def test_cpu_fp8_quant_op_still_missing_and_stand_in_matches_formats(dist):
    """The registry's CPU wheel lacks torch.ops._C.static_scaled_fp8_quant (if it ships it, drop
    patches.cpu_fp8_quant); our stand-in rounds like the formats/ codec (RNE, saturating)."""
    import vllm._custom_ops as vops

    from dispatch.vllm_plugin import patches
    from formats.codecs import encode_e4m3

    assert not patches._has_c_op("static_scaled_fp8_quant")
    assert patches.failed == {}, patches.failed
    assert getattr(vops.scaled_fp8_quant, "__b12x_dual_original__", None) is not None
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 30
    s = torch.tensor(0.07)
    q, s_out = vops.scaled_fp8_quant(x, s)
    assert q.dtype == torch.float8_e4m3fn and s_out is s
    assert torch.equal(q.view(torch.uint8), encode_e4m3(x / s).view(torch.uint8))
    assert float(q.float().abs().max()) == 448.0  # saturates (x/s reaches ~1700 here)


def test_load_checks_hooks_still_where_vllm_builds_and_processes(dist):
    """What patches.load_checks relies on (vLLM 0.32 and 0.33): LinearBase.__init__ sets
    quant_method; the column, row and replicated layers call ``self.quant_method.create_weights``
    in __init__; column and row layers end __init__ with ``update_param_tp_status()`` after the
    bias; vLLM's model loader processes through ``quant_method.process_weights_after_loading``.
    Then the patch itself: a layer's quant method carries the wrappers, LinearBase's are in place."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.model_loader.utils as loader_utils

    from dispatch.vllm_plugin import patches

    assert "load_checks" in patches.applied and patches.failed == {}, patches.failed
    base_init = inspect.getsource(getattr(linear.LinearBase.__init__, "__b12x_dual_original__"))
    assert "self.quant_method = " in base_init
    for cls in (linear.ReplicatedLinear, linear.ColumnParallelLinear, linear.RowParallelLinear):
        src = inspect.getsource(cls.__init__)
        assert "self.quant_method.create_weights(" in src, cls.__name__
    for cls in (linear.ColumnParallelLinear, linear.RowParallelLinear):
        src = inspect.getsource(cls.__init__)
        assert src.index("self.update_param_tp_status()") > src.index("self.bias = Parameter("), cls.__name__
    assert "quant_method.process_weights_after_loading(" in inspect.getsource(loader_utils)
    layer = linear.RowParallelLinear(256, 128, bias=True, quant_config=None, prefix="probe")
    assert vars(layer.quant_method).get("__b12x_dual_checked__") is True
    assert getattr(linear.LinearBase.update_param_tp_status, "__b12x_dual_original__", None) is not None


def test_ct_fp8_weight_loader_not_needed_on_0_33(dist):
    """0.33's CT W8A8 FP8 scheme keeps each parameter's weight_loader (replace_parameter), so the
    patch for 0.32 (which swapped in bare Parameters) stays off; if vLLM goes back to bare
    Parameters this fails (and the patch's version gate must follow)."""
    import importlib

    from dispatch.vllm_plugin import patches

    assert patches.vllm_version() >= (0, 33)
    scheme = importlib.import_module(patches.CT_FP8).CompressedTensorsW8A8Fp8
    assert getattr(scheme.process_weights_after_loading, "__b12x_dual_original__", None) is None
    src = inspect.getsource(scheme.process_weights_after_loading)
    assert 'replace_parameter(layer, "weight", weight.data)' in src
    assert "layer.weight = Parameter(" not in src
    assert "ct_fp8_weight_loader" in patches.applied


def test_moe_method_get_moe_method_is_wrapped_and_what_it_relies_on_is_there(dist):
    """Patch 8 (moe_method): compressed-tensors' MoE method selection is still the static method
    ``CompressedTensorsMoEMethod.get_moe_method(quant_config, layer, layer_name)`` reading the scheme
    of ``<layer>.0.<gate proj>`` through ``_add_fused_moe_to_target_scheme_map`` / ``get_scheme_dict``;
    RoutedExperts still asks ``resolve_quant_method``; its weight_loader still takes
    (param, loaded_weight, weight_name, shard_id, expert_id, return_success) and branches on the
    method's class name ("compressed": the equal input scales check). Then the patch: the class
    attribute is our wrapper, once (the plugin's finder applied it when the module was imported)."""
    import importlib

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from dispatch.vllm_plugin import moe, patches

    mod = importlib.import_module(moe.CT_MOE)
    cls = mod.CompressedTensorsMoEMethod
    wrapped = cls.__dict__["get_moe_method"]
    assert isinstance(wrapped, staticmethod), "get_moe_method is no longer a static method: revisit patches.moe_method"
    original = getattr(wrapped.__func__, "__b12x_dual_original__", None)
    assert original is not None and "moe_method" in patches.applied, (patches.applied, patches.failed)
    assert list(inspect.signature(original).parameters) == ["quant_config", "layer", "layer_name"]
    src = inspect.getsource(original)
    for needed in ("_add_fused_moe_to_target_scheme_map()", "get_scheme_dict(", "ckpt_gate_proj_name"):
        assert needed in src, needed
    assert hasattr(CompressedTensorsConfig, "_add_fused_moe_to_target_scheme_map")
    assert "resolve_quant_method" in inspect.getsource(RoutedExperts._get_quant_method)
    params = list(inspect.signature(RoutedExperts.weight_loader).parameters)
    assert params[:7] == ["self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success"]
    assert '"compressed" in quant_method_name.lower()' in inspect.getsource(RoutedExperts.weight_loader)
    assert "CompressedTensors" in moe.B12xDualCompressedTensorsMoEMethod.__name__
    moe.wrap_get_moe_method()  # idempotent
    assert cls.__dict__["get_moe_method"].__func__.__b12x_dual_original__ is original


def test_gptoss_and_modelopt_moe_get_quant_method_are_wrapped_and_what_they_rely_on_is_there(dist):
    """Patches 9 (gptoss_moe_method) and 10 (modelopt_moe_method): gpt-oss's MXFP4 config class is
    still ``GptOssMxfp4Config`` (quant_method "mxfp4" on a gpt_oss model) building RoutedExperts'
    method in ``get_quant_method(layer, prefix)`` (inherited from Mxfp4Config); vLLM's gpt-oss
    loader still hands whole stacked tensors (``expert_id=None``) that RoutedExperts.weight_loader
    copies whole for that config, and GptOssRoutedExperts still reads the method's ``weight_dtype``;
    ModelOpt's NVFP4 config still builds its MoE method in ``get_quant_method`` (inherited from
    ModelOptQuantConfigBase) through ``FusedMoEMethodCls``, and the loader still branches on
    "ModelOpt" in the method's class name (``uses_weight_scale_2_pattern``, the two input-scale
    shards) and reads ``use_global_sf``. Then the patches: each class's own attribute is our
    wrapper, once."""
    import importlib

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models import gpt_oss

    from dispatch.vllm_plugin import moe, patches

    mx = importlib.import_module(moe.MXFP4)
    mo = importlib.import_module(moe.MODELOPT)
    assert {"gptoss_moe_method", "modelopt_moe_method"} <= set(patches.applied), (patches.applied, patches.failed)
    for cls, base, wrap in ((mx.GptOssMxfp4Config, mx.Mxfp4Config, moe.wrap_gptoss_get_quant_method),
                            (mo.ModelOptNvFp4Config, mo.ModelOptQuantConfigBase, moe.wrap_modelopt_get_quant_method)):
        wrapped = cls.__dict__["get_quant_method"]
        original = getattr(wrapped, "__b12x_dual_original__", None)
        assert original is base.__dict__["get_quant_method"], cls.__name__
        assert list(inspect.signature(original).parameters) == ["self", "layer", "prefix"]
        assert "RoutedExperts" in inspect.getsource(original)
        wrap()  # idempotent
        assert cls.__dict__["get_quant_method"] is wrapped
    assert mx.GptOssMxfp4Config.get_name() == "gpt_oss_mxfp4"
    loader = inspect.getsource(RoutedExperts.weight_loader)
    assert 'if quant_config_name == "gpt_oss_mxfp4":' in loader
    assert "param.data[:, :dim1, :dim2].copy_(loaded_weight)" in loader
    assert '"ModelOpt" in quant_method_name' in loader and "uses_weight_scale_2_pattern()" in loader
    assert '"use_global_sf"' in loader
    gpt = inspect.getsource(gpt_oss.GptOssModel._load_weights_mxfp4)
    assert gpt.count("expert_id=None") >= 6 and "2 * intermediate_size, -1" in gpt
    gpt_loader = inspect.getsource(gpt_oss.GptOssRoutedExperts.weight_loader)
    assert 'getattr(self.quant_method, "weight_dtype", "")' in gpt_loader
    assert mo.ModelOptNvFp4Config.FusedMoEMethodCls.__name__ == "ModelOptNvFp4FusedMoE"
    assert "self.FusedMoEMethodCls(" in inspect.getsource(mo.ModelOptQuantConfigBase.get_quant_method)
    assert "ModelOpt" in moe.B12xDualModelOptNvFp4MoEMethod.__name__
    assert "compressed" not in moe.B12xDualModelOptNvFp4MoEMethod.__name__.lower()


def test_modelopt_fp8_weight_loader_not_needed_on_0_33(dist):
    """0.33's ModelOpt per-tensor FP8 scheme (KFp8StaticTensor.process) keeps each weight_loader
    (replace_parameter), so the 0.32 patch stays off; if vLLM goes back to bare Parameters this
    fails (and the patch's version gate must follow)."""
    import importlib

    from dispatch.vllm_plugin import patches

    cls = importlib.import_module(patches.MODELOPT).KFp8StaticTensor
    assert getattr(cls.process, "__b12x_dual_original__", None) is None
    src = inspect.getsource(cls.process)
    assert 'replace_parameter(layer, "weight", weight.t())' in src
    assert "Parameter(" not in src.replace("replace_parameter(", "")
    assert "modelopt_fp8_weight_loader" in patches.applied


def test_wrap_once_wraps_a_method_a_staticmethod_and_a_function_once():
    """dispatch.vllm_plugin._wrap.wrap_once: the wrapper replaces the attribute, keeps the original's
    name and docstring and reaches it through ``__b12x_dual_original__``; a second call changes
    nothing (returns False, the wrapper runs once per call); a staticmethod stays one."""
    import types

    from dispatch.vllm_plugin._wrap import wrap_once

    calls = []

    class Owner:
        def method(self, v):
            """the method"""
            return v + 1

        @staticmethod
        def static(v):
            return v * 2

    def around(original):
        def wrapper(*args):
            calls.append(original.__name__)
            return original(*args)
        return wrapper

    module = types.SimpleNamespace(fn=lambda v: v - 1)
    for owner, attr, kw in ((Owner, "method", {}), (Owner, "static", {"static": True}), (module, "fn", {})):
        original = getattr(owner, attr)
        assert wrap_once(owner, attr, around, **kw) is True
        assert wrap_once(owner, attr, around, **kw) is False
        assert getattr(owner, attr).__b12x_dual_original__ is original
        assert getattr(owner, attr).__name__ == original.__name__
    assert Owner.method.__doc__ == "the method" and isinstance(vars(Owner)["static"], staticmethod)
    assert (Owner().method(1), Owner.static(3), module.fn(5)) == (2, 6, 4)
    assert calls == ["method", "static", "<lambda>"]
