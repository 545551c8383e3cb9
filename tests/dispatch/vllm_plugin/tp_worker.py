"""Tensor parallelism on the CPU machine: two processes over gloo load the checkpoint layers'
shards through vLLM's loaders and write their outputs (run by test_vllm_tp.py).

    python tp_worker.py OUT_DIR CKPT_ROOT KIND [KIND ...]

Rank r writes OUT_DIR/r<r>.pt: {kind: {"col": rank's column shard (qkv; for block FP8 the MLP up
projection, since a q/k/v shard of 192 rows cannot hold 128-row blocks and vLLM refuses it),
"down": reduced output, "kernel"}}, "refused": the error for a block-FP8 layer whose shard K is
1440 (2880 at TP = 2), and "refused_qkv": vLLM's error for the block-FP8 q/k/v shard.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch  # noqa: E402

WORLD = 2


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, harness.HIDDEN, generator=g).to(torch.bfloat16),
            torch.randn(4, harness.INTER, generator=g).to(torch.bfloat16))


def col_layer(kind: str) -> str:
    return "up" if "block" in kind else "qkv"


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test asserts on the message)
        return f"{type(e).__name__}: {e}"
    return ""


def rank_main(rank: int, port: int, out: str, root: str, kinds: list[str]) -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    harness.init_distributed(WORLD, rank, port)
    x, x2 = inputs()
    shard = harness.INTER // WORLD
    result = {}
    for kind in kinds:
        d = Path(root) / kind
        col = col_layer(kind)
        with harness.vllm_context(d) as cfg:
            layers = harness.load(harness.make_layers(harness.quant_config(cfg), (col, "down")), d)
            result[kind] = {
                "col": layers[col](x)[0],
                # RowParallelLinear takes this rank's K shard (input_is_parallel) and all-reduces.
                "down": layers["down"](x2[:, rank * shard:(rank + 1) * shard])[0],
                "kernel": type(layers["down"].b12x_warmup_provider).__name__,
            }
    d = Path(root) / "ct_fp8_block"
    if d.exists():
        with harness.vllm_context(d) as cfg:
            result["refused"] = _error(lambda: RowParallelLinear(
                2880, 256, bias=False, quant_config=harness.quant_config(cfg),
                prefix=f"{harness.PREFIX}.{harness.LINEARS['down'][0]}"))
            result["refused_qkv"] = _error(lambda: harness.make_layers(harness.quant_config(cfg), ("qkv",)))
    torch.save(result, Path(out) / f"r{rank}.pt")


if __name__ == "__main__":
    import torch.multiprocessing as mp

    # Only as a script: test_vllm_tp imports this module into the pytest process, where a default
    # written into os.environ would leak into every later test and its subprocesses.
    os.environ.setdefault("B12X_IMPL", "reference")

    out, root, *kinds = sys.argv[1:]
    mp.spawn(rank_main, args=(harness.free_port(), out, root, kinds), nprocs=WORLD)
