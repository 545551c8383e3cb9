"""What ``b12x-dual bench`` runs: the shape table (from the models' config.json files), the
``--shapes`` selection, the (shape, M) plan in priority order, the baselines it times, and the
inputs each configuration gets (weights per shape, activations, the rows re-checked).

The table and the method are described in ``dispatch/apps/bench.py`` (the command's ``--help``) and
docs/bench.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

import formats
from dispatch.contract import DECODE_M, PREFILL_M

from . import _harness as H


@dataclass(frozen=True)
class Shape:
    id: str
    model: str
    layer: str
    N: int
    K: int
    extra_m: tuple[int, ...] = ()
    default: bool = True


SHAPES: list[Shape] = [
    Shape("square", "-", "square 8192 x 8192", 8192, 8192, extra_m=(8192,)),
    Shape("llama3.1-8b:qkv", "Llama-3.1-8B", "qkv_proj", 6144, 4096),
    Shape("llama3.1-8b:gate_up", "Llama-3.1-8B", "gate_up_proj (2 x 14336)", 28672, 4096),
    Shape("llama3.1-8b:down", "Llama-3.1-8B", "down_proj", 4096, 14336),
    Shape("qwen3-32b:qkv", "Qwen3-32B", "qkv_proj", 10240, 5120),
    Shape("qwen3-32b:gate_up", "Qwen3-32B", "gate_up_proj (2 x 25600)", 51200, 5120),
    Shape("qwen3-32b:down", "Qwen3-32B", "down_proj", 5120, 25600),
    Shape("deepseek-v3:q_a_kv_a", "DeepSeek-V3", "q_a + kv_a (1536 + 576)", 2112, 7168),
    Shape("deepseek-v3:q_b", "DeepSeek-V3", "q_b_proj (from q_lora 1536)", 24576, 1536),
    Shape("deepseek-v3:o", "DeepSeek-V3", "o_proj", 7168, 16384),
    Shape("deepseek-v3:mlp_gate_up", "DeepSeek-V3", "dense gate_up (2 x 18432)", 36864, 7168, default=False),
    Shape("deepseek-v3:mlp_down", "DeepSeek-V3", "dense down_proj", 7168, 18432, default=False),
    Shape("tiny", "-", "CPU interpreter smoke shape", 64, 128, default=False),
]
SHAPE_BY_ID = {s.id: s for s in SHAPES}
GRAPH_MAX_M = 512
"""The largest M timed by CUDA-graph replay: vLLM's default largest captured batch
(max_cudagraph_capture_size 512), so every M a serving engine replays from a graph is timed that way."""
BENCH_M = (*DECODE_M, 64, 512, PREFILL_M)
"""The Ms bench times by default on a GPU: the decode classes (dispatch.contract.DECODE_M), a
decode batch of 64, a short prefill of 512 and the prefill class (PREFILL_M)."""
QUICK_SHAPES = ("square", "llama3.1-8b:qkv", "llama3.1-8b:down")
QUICK_M = (*DECODE_M, PREFILL_M)
BASELINES = ("torch_bf16", "torch_fp8_tensor", "torch_fp8_block", "torch_fp8_channel")
BASELINE_NOTES = {
    "torch_bf16": "torch F.linear on bf16 (cuBLAS), whole linear",
    "torch_fp8_tensor": "torch._scaled_mm per-tensor e4m3, use_fast_accum=False, GEMM alone",
    "torch_fp8_block": "torch._scaled_mm blockwise e4m3 (1x128 act, 128x128 weight scales), GEMM alone",
    "torch_fp8_channel": "torch._scaled_mm row-wise e4m3 (per-token act, per-channel weight scales), GEMM alone",
}
CHECK_ROWS = 256  # rows of y re-checked against the float64 reference (evenly spaced)
CPU_NOTE = ("CPU: no CUDA device. Kernels ran in Triton's INTERPRETER and were timed with host "
            "timers: these timings are NOT performance numbers; they only show that the harness runs.")


def select_shapes(spec: Optional[str], *, gpu: bool, quick: bool) -> list[Shape]:
    """--shapes: ids, model prefixes, "default", "all" or NxK (comma separated); ValueError naming
    what is allowed for anything else."""
    if spec is None:
        if not gpu:
            return [SHAPE_BY_ID["tiny"]]
        return [SHAPE_BY_ID[i] for i in QUICK_SHAPES] if quick else [s for s in SHAPES if s.default]
    out: list[Shape] = []
    for item in [t.strip() for t in spec.split(",") if t.strip()]:
        if item == "default":
            out += [s for s in SHAPES if s.default]
        elif item == "all":
            out += [s for s in SHAPES if s.id != "tiny"]
        elif item in SHAPE_BY_ID:
            out.append(SHAPE_BY_ID[item])
        elif any(s.id.startswith(item + ":") for s in SHAPES):
            out += [s for s in SHAPES if s.id.startswith(item + ":")]
        elif re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", item.lower()):
            n, k = (int(v) for v in item.lower().split("x"))
            out.append(Shape(f"{n}x{k}", "-", "given", n, k))
        else:
            raise ValueError(f"unknown shape {item!r}; ids: {[s.id for s in SHAPES]}, model prefixes, "
                             "'default', 'all', or NxK with positive integers")
    seen, uniq = set(), []
    for s in out:
        if s.id not in seen:
            seen.add(s.id)
            uniq.append(s)
    return uniq


def plan(shapes: list[Shape], ms: Optional[list[int]], *, gpu: bool, quick: bool) -> list[tuple[Shape, int]]:
    """(shape, M) in priority order: the square shape's target Ms first (16, 4096, 8192), then the
    rest shape by shape, so that a time budget cuts the least important configurations."""
    base: list[int] = []
    if ms is None:
        base = list(BENCH_M) if gpu else list(DECODE_M)
        if quick:
            base = list(QUICK_M) if gpu else [1]
    pairs = []
    for s in shapes:
        m_list = list(ms) if ms is not None else base + ([m for m in s.extra_m if gpu and not quick])
        pairs += [(s, m) for m in m_list]
    prio = {16: 0, 4096: 1, 8192: 2}

    def key(p):
        if p[0].id != "square":
            return (2, 0)
        return (0, prio[p[1]]) if p[1] in prio else (1, 0)

    return sorted(pairs, key=key)  # stable: the rest keeps the order of --shapes and M


# ---------------------------------------------------------------------------------------------
# Inputs per shape
# ---------------------------------------------------------------------------------------------
def rand_x(M: int, K: int, gen: torch.Generator, device) -> torch.Tensor:
    """Random bf16 activations on the device (normal, ~0.2% outliers x40); never zeros."""
    x = torch.randn(M, K, generator=gen, device=device, dtype=torch.float32)
    mask = torch.rand(M, K, generator=gen, device=device) < 0.002
    return torch.where(mask, x * 40, x).to(torch.bfloat16)


class ShapeCache:
    """Per shape: the float32 master weight, the oracle's quantized weights and their float64
    dequantizations (for --check), built lazily and dropped together."""

    def __init__(self, shape: Shape, device, seed: int):
        self.shape, self.device = shape, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.w = torch.randn(shape.N, shape.K, generator=self.gen, device=device) * 0.05
        self._q: dict[str, formats.QuantizedTensor] = {}
        self._wd: dict[str, torch.Tensor] = {}

    def qweight(self, fmt: str) -> formats.QuantizedTensor:
        if fmt not in self._q:
            self._q[fmt] = formats.quantize(self.w, fmt, role="weight")
        return self._q[fmt]

    def wd(self, fmt: Optional[str]) -> torch.Tensor:
        key = fmt or "bf16"
        if key not in self._wd:
            if fmt is None:
                self._wd[key] = self.w.to(torch.bfloat16).to(torch.float64)
            else:
                self._wd[key] = formats.dequantize(self.qweight(fmt), torch.float64)
        return self._wd[key]


def n_sets_for(set_bytes: int, l2_bytes: int, *, gpu: bool, cap_bytes: float = 8e9) -> int:
    """Distinct input sets so that one rotation touches >= 4x the L2 (>= 2 sets, <= 64, <= cap)."""
    if not gpu:
        return 1
    want = math.ceil(4 * max(l2_bytes, 50 << 20) / max(set_bytes, 1))
    return int(max(2, min(64, want, cap_bytes // max(set_bytes, 1))))


def check_rows(M: int) -> torch.Tensor:
    n = min(M, CHECK_ROWS)
    return torch.linspace(0, M - 1, n).round().long().unique()


def check_output(y: torch.Tensor, ref_rows: torch.Tensor, rows: torch.Tensor, tol: float) -> dict[str, Any]:
    """Errors of y[rows] against the float64 reference rows: norm_rel and max_rel against the exact
    value, norm_rel_rounded against the reference rounded to y's dtype (what is left beyond the output
    rounding)."""
    yr = y.reshape(-1, y.shape[-1])[rows.to(y.device)]
    m = H.compare_outputs(yr, ref_rows)
    mr = H.compare_outputs(yr, ref_rows.to(y.dtype))
    return {"norm_rel": m["norm_rel"], "max_rel": m["max_rel"], "cosine": m["cosine"],
            "norm_rel_rounded": mr["norm_rel"], "tol_norm_rel": tol, "rows": int(rows.numel()),
            "ok": bool(m["norm_rel"] <= tol)}
