"""Selection: the entry point, auto / b12x / disabled, described SM12x devices through vLLM's own
selection function, B12X_IMPL and B12X_VLLM_AUTO, and the info report.

Modules: dispatch/vllm_plugin/placement.py, dispatch/vllm_plugin/_backend.py, dispatch/vllm_plugin/report.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from _vllm_env import HERE, ckpt, ckpt_root, dist, forward, impl, kernel_of, loaded  # noqa: F401
import harness

from dispatch.devices import KNOWN_DEVICES

ROOT = HERE.parents[2]


def _run_python(code: str) -> dict:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "b12x_dual"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_register_is_cheap_and_idempotent():
    """register() imports no kernel module (kernels_triton's format modules, kernels_cute), no b12x,
    no CuTe DSL, not even vLLM's kernel package."""
    got = _run_python(
        "import sys, json\n"
        "import dispatch.vllm_plugin as p\n"
        "p.register(); p.register()\n"
        "kernel_modules = {'kernels_triton.' + f for f in ('fp8_tensor', 'fp8_block', 'mxfp8', 'nvfp4', 'mxfp4',\n"
        "                  'hopper', 'hopper._twopass', 'hopper._fp4_gemm', 'hopper.nvfp4')}\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('b12x', 'cutlass', 'kernels_cute', 'vllm')\n"
        "         or m in kernel_modules]\n"
        "print(json.dumps({'heavy': heavy, 'finders': sum(type(f).__name__ == '_AfterImport' for f in sys.meta_path)}))")
    assert got == {"heavy": [], "finders": 1}


def test_entry_point_found_by_load_general_plugins():
    """vLLM's own plugin loader finds the entry point; importing vLLM's kernel package afterwards
    applies every patch but the ModelOpt ones, which apply once vLLM's ModelOpt module has
    finished importing, and the gpt-oss one (once vLLM's MXFP4 module has); our classes lead the lists."""
    got = _run_python(
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.model_executor.kernels.linear as lin\n"
        "from vllm.platforms import PlatformEnum\n"
        "from dispatch.vllm_plugin import patches\n"
        "after_linear = list(patches.applied)\n"
        "import vllm.model_executor.layers.quantization.modelopt\n"
        "after_modelopt = list(patches.applied)\n"
        "import vllm.model_executor.layers.quantization.mxfp4\n"
        "print(json.dumps({'after_linear': after_linear, 'after_modelopt': after_modelopt,\n"
        "  'applied': patches.applied, 'failed': patches.failed,\n"
        "  'first': {k: getattr(lin, v)[PlatformEnum.CUDA][0].__name__ for k, v in patches.LIST_NAMES.items()},\n"
        "  'second_fp8': lin._POSSIBLE_FP8_KERNELS[PlatformEnum.CUDA][1].__name__,\n"
        "  'b12x': sorted(c.__name__ for c in lin._LINEAR_BACKEND_KERNEL_MAP['b12x'])}))")
    assert got["after_linear"] == ["kernel_lists", "backend_map", "nvfp4_w4a16", "cpu_fp8_quant",
                                   "ct_fp8_weight_loader", "load_checks"]
    modelopt = ["modelopt_fp8_weight_loader", "modelopt_moe_method"]
    assert got["after_modelopt"][-2:] == modelopt and got["failed"] == {}
    assert sorted(got["applied"]) == sorted(got["after_linear"] + modelopt + ["gptoss_moe_method"])
    assert got["first"] == {"fp8": "B12xDualFp8TensorKernel", "fp8_block": "B12xDualFp8BlockKernel",
                            "mxfp8": "B12xDualMxfp8Kernel", "nvfp4": "B12xDualNvFp4Kernel",
                            "mxfp4": "B12xDualMxFp4Kernel"}
    assert not any(name.startswith("B12x") and not name.startswith("B12xDual") for name in got["b12x"])
    assert len(got["b12x"]) == 7
    assert got["second_fp8"] == "B12xDualFp8ChannelKernel"  # per-channel FP8 weights: our second class


# ---------------------------------------------------------------------------------------------
# vLLM's real choose_scaled_mm_linear_kernel, with the device described by its capability
# ---------------------------------------------------------------------------------------------
def _fp8_config(block: bool, n=4096, k=4096):
    import vllm.model_executor.kernels.linear as lin
    from vllm.model_executor.layers.quantization.utils import quant_utils as q

    act, w = (q.kFp8Dynamic128Sym, q.kFp8Static128BlockSym) if block else (q.kFp8StaticTensorSym, q.kFp8StaticTensorSym)
    return lin.FP8ScaledMMLinearLayerConfig(weight_quant_key=w, activation_quant_key=act, weight_shape=(n, k),
                                            input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)


def _choose(block: bool, cc, backend="auto", **shape):
    import vllm.model_executor.kernels.linear as lin
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config

    lists = lin._POSSIBLE_FP8_BLOCK_KERNELS if block else lin._POSSIBLE_FP8_KERNELS
    with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig(linear_backend=backend))):
        return lin.choose_scaled_mm_linear_kernel(_fp8_config(block, **shape), lists, compute_capability=cc,
                                                  quantization="fp8_block_w8a8" if block else "fp8_w8a8")


