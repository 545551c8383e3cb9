"""Fixtures of the engine tests (a real vLLM engine on the CPU; see engine_env.py)."""

from __future__ import annotations

import engine_env
import pytest


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    """Where the tiny models' checkpoints are written (once per session)."""
    return tmp_path_factory.mktemp("engine_ckpts")


@pytest.fixture(scope="session")
def model_dir(ckpt_root):
    """model_dir(kind, family="llama") -> the checkpoint directory of ``kind`` ("bf16", a
    compressed-tensors preset or a ModelOpt kind: engine_env.write_model) for ``family``."""
    return lambda kind, family="llama": engine_env.write_model(ckpt_root, kind, family)
