"""Fixtures of the engine tests (a real vLLM engine on the CPU; see engine_env.py)."""

from __future__ import annotations

import engine_env
import pytest


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    """Where the tiny model's checkpoints are written (once per session)."""
    return tmp_path_factory.mktemp("engine_ckpts")


@pytest.fixture(scope="session")
def model_dir(ckpt_root):
    """model_dir(kind) -> the checkpoint directory of ``kind`` ("bf16" or one of engine_env.KINDS)."""
    return lambda kind: engine_env.write_model(ckpt_root, kind)
