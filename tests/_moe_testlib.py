"""Inputs shared by the MoE tests (the lesson's tests/kernels_triton/test_moe.py, the sm_90 MoE's
tests/kernels_triton/hopper/test_hopper_moe.py, the MoE table's tests/dispatch/test_moe_dispatch.py);
it sits in tests/, which pytest puts on sys.path for tests/conftest.py. Values are seeded by conftest's
per-test seed."""

from __future__ import annotations

import math
from typing import Optional

import torch

import formats
from conftest import DEVICE


def moe_experts(fmt: str, E: int, H: int, I: int, *, scale: float = 1.0, on: Optional[str] = None):
    """E experts of W13 [2I, H] and W2 [H, I] quantized to ``fmt`` (formats.quantize), entries of order
    ``scale`` / sqrt(K) so that W13's output and W2's are of order ``scale`` for x of order 1; drawn on
    the CPU and moved to the test device, or drawn on ``on`` (a large GPU layer)."""
    def q(rows, K):
        w = torch.randn(rows, K, device=on or "cpu") * (scale / math.sqrt(K))
        return formats.quantize(w, fmt) if on else formats.quantize(w, fmt).to(DEVICE)
    return [q(2 * I, H) for _ in range(E)], [q(H, I) for _ in range(E)]


def moe_routing(M: int, E: int, top_k: int):
    """topk_ids int32 [M, top_k] (top_k distinct experts per token) and positive router weights
    float32 [M, top_k] in [0.05, 1.05), on the test device."""
    ids = torch.rand(M, E).argsort(dim=1)[:, :top_k].to(torch.int32)
    return ids.to(DEVICE), (torch.rand(M, top_k) + 0.05).to(DEVICE)


def expert_opts(opts, e: int) -> dict:
    """Expert e's activation options: a tensor value with one element per expert is indexed, others kept."""
    return {k: (v.reshape(-1)[e] if isinstance(v, torch.Tensor) and v.numel() > 1 else v)
            for k, v in (opts or {}).items()}
