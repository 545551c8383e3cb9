"""The route of the sm_90 FP4 GEMMs (hopper.nvfp4, hopper.mxfp4): which kernels one call launches,
with which tile, and why. A pure function of the problem and the device, decided here once; the
launchers execute exactly the plan it returns (``Plan.kind`` says which launcher, ``Plan.config``
the tile it gets).

The rules, by M (the activation rows):

    M = 0             nothing is launched (an empty [M, N] result)
    1 <= M <= 16      the swapped decode GEMM (hopper._fp4_decode; its tile: _fp4_decode_tile.decode_tile)
                      W4A4: the quantizer writes the GEMM's activation planes (one launch less);
                      W4A4 on quantized operands: act_planes_kernel dequantizes them;
                      W4A16 bf16: act_planes_kernel reorders x; W4A16 fp16 keeps the fused kernel
                      (exact hi/lo bf16 halves; the decode GEMM's planes are bf16)
    16 < M <= 128     the fused kernel with split-K (hopper._fp4_gemm.fp4_gemm_config)
    M > 128           the pre-pass (each operand dequantized once to bf16) and a bf16 GEMM;
                      fp16 W4A16 keeps the fused kernel with the tile of M = 128
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._common import device_capability
from . import supported
from ._route import Route, TileConfig, check_sm_count_and_x_dtype, sm_count
from ._twopass import splitk_plan
from ._fp4_decode_tile import decode_applies, decode_tile
from ._fp4_gemm import PREPASS_MIN_M, fp4_gemm_config, gemm_kernels

IMPL = "hopper"
KINDS = ("none", "decode_planes", "decode", "gemm")


def check_capability(capability) -> None:
    """ValueError naming the capability unless supported()."""
    ok, why = supported(capability)
    if not ok:
        raise ValueError(f"capability must be an sm_90 one, (9, x), for the hopper kernels, got {capability!r}: {why}")


def device_plan(fmt: str, M: int, N: int, K: int, device, *, a16: bool, x_dtype: torch.dtype,
                quantizer: tuple[str, ...]) -> "Plan":
    """plan() for the operands' ``device``: its capability and SM count. ValueError naming the
    device unless it is an sm_90 GPU (under the interpreter no device is)."""
    cap = device_capability(device)
    ok, why = supported(cap)
    if not ok:
        raise ValueError(f"qweight.device must be an sm_90 GPU for the hopper kernels, got {device}: {why}")
    return plan(fmt, M, N, K, capability=cap, sm_count=sm_count(device), a16=a16, x_dtype=x_dtype,
                quantizer=quantizer)


@dataclass(frozen=True)
class Plan:
    """A route with what its launcher needs: ``kind`` (KINDS) and the tile ``config``."""

    route: Route
    kind: str
    config: TileConfig | None


def plan(fmt: str, M: int, N: int, K: int, *, capability, sm_count: int, a16: bool,
         x_dtype: torch.dtype, quantizer: tuple[str, ...]) -> Plan:
    """The plan of one hopper call of format ``fmt`` ("nvfp4" / "mxfp4") on an [M, K] x [N, K]^T
    problem. ``quantizer``: the names of the activation quantizer's kernels that run before the
    GEMM (W4A4 linear), or () for a GEMM on quantized operands and for W4A16 (the module
    docstring has the rules).

    Raises ValueError for a capability that is not sm_90, a negative dimension, an sm_count < 1 or
    an x_dtype other than bf16/fp16."""
    check_capability(capability)
    if min(M, N, K) < 0:
        raise ValueError(f"M, N, K must be >= 0, got {(M, N, K)}")
    check_sm_count_and_x_dtype(sm_count, x_dtype)
    variant = f"{fmt} {'W4A16 ' + str(x_dtype).removeprefix('torch.') if a16 else 'W4A4'}"
    if M == 0:
        return Plan(Route(IMPL, (), why=f"{variant}: no rows, nothing to launch"), "none", None)
    quant = () if a16 else quantizer
    if N == 0:
        return Plan(Route(IMPL, quant, why=f"{variant}: no columns, only the quantizer"), "none", None)
    if decode_applies(M, capability, a16, x_dtype):
        cfg = decode_tile(M, N, K, sm_count, fmt, a16)
        reduce = ("splitk_reduce_kernel",) if cfg.SPLIT_K > 1 else ()
        if quant:
            kind, first = "decode_planes", quant
            how = "the quantizer writes the activation planes, then the swapped decode GEMM"
        else:
            kind, first = "decode", ("act_planes_kernel",)
            how = "act_planes_kernel lays out the activation, then the swapped decode GEMM"
        why = (f"{variant} at M = {M} <= 16 on sm_90: {how} (decode_tile: split-K to <= 2 programs "
               f"per SM of {sm_count})")
        return Plan(Route(IMPL, first + ("fp4_decode_gemm_kernel",) + reduce, str(cfg), cfg.SPLIT_K, why),
                    kind, cfg)
    fp16_a16 = a16 and x_dtype == torch.float16
    cfg = fp4_gemm_config(min(M, PREPASS_MIN_M) if fp16_a16 else M, N, K, False)
    # the split count splitk_plan launches (fewer where whole BLOCK_K steps cannot fill them all)
    cfg = dataclasses.replace(cfg, SPLIT_K=splitk_plan(K, cfg)[0]) if cfg.SPLIT_K > 1 else cfg
    if cfg.PREPASS:
        how = f"M = {M} > {PREPASS_MIN_M}: the pre-pass dequantizes each operand once, then a bf16 GEMM"
    elif fp16_a16 and M <= 16:
        how = f"fp16 W4A16 at M = {M}: the fused kernel with exact hi/lo bf16 halves"
    else:
        how = f"M = {M}: the fused kernel (fp4_gemm_config{', split-K' if cfg.SPLIT_K > 1 else ''})"
    kernels = quant + gemm_kernels(cfg, a16, x_dtype)
    return Plan(Route(IMPL, kernels, str(cfg), cfg.SPLIT_K, f"{variant} on sm_90: {how}"), "gemm", cfg)
