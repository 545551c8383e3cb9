"""kernels_cute stands on its own: no kernels_triton import anywhere in it, its format list comes
from formats/, and it answers (False, reason) for what it does not serve instead of raising."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import formats
import kernels_cute

ROOT = Path(__file__).resolve().parents[2]
SM120 = SimpleNamespace(capability=(12, 0), sm_count=188, kind="cuda", name="RTX PRO 6000 (described)")

_IMPORT_ALL = r"""
import importlib, pkgutil, sys
import kernels_cute
names = ["kernels_cute"] + [m.name for m in pkgutil.walk_packages(kernels_cute.__path__, "kernels_cute.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m == "kernels_triton" or m.startswith("kernels_triton."))
print(len(names), "modules;", "kernels_triton modules imported:", bad)
sys.exit(1 if bad else 0)
"""


def test_importing_every_kernels_cute_module_imports_no_kernels_triton_module():
    # a fresh process: tests/conftest.py imports kernels_triton into this one
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert int(p.stdout.split()[0]) >= 14, p.stdout  # the package, 7 format/helper modules, quant's 7


def test_no_kernels_triton_in_the_source():
    """Not even a lazy import inside a function (the subprocess test sees only module-level ones)."""
    for path in (ROOT / "kernels_cute").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            assert not ("import kernels_triton" in code or "from kernels_triton" in code), f"{path}:{n}: {line}"


def test_format_list_derives_from_formats():
    assert kernels_cute.FORMATS == formats.FORMAT_NAMES
    assert set(kernels_cute.VARIANTS) == set(formats.FORMAT_NAMES) | {"nvfp4_w4a16", "mxfp4_w4a16", "mxfp8_w8a16"}
    assert "mxfp4_w4a16" not in kernels_cute.SERVED and "nvfp4_w4a16" in kernels_cute.SERVED
    assert "mxfp8_w8a16" in kernels_cute.SERVED and "fp8_channel" not in kernels_cute.SERVED


def test_fp8_channel_is_declared_unsupported_with_b12xs_reason():
    """kernels_cute/fp8_channel.py declares the gap; every entry point gives its reason."""
    why = kernels_cute.not_served("fp8_channel")
    assert why.startswith("b12x 1.5.1 has no per-channel FP8 GEMM")
    ok, msg = kernels_cute.supported("fp8_channel", 8, 4096, 4096, SM120)
    assert not ok and why in msg
    with pytest.raises(ValueError, match="no per-channel FP8 GEMM"):
        kernels_cute.module("fp8_channel")


@pytest.mark.parametrize("name", ["fp6_e3m2", "int4_awq", "", "NVFP4"])
def test_an_unknown_or_unserved_format_gives_false_with_a_reason(name):
    """A format registered in formats/ alone (or a typo) must not break auto on SM12x."""
    ok, why = kernels_cute.supported(name, 8, 4096, 4096, SM120)
    assert not ok and "kernels_cute does not serve" in why and repr(name) in why
    with pytest.raises(ValueError, match="fmt must be one of"):
        kernels_cute.module(name)


def test_a_format_new_to_formats_is_not_served(monkeypatch):
    monkeypatch.setattr(kernels_cute, "VARIANTS", kernels_cute.VARIANTS + ("fp6_e3m2",))
    ok, why = kernels_cute.supported("fp6_e3m2", 8, 4096, 4096, SM120)
    assert not ok and "a format formats/ defines but" in why
    with pytest.raises(ValueError, match="kernels_cute does not serve 'fp6_e3m2'"):
        kernels_cute.module("fp6_e3m2")


def test_nvfp4_w4a16_is_served_for_bf16_and_declines_fp16():
    pytest.importorskip("b12x", reason="b12x is not installed (pip install -e '.[dev]' brings b12x==1.5.1)")
    ok, why = kernels_cute.supported("nvfp4_w4a16", 8, 4096, 4096, SM120, dtype=torch.bfloat16)
    assert ok, why
    ok, why = kernels_cute.supported("nvfp4_w4a16", 8, 4096, 4096, SM120, dtype=torch.float16)
    assert not ok and "bfloat16 activations only" in why
    ok, why = kernels_cute.supported("nvfp4_w4a16", 8, 4096, 4100, SM120)
    assert not ok and "K % 128" in why


def test_linear_takes_no_quantizer_option():
    """The quantizer="triton" option is gone: Triton quantizer + CuTe GEMM is composed outside
    (dispatch) with kernels_cute.<fmt>.gemm on the Triton quantizer's output."""
    import inspect

    for fmt in ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4"):
        mod = kernels_cute.module(fmt)
        for fn in (mod.linear, mod.quantize_activation):
            assert "quantizer" not in inspect.signature(fn).parameters, f"{fmt}.{fn.__name__}"
        assert list(inspect.signature(mod.gemm).parameters) == ["xq", "prepared", "bias", "out_dtype"]
