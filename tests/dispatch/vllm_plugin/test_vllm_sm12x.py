"""On an SM120/SM121 GPU: under --linear-backend auto our classes are picked and run the CuTe
path; outputs match the oracle and vLLM's in-tree B12x kernels; a warmed layer captures into a
CUDA graph and replays the same numbers. Skips elsewhere, naming the device found. Written to be
run by the first person with the GPU:

    pip install -e '.[dev,vllm]'     # vLLM with its own CUDA torch
    python -m pytest -q tests/dispatch/vllm_plugin/test_vllm_sm12x.py
"""

from __future__ import annotations

import pytest
import torch

from _vllm_env import ckpt, ckpt_root, forward, kernel_of  # noqa: F401
from conftest import device_name, make_input, rel_err
import formats
import harness

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() in ((12, 0), (12, 1))):
    pytest.skip(f"needs an SM120/SM121 GPU (RTX PRO 6000, RTX 5090, DGX Spark); found {device_name()}",
                allow_module_level=True)

from test_vllm_checkpoints import FAMILIES, TRITON_TOL, expected  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def cuda_dist():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    harness.init_distributed()


def _layers(d, which=("qkv",), backend="auto", monkeypatch=None):
    with harness.vllm_context(d, backend) as cfg, torch.device(CUDA):
        layers = harness.make_layers(harness.quant_config(cfg), which)
        return harness.load(layers, d)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_auto_picks_cute_and_matches_oracle(kind, cuda_dist, ckpt, monkeypatch):
    from dispatch.vllm_plugin import ops

    monkeypatch.delenv("B12X_IMPL", raising=False)
    d = ckpt(kind)
    layer = _layers(d)["qkv"]
    assert type(kernel_of(layer)).__name__ == FAMILIES[kind][0]
    st = ops.state(layer.b12x_dual_handle)
    assert st.chosen.impl == "cute", st.chosen.reason
    qw, act, a16 = expected(kind, d, "qkv")
    bias = torch.cat(harness.expected_shards(d, "qkv")["bias"]).to(torch.bfloat16)
    x = make_input((16, qw.k), torch.bfloat16, device="cpu")
    y = forward(layer, x.to(CUDA)).cpu()
    ref = formats.reference_linear(x, qw, bias, a16=a16, **act)
    assert rel_err(y, ref) <= TRITON_TOL


@pytest.mark.parametrize("kind", ["ct_nvfp4", "ct_fp8", "ct_fp8_block", "ct_mxfp8", "ct_mxfp4"])
def test_matches_in_tree_b12x(kind, cuda_dist, ckpt, monkeypatch):
    """Ours vs vLLM's in-tree B12x class on the same checkpoint (ours disabled for the second)."""
    from dispatch.vllm_plugin import kernels as K

    d = ckpt(kind)
    ours = _layers(d)["qkv"]
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", ",".join(k.__name__ for k in K.KERNELS))
    theirs = _layers(d)["qkv"]
    assert type(kernel_of(theirs)).__name__.startswith("B12x") and "Dual" not in type(kernel_of(theirs)).__name__
    x = make_input((16, 384), torch.bfloat16, device="cuda")
    assert rel_err(forward(ours, x), forward(theirs, x)) <= 2 * TRITON_TOL


def test_cuda_graph_after_warmup(cuda_dist, ckpt, monkeypatch):
    from dispatch.vllm_plugin import warmup

    monkeypatch.delenv("B12X_IMPL", raising=False)
    layer = _layers(ckpt("ct_nvfp4"))["qkv"]
    warmup.warmup_model(layer, (1, 8))
    x = make_input((8, 384), torch.bfloat16, device="cuda")
    eager = forward(layer, x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = forward(layer, x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    with pytest.raises(RuntimeError, match="not warmed up"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            forward(layer, make_input((5, 384), torch.bfloat16, device="cuda"))