@pytest.mark.parametrize("block", [False, True])
def test_auto_goes_first_on_sm12x_only(block, dist, monkeypatch):
    monkeypatch.delenv("B12X_IMPL", raising=False)
    ours = "B12xDualFp8BlockKernel" if block else "B12xDualFp8TensorKernel"
    for cc in (120, 121):  # RTX PRO 6000 / 5090, DGX Spark: our CuTe path serves 4096x4096
        assert _choose(block, cc).__name__ == ours
    if not block:  # elsewhere vLLM's own order applies (on this CPU platform: its torch kernel)
        assert _choose(block, 90).__name__ == "PerTensorTorchFP8ScaledMMLinearKernel"
        assert _choose(block, None).__name__ == "PerTensorTorchFP8ScaledMMLinearKernel"
    else:
        with pytest.raises(ValueError, match="goes first only on SM120/SM121"):
            _choose(block, 90)


def test_auto_takes_only_shapes_cute_serves(dist, monkeypatch):
    monkeypatch.delenv("B12X_IMPL", raising=False)
    # N = 100 misses b12x's alignment: under auto we step aside (vLLM's next kernel serves it) ...
    assert _choose(False, 120, n=100).__name__ == "PerTensorTorchFP8ScaledMMLinearKernel"
    # ... while asked for, we serve it (Triton / reference cover every shape).
    assert _choose(False, 120, backend="b12x", n=100).__name__ == "B12xDualFp8TensorKernel"


def test_auto_placement_switch(dist, monkeypatch):
    monkeypatch.setenv("B12X_VLLM_AUTO", "0")
    assert _choose(False, 120).__name__ == "PerTensorTorchFP8ScaledMMLinearKernel"
    assert _choose(False, 120, backend="b12x").__name__ == "B12xDualFp8TensorKernel"  # still when asked


@pytest.mark.parametrize("value,on", [("", True), ("1", True), (" Yes ", True), ("on", True), ("0", False),
                                      ("false", False), ("OFF", False), ("no", False)])
def test_b12x_vllm_auto_values(value, on, monkeypatch):
    from dispatch.vllm_plugin import placement

    monkeypatch.setenv("B12X_VLLM_AUTO", value)
    assert placement.auto_enabled() is on


@pytest.mark.parametrize("backend", ["auto", "b12x"])
def test_an_unknown_b12x_vllm_auto_value_is_refused_naming_the_variable_the_value_and_the_allowed_set(
        backend, dist, monkeypatch):
    """B12X_VLLM_AUTO=maybe once read as on; now it is refused where vLLM asks our classes, under
    either backend (a typo never silently leaves the placement on or off)."""
    from dispatch.vllm_plugin import placement

    monkeypatch.setenv("B12X_VLLM_AUTO", "maybe")
    want = "B12X_VLLM_AUTO='maybe' is not allowed; allowed: 0, false, off, no (off) or 1, true, on, yes / unset (on)"
    with pytest.raises(ValueError, match=re.escape(want)):
        placement.auto_enabled()
    with pytest.raises(ValueError, match=re.escape(want)):
        _choose(False, 120, backend=backend)


def test_disabled_kernels_honoured(dist, monkeypatch):
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "B12xDualFp8TensorKernel")
    assert _choose(False, 120).__name__ == "PerTensorTorchFP8ScaledMMLinearKernel"
    with pytest.raises(ValueError, match="B12xDualFp8TensorKernel is disabled by environment variable"):
        _choose(False, None, backend="b12x")


@pytest.mark.parametrize("key", ["rtx_pro_6000", "rtx_5090", "gb10", "h200", "cpu"])
def test_placement_for_described_devices(key, dist):
    """Our classes' is_supported for a device given as a value (the dispatcher's table)."""
    from dispatch.vllm_plugin import placement

    dev = KNOWN_DEVICES[key]
    for variant in ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "nvfp4_w4a16", "mxfp4", "mxfp4_w4a16"):
        ok, why = placement.placement(variant, "nvfp4_w4a4", device=dev)
        # b12x 1.5.1 has no MXFP4 W4A16 kernel: under auto that variant stays with vLLM even on SM12x
        assert ok == (dev.is_sm12x and variant != "mxfp4_w4a16"), (variant, why)
        if not dev.is_sm12x:
            assert "SM120/SM121" in why and "--linear-backend b12x" in why
        elif not ok:
            assert "CuTe path" in why and "no W4A16 kernel for MXFP4" in why


