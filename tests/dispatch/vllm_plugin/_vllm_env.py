"""Fixtures of the vLLM tests (imported by each test module; no conftest.py here, so that the
top-level tests/conftest.py stays the only module named ``conftest``).

vLLM 0.33.0 must be installed (``pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt``);
without it every test here skips, saying so. CI installs it, so CI never sees that skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402

if not torch.cuda.is_available():  # vLLM's CPU platform (without it VllmConfig() cannot infer a device)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_PLUGINS", "b12x_dual")

INSTALL = "pip install --no-deps -r tests/dispatch/vllm_plugin/requirements-cpu.txt"
try:
    import vllm  # noqa: F401
    # a real vLLM, not a namespace package of that name (the H200's image has one: `import vllm`
    # succeeded there while every fixture failed on vllm.plugins)
    from vllm.plugins import load_general_plugins  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"vLLM 0.33.0 is not importable ({type(e).__name__}: {e}); install it with: {INSTALL}",
                allow_module_level=True)

import checkpoints  # noqa: E402
import harness  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    """One checkpoint directory for all xdist workers of this run (written once, under a lock)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' basetemps share this run's parent
        base = base.parent
    root = base / "b12x_vllm_checkpoints"
    root.mkdir(exist_ok=True)
    return root


def written_once(root: Path, write):
    """get(kind) -> ``write(root, kind)``, under the kind's file lock in ``root``: one writer per
    checkpoint across the run's xdist workers (the writers skip a checkpoint already there)."""
    from filelock import FileLock

    def get(kind: str) -> Path:
        with FileLock(str(root / f"{kind}.lock")):
            return write(root, kind)

    return get


@pytest.fixture(scope="session")
def ckpt(ckpt_root):
    """ckpt(kind) -> the checkpoint directory of that kind (checkpoints.KINDS), built on first use."""
    return written_once(ckpt_root, lambda root, kind: checkpoints.build(kind, root))


@pytest.fixture(scope="session")
def dist():
    """vLLM's distributed state, world size 1 over gloo (once per process)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    harness.init_distributed()
    return True


@pytest.fixture
def impl(monkeypatch):
    """impl(name): set B12X_IMPL for this test (the plugin reads it at load time)."""

    def set_impl(name: str):
        monkeypatch.setenv("B12X_IMPL", name)

    return set_impl


def loaded(kind_dir: Path, which=("qkv",), linear_backend: str = "b12x", per_quant=None, **kw):
    """vLLM layers of one checkpoint, loaded and processed inside its vLLM config."""
    with harness.vllm_context(kind_dir, linear_backend, per_quant) as cfg:
        layers = harness.make_layers(harness.quant_config(cfg), which)
        return harness.load(layers, kind_dir, **kw), cfg


def forward(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's output (vLLM layers return (output, output_bias))."""
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def kernel_of(layer):
    """The linear kernel object vLLM chose for a layer (CT scheme, ModelOpt / Fp8 method)."""
    for owner in (getattr(layer, "scheme", None), layer.quant_method):
        for attr in ("kernel", "fp8_linear", "w8a8_block_fp8_linear"):
            k = getattr(owner, attr, None)
            if k is not None and hasattr(k, "apply_weights"):
                return k
    raise AssertionError(f"no linear kernel found on {type(layer.quant_method).__name__}")
