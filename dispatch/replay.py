"""Replay files: one linear call, captured so that anyone can rerun its arithmetic on any machine.

A replay file is a safetensors file (``*.b12x-replay.safetensors``). Tensors:

    x                     the activation [M, K] as the layer received it (bf16/fp16)
    y                     the output the implementation produced [M, N] (absent when not captured)
    weight.data           the layer's quantized weight: codes, block scales, global scale (nvfp4),
    weight.scale            as formats.QuantizedTensor holds them (formats/base.py)
    weight.global_scale
    bias                  [N] (absent without bias)
    opt.<name>            activation options that are tensors (fp8_tensor ``scale``, nvfp4 ``global_scale``)

Metadata (safetensors' string map): ``format`` = :data:`FORMAT`, ``version`` = :data:`VERSION`
(an integer as text) and ``meta``, a JSON object:

    layer, impl, variant       which layer, which implementation, which registry variant
    weight                     {fmt, shape, block_shape, scale_layout}
    options                    activation options that are not tensors
    route                      the kernels and tile the implementation took (text)
    device, versions           where it ran (dispatch.apps._harness.device_report) and the library
                               versions (dispatch.api.library_versions)
    report                     the watchdog's or diff's findings (dispatch.check.summarize)

``b12x-dual diff --replay FILE`` reads it (:func:`read`) and reruns it (dispatch.apps.diff).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from formats import QuantizedTensor
from formats.validate import check_weight

FORMAT = "b12x-dual.replay"
VERSION = 1
SUFFIX = ".b12x-replay.safetensors"


@dataclass
class Replay:
    """A read replay file: the call's tensors (on the CPU) and its metadata."""

    path: str
    layer: str
    impl: str
    variant: str
    x: torch.Tensor
    y: Optional[torch.Tensor]
    qweight: QuantizedTensor
    bias: Optional[torch.Tensor]
    act_opts: dict
    meta: dict


def _device() -> dict[str, Any]:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"kind": "cuda", "name": p.name, "capability": f"sm_{p.major}{p.minor}"}
    return {"kind": "cpu", "name": platform.processor() or platform.machine()}


def write(directory, *, layer: str, impl: str, variant: str, x: torch.Tensor, qweight: QuantizedTensor,
          bias: Optional[torch.Tensor] = None, act_opts: Optional[dict] = None, y: Optional[torch.Tensor] = None,
          route: str = "", report: Optional[dict] = None, device: Optional[dict] = None,
          path=None) -> Path:
    """Write one call as a replay file into ``directory`` (created if missing) or at ``path``.

    Args: the call (x [M, K], the layer's weight, bias [N], activation options, the output y [M, N])
        and its context (layer name, implementation, variant, route text, the report).
    Returns: the file's path (``<layer>-<impl>-<variant>-<time>-<pid>.b12x-replay.safetensors``).
    Raises: ValueError for a malformed weight (formats.validate); OSError when it cannot be written.
    """
    from safetensors.torch import save_file

    from .describe import library_versions

    check_weight(qweight)
    tensors = {"x": x.detach().reshape(-1, x.shape[-1]).contiguous().cpu()}
    if y is not None:
        tensors["y"] = y.detach().contiguous().cpu()
    for k, t in qweight.tensors().items():
        tensors[f"weight.{k}"] = t.detach().contiguous().cpu()
    if bias is not None:
        tensors["bias"] = bias.detach().contiguous().cpu()
    options = {}
    for k, v in (act_opts or {}).items():
        if isinstance(v, torch.Tensor):
            tensors[f"opt.{k}"] = v.detach().reshape(()).contiguous().cpu() if v.numel() == 1 else v.detach().cpu()
        else:
            options[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    meta = {
        "layer": layer, "impl": impl, "variant": variant,
        "weight": {"fmt": qweight.fmt, "shape": list(qweight.shape),
                   "block_shape": None if qweight.block_shape is None else list(qweight.block_shape),
                   "scale_layout": qweight.scale_layout},
        "options": options, "route": route, "device": device or _device(), "versions": library_versions(),
        "report": report or {}, "created_unix": time.time(),
    }
    if path is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", layer)[:80] or "layer"
        path = Path(directory) / f"{safe}-{impl}-{variant}-{int(time.time() * 1000)}-{os.getpid()}{SUFFIX}"
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION),
                                            "meta": json.dumps(meta, default=str)})
    return Path(path)


def read(path) -> Replay:
    """Read a replay file (tensors on the CPU).

    Raises:
        ValueError naming the path: a missing or unreadable file, a file that is not a replay file
        (its ``format`` metadata, e.g. a checkpoint or a save_quantized file), a file version newer
        than :data:`VERSION` (written by a newer b12x-dual), an unknown variant or implementation
        name, a tensor missing, or a weight that formats.validate rejects.
    """
    from safetensors import SafetensorError, safe_open

    from .contract import variant as variant_of

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--replay {str(path)!r}: no such file")
    try:
        with safe_open(str(p), framework="pt") as f:
            md = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"--replay {str(path)!r}: cannot read it as a safetensors file ({type(e).__name__}: {e})") from None
    if md.get("format") != FORMAT:
        raise ValueError(f"--replay {str(path)!r}: not a b12x-dual replay file (metadata format="
                         f"{md.get('format')!r}, expected {FORMAT!r})")
    try:
        version = int(md.get("version", ""))
    except ValueError:
        raise ValueError(f"--replay {str(path)!r}: file version {md.get('version')!r} is not an integer") from None
    if version > VERSION:
        raise ValueError(f"--replay {str(path)!r}: file version {version} is newer than this b12x-dual reads "
                         f"(versions 1-{VERSION}); upgrade b12x-dual to replay it")
    if version < 1:
        raise ValueError(f"--replay {str(path)!r}: file version {version}; allowed: 1-{VERSION}")
    try:
        meta = json.loads(md["meta"])
        layer, impl, variant, w = meta["layer"], meta["impl"], meta["variant"], meta["weight"]
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"--replay {str(path)!r}: metadata is incomplete ({type(e).__name__}: {e})") from None
    try:
        spec = variant_of(variant)
    except ValueError as e:
        raise ValueError(f"--replay {str(path)!r}: {e}") from None
    if spec.fmt != w.get("fmt"):
        raise ValueError(f"--replay {str(path)!r}: variant {variant!r} but a {w.get('fmt')!r} weight")
    for key in ("x", "weight.data", "weight.scale"):
        if key not in tensors:
            raise ValueError(f"--replay {str(path)!r}: tensor {key!r} is missing")
    q = QuantizedTensor(w["fmt"], "weight", tensors["weight.data"], tensors["weight.scale"],
                        tensors.get("weight.global_scale"),
                        None if w["block_shape"] is None else tuple(w["block_shape"]), tuple(w["shape"]),
                        w.get("scale_layout", "linear"))
    check_weight(q, w["fmt"], name=f"--replay {str(path)!r} weight")
    opts = dict(meta.get("options", {}))
    for k, t in tensors.items():
        if k.startswith("opt."):
            opts[k[4:]] = t
    return Replay(str(p), layer, impl, variant, tensors["x"], tensors.get("y"), q, tensors.get("bias"), opts, meta)