def test_linear_backend_per_quant_selects_ours(dist, ckpt, impl):
    impl("reference")
    d = ckpt("ct_nvfp4")
    layers, _ = loaded(d, ("o",), linear_backend="auto", per_quant={"nvfp4_w4a4": "b12x"})
    assert type(kernel_of(layers["o"])).__name__ == "B12xDualNvFp4Kernel"


def test_auto_on_cpu_leaves_vllm_alone(dist, ckpt):
    """Under auto on this CPU platform vLLM has no NVFP4 kernel, and we do not step in."""
    d = ckpt("ct_nvfp4")
    with pytest.raises(ValueError, match="goes first only on SM120/SM121"):
        loaded(d, ("o",), linear_backend="auto")


def test_b12x_impl_forced_cute_fails_at_load_with_reason(dist, ckpt, impl):
    impl("cute")
    with pytest.raises(ValueError, match="cute needs an SM120/SM121 GPU"):
        loaded(ckpt("ct_mxfp8"), ("o",))


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_b12x_impl_honoured(name, dist, ckpt, impl):
    from dispatch.vllm_plugin import ops

    impl(name)
    layers, _ = loaded(ckpt("ct_mxfp8"), ("o",))
    st = ops.state(layers["o"].b12x_dual_handle)
    assert (st.chosen.impl, st.chosen.requested, st.chosen.source) == (name, name, "B12X_IMPL")


def test_selection_report(dist):
    from dispatch.vllm_plugin import report

    rows = report.selection_report(n=512, k=512)
    by = {(r.scheme, r.backend, r.plugin): r for r in rows}
    assert len(rows) == len(report.SCHEMES) * 4
    # b12x with the plugin: ours everywhere; every pick is the first "+" of its walk.
    for scheme in report.SCHEMES:
        r = by[(scheme, "b12x", True)]
        assert r.chosen.startswith("B12xDual"), (scheme, r.chosen)
    r = by[("fp8_w8a8 static", "auto", True)]
    assert r.chosen == "PerTensorTorchFP8ScaledMMLinearKernel"
    assert r.reasons[0][0] == "B12xDualFp8TensorKernel" and not r.reasons[0][1]
    assert "SM120/SM121" in r.reasons[0][2]
    first_ok = next(name for name, ok, _ in r.reasons if ok)
    assert first_ok == r.chosen
    # without the plugin, b12x falls back to vLLM's automatic choice here (no in-tree B12x on CPU)
    assert not by[("nvfp4_w4a4", "b12x", False)].chosen.startswith("B12xDual")
    assert "B12xDual" not in report.format_rows([by[("mxfp8", "b12x", False)]])


def test_serve_compare_script_skips_naming_the_device():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_serve_compare.py"), "some/model"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "skipped: needs an SM120/SM121 GPU" in out.stdout and "found no CUDA device" in out.stdout


def test_choice_logged_once_with_reason(dist, ckpt, impl, caplog):
    import logging

    from dispatch.vllm_plugin import placement

    impl("reference")
    placement._logged.clear()
    with caplog.at_level(logging.INFO, logger="dispatch.vllm_plugin"):
        loaded(ckpt("ct_mxfp8"), ("o",))
        loaded(ckpt("ct_mxfp8"), ("o",))
    picks = [r.getMessage() for r in caplog.records if "-> reference" in r.getMessage()]
    assert len(picks) == 1, picks
    assert "B12xDualMxfp8Kernel mxfp8 N=384 K=384 -> reference (B12X_IMPL=reference)" in picks[0]
    eligible = [r.getMessage() for r in caplog.records if "eligible" in r.getMessage()]
    assert eligible and all(msg.count("--linear-backend b12x") == 1 for msg in eligible)


def test_info_vllm_prints_the_selection_table():
    """`b12x-dual info --vllm` (a subprocess: vLLM's platform is chosen at import): every scheme's
    row, ours chosen under --linear-backend b12x with the plugin, the reasons along the walk. Run
    as a new user would, without VLLM_TARGET_DEVICE: on a machine without a GPU the command picks
    vLLM's CPU platform itself (it once crashed: "Failed to infer device type")."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "dispatch.apps.cli", "info", "--vllm", "-N", "256", "-K", "256"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vLLM's kernel selection" in out.stdout
    from dispatch.vllm_plugin import report

    for scheme in report.SCHEMES:
        assert f"\n{scheme}" in out.stdout
    assert "B12xDualNvFp4Kernel" in out.stdout and "- CPUFp8BlockScaledMMKernel" in out.stdout
    if not torch.cuda.is_available():
        assert "vLLM platform: cpu (no CUDA device: VLLM_TARGET_DEVICE=cpu set for this report)" in out.stdout
