"""vLLM layer parameters -> formats.QuantizedTensor, for every checkpoint family the plugin serves.

What vLLM leaves on a layer when a kernel's ``process_weights_after_loading`` runs (vLLM 0.33.0):

| family | tensors on the layer |
|---|---|
| CT / ModelOpt FP8 per-tensor | weight e4m3 (K, N) transposed view; weight_scale fp32 0-d (shards requantized to the max); input_scale 0-d or None |
| CT FP8 per-channel (FP8_DYNAMIC) | weight e4m3 (K, N) transposed view; weight_scale fp32 (N, 1), the fused q/k/v or gate/up shards' rows stacked (no requantization); input_scale 0-d (static schemes) or None (dynamic per-token) |
| Fp8Config block (DeepSeek) | weight e4m3 (N, K); weight_scale_inv fp32 or float8_e8m0fnu (ceil(N/128), K/128) |
| CT block FP8 | the same, named weight_scale |
| CT / ModelOpt NVFP4 | weight uint8 (N, K/2); weight_scale e4m3 (N, K/16); weight_global_scale = 1/g_w; input_global_scale_inv = g_x (W4A4) |
| CT MXFP4 | weight uint8 (N, K/2); weight_scale uint8 E8M0 (N, K/32) |
| CT / ModelOpt MXFP8 | weight e4m3 (N, K); weight_scale uint8 E8M0 (N, K/32) |

Every check raises :class:`CheckpointError` (a ValueError) naming the layer, the tensor, what it
holds and what is allowed, so a bad checkpoint fails at load, never at the first request.
Conventions of the result: formats/base.py (nvfp4 global_scale g is a divisor: value = code*s/g).
"""

from __future__ import annotations

from typing import Optional

import torch

from formats import QuantizedTensor
from formats.codecs import decode_e8m0
from formats.base import ieee_div

E8M0_DTYPES = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


class CheckpointError(ValueError):
    """A layer's tensors do not form a weight of the expected format."""


def layer_name(layer: torch.nn.Module) -> str:
    """The layer's checkpoint prefix (vLLM's ``LinearBase.prefix``), else its class name."""
    return getattr(layer, "prefix", "") or type(layer).__name__


def tensor(layer, name: str, *, dtypes, what: str, optional: bool = False) -> Optional[torch.Tensor]:
    """``layer.<name>`` as a plain tensor, checked for presence and dtype."""
    t = getattr(layer, name, None)
    if t is None:
        if optional:
            return None
        raise CheckpointError(f"layer {layer_name(layer)}: {what} needs tensor {name!r}, which is missing "
                              "(not in the checkpoint, or not loaded)")
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor {name!r} has dtype "
                              f"{str(t.dtype).replace('torch.', '')}; allowed: {allowed}")
    return t


def _shape(layer, name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor {name!r} has shape {tuple(t.shape)}, "
                              f"expected {tuple(expected)}")


def check_k(layer, what: str, k: int, multiple: int) -> None:
    """K of this tensor-parallel shard must be a positive multiple of the format's block."""
    if k <= 0 or k % multiple:
        raise CheckpointError(f"layer {layer_name(layer)}: {what} needs the shard's K (input features per "
                              f"tensor-parallel rank) to be a positive multiple of {multiple}, got K={k}")


def scalar(layer, name: str, what: str, *, optional: bool = False) -> Optional[torch.Tensor]:
    """A per-tensor scale as a float32 0-d tensor; finite and positive."""
    t = tensor(layer, name, dtypes=(torch.float32, torch.bfloat16, torch.float16), what=what, optional=optional)
    if t is None:
        return None
    if t.numel() != 1:
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor {name!r} must hold one scale, "
                              f"got shape {tuple(t.shape)}")
    t = t.reshape(()).to(torch.float32)
    if not bool(torch.isfinite(t)) or not bool(t > 0):
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor {name!r} = {float(t)!r}; a scale "
                              "must be finite and positive (an unloaded or corrupt scale)")
    return t.clone()


def _finite(layer, name: str, t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t.float()).all()):
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor {name!r} holds NaN or Inf "
                              "(an unloaded or corrupt scale)")


def e8m0_to_fp32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 2^(b-127), for UE8M0 block-FP8 scales
    (formats.codecs.decode_e8m0: 0x00 is 2^-127, 0xFF is NaN)."""
    return decode_e8m0(s.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# One function per format: (layer, shard shape) -> QuantizedTensor (+ activation options)
# ---------------------------------------------------------------------------------------------
def fp8_tensor(layer, n: int, k: int, *, static_input: bool) -> tuple[QuantizedTensor, dict]:
    """Per-tensor FP8 (CT W8A8 / ModelOpt FP8 after vLLM's processing).

    Reads weight e4m3 (K, N) (the transposed view vLLM leaves; (N, K) is accepted too),
    weight_scale fp32 0-d (the max over fused shards, which vLLM requantized to it) and, for a
    static scheme, input_scale fp32 0-d. Returns (QuantizedTensor fp8_tensor [N, K], {"scale":
    input scale or None for dynamic}). Raises CheckpointError.
    """
    what = "per-tensor FP8"
    w = tensor(layer, "weight", dtypes=(torch.float8_e4m3fn,), what=what)
    if tuple(w.shape) == (k, n):  # CT / ModelOpt hand over the (K, N) transpose
        w = w.t()
    _shape(layer, "weight", w, (n, k), what)
    s = scalar(layer, "weight_scale", what)
    x_s = scalar(layer, "input_scale", what, optional=not static_input)
    qw = QuantizedTensor("fp8_tensor", "weight", w.contiguous(), s, None, None, (n, k))
    return qw, {"scale": x_s}


def fp8_channel(layer, n: int, k: int, *, static_input: bool) -> tuple[QuantizedTensor, dict]:
    """Per-channel FP8 (CT FP8_DYNAMIC, strategy "channel", after vLLM's processing).

    Reads weight e4m3 (K, N) (the transposed view vLLM leaves; (N, K) is accepted too),
    weight_scale (N, 1) or (N,) fp32/bf16/fp16 (one scale per output channel: the rows of fused
    q/k/v or gate/up shards stacked in vLLM's order) and, for a static scheme, input_scale fp32 0-d
    (the max over fused shards, as vLLM leaves it). Returns (QuantizedTensor fp8_channel [N, K]
    with scale float32 [N], {"scale": input scale, or None for the dynamic per-token scales}).
    Raises CheckpointError naming the layer and tensor: a weight_scale of the wrong length, or one
    that is zero, negative, NaN or Inf (naming the first such output channel and its value).
    """
    what = "per-channel FP8"
    w = tensor(layer, "weight", dtypes=(torch.float8_e4m3fn,), what=what)
    if tuple(w.shape) == (k, n):  # CT hands over the (K, N) transpose
        w = w.t()
    _shape(layer, "weight", w, (n, k), what)
    s = tensor(layer, "weight_scale", dtypes=(torch.float32, torch.bfloat16, torch.float16), what=what)
    if tuple(s.shape) not in ((n, 1), (n,)):
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor 'weight_scale' has shape {tuple(s.shape)}, "
                              f"expected ({n}, 1) or ({n},): one scale per output channel (N={n})")
    s = s.reshape(n).to(torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor 'weight_scale' holds {float(s[i])!r} for "
                              f"output channel {i} (of {n}); every per-channel scale must be finite and > 0 "
                              "(an unloaded or corrupt scale)")
    x_s = scalar(layer, "input_scale", what, optional=not static_input)
    qw = QuantizedTensor("fp8_channel", "weight", w.contiguous(), s.contiguous(), None, (1, k), (n, k))
    return qw, {"scale": x_s}


def fp8_block(layer, n: int, k: int) -> tuple[QuantizedTensor, dict]:
    """Block FP8 (DeepSeek ``Fp8Config`` weight_scale_inv, CT FP8_BLOCK weight_scale).

    Reads weight e4m3 (N, K) and the block scales (ceil(N/128), K/128) in the dtype of vLLM's
    parameter: float32 (vLLM 0.32/0.33 always: a UE8M0 checkpoint's float8_e8m0fnu scales arrive as
    their exact float32 powers of two) or float8_e8m0fnu (the parameter dtype vLLM's Fp8 method
    creates when its quant config sets ``is_scale_e8m0``; decoded exactly, byte b -> 2^(b-127)).
    uint8 block scales never reach here: the load checks refuse them in the file (loading.py), since
    vLLM's float32 parameter would take the bytes as integers. Returns (QuantizedTensor fp8_block, {}).
    Raises CheckpointError (also for K % 128 != 0 in this shard).
    """
    what = "block FP8 (128x128)"
    check_k(layer, what, k, 128)
    w = tensor(layer, "weight", dtypes=(torch.float8_e4m3fn,), what=what)
    _shape(layer, "weight", w, (n, k), what)
    name = "weight_scale_inv" if getattr(layer, "weight_scale_inv", None) is not None else "weight_scale"
    s = tensor(layer, name, dtypes=(torch.float32, torch.bfloat16) + E8M0_DTYPES[1:], what=what)
    _shape(layer, name, s, (-(-n // 128), k // 128), what)
    ue8m0 = s.dtype in E8M0_DTYPES
    s = e8m0_to_fp32(s) if ue8m0 else s.to(torch.float32)
    _finite(layer, name, s, what)
    qw = QuantizedTensor("fp8_block", "weight", w.contiguous(), s.contiguous(), None, (128, 128), (n, k))
    return qw, {}


def mxfp8(layer, n: int, k: int) -> tuple[QuantizedTensor, dict]:
    """MXFP8 (CT / ModelOpt): weight e4m3 (N, K), weight_scale E8M0 bytes (N, K/32), OCP MX v1.0.
    Returns (QuantizedTensor mxfp8, {}). Raises CheckpointError."""
    what = "MXFP8"
    check_k(layer, what, k, 32)
    w = tensor(layer, "weight", dtypes=(torch.float8_e4m3fn,), what=what)
    _shape(layer, "weight", w, (n, k), what)
    s = tensor(layer, "weight_scale", dtypes=E8M0_DTYPES, what=what)
    _shape(layer, "weight_scale", s, (n, k // 32), what)
    qw = QuantizedTensor("mxfp8", "weight", w.contiguous(), s.view(torch.uint8).contiguous(), None, (1, 32), (n, k))
    return qw, {}


def _fp4_codes(layer, what: str) -> tuple[torch.Tensor, int, int]:
    w = tensor(layer, "weight", dtypes=(torch.uint8,), what=what)
    if w.dim() != 2:
        raise CheckpointError(f"layer {layer_name(layer)}: {what} tensor 'weight' must be 2-D (N, K/2), "
                              f"got shape {tuple(w.shape)}")
    return w, int(w.shape[0]), 2 * int(w.shape[1])


def nvfp4(layer, *, a16: bool) -> tuple[QuantizedTensor, dict]:
    """NVFP4 (CT / ModelOpt after vLLM's processing): weight uint8 (N, K/2) (element 2i in the low
    nibble), weight_scale e4m3 (N, K/16) linear, weight_global_scale fp32 0-d = 1/g_w and, for
    W4A4, input_global_scale_inv fp32 0-d = g_x. Returns (QuantizedTensor nvfp4 with
    global_scale g_w = 1/weight_global_scale (IEEE division), {"global_scale": g_x} or {}).
    Source: NVIDIA NVFP4 recipe; vLLM's CT/ModelOpt NVFP4 schemes. Raises CheckpointError.
    """
    what = "NVFP4 W4A16" if a16 else "NVFP4 W4A4"
    w, n, k = _fp4_codes(layer, what)
    check_k(layer, what, k, 16)
    s = tensor(layer, "weight_scale", dtypes=(torch.float8_e4m3fn,), what=what)
    _shape(layer, "weight_scale", s, (n, k // 16), what)
    _finite(layer, "weight_scale", s, what)
    # vLLM hands over the dequantization multiplier 1/g (CT inverts its divisor, ModelOpt stores it).
    g = ieee_div(torch.ones((), dtype=torch.float32), scalar(layer, "weight_global_scale", what))
    qw = QuantizedTensor("nvfp4", "weight", w.contiguous(), s.contiguous(), g, (1, 16), (n, k))
    if a16:
        return qw, {}
    return qw, {"global_scale": scalar(layer, "input_global_scale_inv", what)}


def mxfp4(layer) -> tuple[QuantizedTensor, dict]:
    """MXFP4 (CT mxfp4-pack-quantized, renamed weight by vLLM): weight uint8 (N, K/2), weight_scale
    E8M0 bytes (N, K/32), OCP MX v1.0. Returns (QuantizedTensor mxfp4, {}). Raises CheckpointError."""
    what = "MXFP4"
    w, n, k = _fp4_codes(layer, what)
    check_k(layer, what, k, 32)
    s = tensor(layer, "weight_scale", dtypes=E8M0_DTYPES, what=what)
    _shape(layer, "weight_scale", s, (n, k // 32), what)
    qw = QuantizedTensor("mxfp4", "weight", w.contiguous(), s.view(torch.uint8).contiguous(), None, (1, 32), (n, k))
    return qw, {}
