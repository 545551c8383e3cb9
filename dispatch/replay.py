"""Replay files: one linear call, captured so that anyone can rerun its arithmetic on any machine.

A replay file is a safetensors file (``*.b12x-replay.safetensors``). Tensors:

    x                     the activation as a contiguous [M, K] copy (bf16/fp16; every version)
    x.storage             version 2: the span of x's storage that the call's view covers, 1-D (from
                          the view's first element to its last, the neighbours between rows
                          included), so that the call's layout is rebuilt with the same bytes
    xq.data, xq.scale,    version 2: the implementation's own quantized activation of the call
    xq.global_scale         (its quantize_activation(x), as the watchdog reran it); absent for W4A16
                            and for implementations without a separate quantizer
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
    x_layout (version 2)       {shape, stride, storage_offset (from the start of x.storage),
                               dtype, span (elements of x.storage), stored (whether x.storage holds
                               the span's bytes), align (the first element's address mod 256)}
    xq (version 2)             {fmt, shape, block_shape, scale_layout} of the xq.* tensors, or null

Version 1 files (no x.storage, xq or their metadata) are still read: their call is rerun on the
contiguous copy of x, and the replay says that the input layout differs from the call's and that
the stage of the recorded output cannot be rechecked. Version 2 files are version 3's linear files.

Version 3 adds MoE calls (:func:`write_moe`, the watchdog's BoundMoE check), meta ``kind`` = "moe":

    x, x.storage          as above (x [M, H])
    topk_ids, topk_weights  the router's choice [M, top_k] (int32, float32), before renormalization
    y                     the output the implementation produced [M, H]
    experts.<e>.w13.data, .scale, .global_scale   expert e's W13 [2I, H] as loaded (formats.QuantizedTensor)
    experts.<e>.w2.data, .scale, .global_scale    expert e's W2 [H, I]
    w13_bias, w2_bias     [E, 2I], [E, H] (absent without biases)
    opt13.<name>, opt2.<name>  the two GEMMs' activation options that are tensors (one or E values)

    meta: layer, impl, variant, kind "moe", activation, renormalize, top_k, num_experts,
          w13 / w2 {fmt, shape, block_shape, scale_layout}, options13 / options2 (not tensors),
          route, device, versions, report (dispatch.moe_check.summarize), x_layout

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
from formats.validate import check_quantized_activation, check_weight

FORMAT = "b12x-dual.replay"
VERSION = 3
SUFFIX = ".b12x-replay.safetensors"
ALIGN = 256
"""Bytes: a rebuilt input's first element gets the same address modulo this (Triton specializes on
16-byte divisibility; CUDA allocations are 256-byte aligned)."""
MAX_SPAN_RATIO = 16
"""x.storage holds the span only when it is at most this many times x's own elements (a view into a
large workspace records its layout, not the workspace)."""


@dataclass
class Replay:
    """A read replay file: the call's tensors (on the CPU) and its metadata.

    x: the contiguous [M, K] copy; layout: the call's x layout (meta ``x_layout``) or None (version
    1, or not recorded); storage: the span of x's storage (version 2) or None; xq: the
    implementation's quantized activation or None; version: the file's version.
    """

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
    version: int = VERSION
    layout: Optional[dict] = None
    storage: Optional[torch.Tensor] = None
    xq: Optional[QuantizedTensor] = None


def _device() -> dict[str, Any]:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"kind": "cuda", "name": p.name, "capability": f"sm_{p.major}{p.minor}"}
    return {"kind": "cpu", "name": platform.processor() or platform.machine()}


def layout_of(x: torch.Tensor) -> tuple[dict, Optional[torch.Tensor]]:
    """(x_layout metadata, the span of x's storage on the CPU or None when it is too large).

    The span runs from x's first element (its storage offset) to its last, ``1 + sum_i (size_i - 1)
    stride_i`` elements (torch strides are >= 0), so a row-strided view (a column slice of a wider
    tensor) keeps the bytes between its rows."""
    x = x.detach()
    span = 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride())) if x.numel() else 0
    stored = span <= MAX_SPAN_RATIO * max(x.numel(), 1)
    storage = torch.as_strided(x, (span,), (1,)).cpu().clone() if stored and span else None
    meta = {"shape": list(x.shape), "stride": list(x.stride()), "storage_offset": 0,
            "dtype": str(x.dtype).replace("torch.", ""), "span": span, "stored": stored,
            "align": int(x.data_ptr() % ALIGN) if x.numel() else 0, "contiguous": x.is_contiguous()}
    return meta, storage


def rebuild_x(rp: Replay, device) -> tuple[torch.Tensor, str]:
    """The call's x on ``device`` with the recorded layout (shape, strides, offset, the address of its
    first element modulo :data:`ALIGN`, the storage bytes between its rows), and one line saying how.

    Where the layout cannot be rebuilt (a version-1 file records none; the rebuilt view does not
    hold the recorded values), x is the contiguous [M, K] copy and the line says "input layout
    differs" and why."""
    x2 = rp.x
    lay = rp.layout
    if lay is None:
        return x2.to(device), ("input layout differs: the file (version 1) records no strides or storage offset; "
                               "rerun on a contiguous copy, so a fault that depends on the input's strides "
                               "may not reproduce")
    dtype = getattr(torch, lay["dtype"])
    es = torch.empty((), dtype=dtype).element_size()
    span = int(lay["span"])
    buf = torch.full((span + ALIGN // es,), float("nan"), dtype=dtype, device=device)
    delta = (int(lay["align"]) - buf.data_ptr() % ALIGN) % ALIGN
    aligned = delta % es == 0
    pad = delta // es if aligned else 0
    if rp.storage is not None:
        buf[pad:pad + span] = rp.storage.to(device)
    x = torch.as_strided(buf, tuple(lay["shape"]), tuple(lay["stride"]), pad + int(lay["storage_offset"]))
    if rp.storage is None:
        x.copy_(x2.reshape(x.shape).to(device))
    if not torch.equal(x.reshape(x2.shape).cpu().view(torch.int16 if es == 2 else torch.uint8),
                       x2.view(torch.int16 if es == 2 else torch.uint8)):
        return x2.to(device), ("input layout differs: the view rebuilt from x.storage does not hold the "
                               "recorded x; rerun on a contiguous copy")
    how = (f"input layout rebuilt: shape {tuple(lay['shape'])}, strides {tuple(lay['stride'])}, "
           f"first element at {lay['align']} mod {ALIGN} bytes")
    if not aligned:
        how += f" (not reproducible here: {es}-byte elements; at {(buf.data_ptr() + pad * es) % ALIGN})"
    if rp.storage is None:
        how += f"; the storage between rows ({span} elements) was not recorded and is NaN here"
    return x, how


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy in memory of its own (safetensors refuses two names for one memory, as
    when a static activation scale is also the quantized activation's global scale)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _qt_meta(q: QuantizedTensor) -> dict:
    return {"fmt": q.fmt, "role": q.role, "shape": list(q.shape),
            "block_shape": None if q.block_shape is None else list(q.block_shape), "scale_layout": q.scale_layout}


def write(directory, *, layer: str, impl: str, variant: str, x: torch.Tensor, qweight: QuantizedTensor,
          bias: Optional[torch.Tensor] = None, act_opts: Optional[dict] = None, y: Optional[torch.Tensor] = None,
          route: str = "", report: Optional[dict] = None, device: Optional[dict] = None,
          xq: Optional[QuantizedTensor] = None, path=None) -> Path:
    """Write one call as a replay file (version :data:`VERSION`) into ``directory`` (created if
    missing) or at ``path``.

    Args: the call (x [..., K] as the layer received it: its shape, strides, storage offset and the
        storage between its rows are recorded; the layer's weight, bias [N], activation options,
        the output y [M, N], the implementation's quantized activation ``xq`` [M, K] or None) and
        its context (layer name, implementation, variant, route text, the report).
    Returns: the file's path (``<layer>-<impl>-<variant>-<time>-<pid>.b12x-replay.safetensors``).
    Raises: ValueError for a malformed weight or xq (formats.validate); OSError when it cannot be written.
    """
    from safetensors.torch import save_file

    from .describe import library_versions

    check_weight(qweight)
    if xq is not None:
        check_quantized_activation(xq, qweight.fmt, qweight.k, name="xq")
    x_layout, storage = layout_of(x)
    tensors = {"x": _own(x.reshape(-1, x.shape[-1]))}
    if storage is not None:
        tensors["x.storage"] = storage
    if xq is not None:
        for k, t in xq.tensors().items():
            tensors[f"xq.{k}"] = _own(t)
    if y is not None:
        tensors["y"] = _own(y)
    for k, t in qweight.tensors().items():
        tensors[f"weight.{k}"] = _own(t)
    if bias is not None:
        tensors["bias"] = _own(bias)
    options = {}
    for k, v in (act_opts or {}).items():
        if isinstance(v, torch.Tensor):
            tensors[f"opt.{k}"] = _own(v.reshape(()) if v.numel() == 1 else v)
        else:
            options[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    meta = {
        "layer": layer, "impl": impl, "variant": variant,
        "weight": {k: v for k, v in _qt_meta(qweight).items() if k != "role"},
        "options": options, "route": route, "device": device or _device(), "versions": library_versions(),
        "report": report or {}, "created_unix": time.time(),
        "x_layout": x_layout, "xq": None if xq is None else _qt_meta(xq),
    }
    if path is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", layer)[:80] or "layer"
        path = Path(directory) / f"{safe}-{impl}-{variant}-{int(time.time() * 1000)}-{os.getpid()}{SUFFIX}"
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION),
                                            "meta": json.dumps(meta, default=str)})
    return Path(path)


@dataclass
class MoEExperts:
    """An MoE replay file's layer: the fields of dispatch.moe_check.MoELayer (which diff builds from
    it; router None: the routing is recorded)."""

    name: str
    variant: str
    w13: list
    w2: list
    router: Optional[torch.Tensor]
    top_k: int
    renormalize: bool
    activation: str
    w13_act_opts: dict
    w2_act_opts: dict
    w13_bias: Optional[torch.Tensor]
    w2_bias: Optional[torch.Tensor]


@dataclass
class MoEReplay:
    """A read MoE replay file (version 3, meta kind "moe"): the call (on the CPU) and its metadata.
    ``layer``: :class:`MoEExperts` (no router: the routing is recorded)."""

    path: str
    layer: Any
    impl: str
    variant: str
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    y: Optional[torch.Tensor]
    meta: dict
    version: int = VERSION
    layout: Optional[dict] = None
    storage: Optional[torch.Tensor] = None

    @property
    def renormalize(self) -> bool:
        return self.layer.renormalize


def write_moe(directory, *, layer, impl: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              y: Optional[torch.Tensor] = None, route: str = "", report: Optional[dict] = None,
              device: Optional[dict] = None, path=None) -> Path:
    """Write one MoE call (version :data:`VERSION`, kind "moe") into ``directory`` or at ``path``.

    Args: ``layer`` a dispatch.moe_check.MoELayer or MoEExperts (its experts, activation, options, biases; its
        ``renormalize`` is the call's); x [M, H] as the layer received it (layout recorded as for a
        linear call); topk_ids int [M, top_k]; topk_weights float [M, top_k]; y [M, H]; impl, the
        route text and the report.
    Returns: the file's path (``<layer>-<impl>-<variant>-moe-<time>-<pid>.b12x-replay.safetensors``).
    Raises: ValueError for a malformed expert (formats.validate); OSError when it cannot be written."""
    from safetensors.torch import save_file

    from .describe import library_versions

    for e, (a, b) in enumerate(zip(layer.w13, layer.w2)):
        check_weight(a, name=f"w13[{e}]")
        check_weight(b, name=f"w2[{e}]")
    x_layout, storage = layout_of(x)
    tensors = {"x": _own(x.reshape(-1, x.shape[-1])), "topk_ids": _own(topk_ids.to(torch.int32)),
               "topk_weights": _own(topk_weights.float())}
    if storage is not None:
        tensors["x.storage"] = storage
    if y is not None:
        tensors["y"] = _own(y.reshape(x.reshape(-1, x.shape[-1]).shape[0], -1))
    for e, (a, b) in enumerate(zip(layer.w13, layer.w2)):
        for stem, q in (("w13", a), ("w2", b)):
            for k, t in q.tensors().items():
                tensors[f"experts.{e}.{stem}.{k}"] = _own(t)
    for name in ("w13_bias", "w2_bias"):
        if getattr(layer, name) is not None:
            tensors[name] = _own(getattr(layer, name))
    options = {}
    for stem, opts in (("13", layer.w13_act_opts), ("2", layer.w2_act_opts)):
        options[stem] = {}
        for k, v in (opts or {}).items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt{stem}.{k}"] = _own(v.reshape(()) if v.numel() == 1 else v.reshape(-1))
            else:
                options[stem][k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    meta = {
        "layer": layer.name, "impl": impl, "variant": layer.variant, "kind": "moe", "activation": layer.activation,
        "renormalize": bool(layer.renormalize), "top_k": int(topk_ids.shape[1]), "num_experts": len(layer.w13),
        "w13": {k: v for k, v in _qt_meta(layer.w13[0]).items() if k != "role"},
        "w2": {k: v for k, v in _qt_meta(layer.w2[0]).items() if k != "role"},
        "options13": options["13"], "options2": options["2"], "route": route, "device": device or _device(),
        "versions": library_versions(), "report": report or {}, "created_unix": time.time(), "x_layout": x_layout,
    }
    if path is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", layer.name)[:80] or "layer"
        path = Path(directory) / f"{safe}-{impl}-{layer.variant}-moe-{int(time.time() * 1000)}-{os.getpid()}{SUFFIX}"
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION),
                                            "meta": json.dumps(meta, default=str)})
    return Path(path)


def _read_moe(p: Path, version: int, meta: dict, tensors: dict) -> MoEReplay:
    from .contract import variant as variant_of

    where = f"--replay {str(p)!r}"
    try:
        layer, impl, variant, E = meta["layer"], meta["impl"], meta["variant"], int(meta["num_experts"])
        wm = {"w13": meta["w13"], "w2": meta["w2"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: MoE metadata is incomplete ({type(e).__name__}: {e})") from None
    try:
        spec = variant_of(variant)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for key in ("x", "topk_ids", "topk_weights"):
        if key not in tensors:
            raise ValueError(f"{where}: tensor {key!r} is missing")
    experts = {"w13": [], "w2": []}
    for e in range(E):
        for stem in ("w13", "w2"):
            m = wm[stem]
            if m.get("fmt") != spec.fmt:
                raise ValueError(f"{where}: variant {variant!r} but {stem} experts of {m.get('fmt')!r}")
            key = f"experts.{e}.{stem}"
            if f"{key}.data" not in tensors or f"{key}.scale" not in tensors:
                raise ValueError(f"{where}: tensor {key + '.data'!r} or {key + '.scale'!r} is missing")
            q = QuantizedTensor(m["fmt"], "weight", tensors[f"{key}.data"], tensors[f"{key}.scale"],
                                tensors.get(f"{key}.global_scale"),
                                None if m["block_shape"] is None else tuple(m["block_shape"]), tuple(m["shape"]),
                                m.get("scale_layout", "linear"))
            check_weight(q, m["fmt"], name=f"{where} {stem}[{e}]")
            experts[stem].append(q)
    opts = {"13": dict(meta.get("options13", {})), "2": dict(meta.get("options2", {}))}
    for k, t in tensors.items():
        for stem in ("13", "2"):
            if k.startswith(f"opt{stem}."):
                opts[stem][k[len(stem) + 4:]] = t
    lay = MoEExperts(layer, variant, experts["w13"], experts["w2"], None, int(meta.get("top_k", 1)),
                     bool(meta.get("renormalize", False)), meta.get("activation", "silu"), opts["13"], opts["2"],
                     tensors.get("w13_bias"), tensors.get("w2_bias"))
    ids, w, x = tensors["topk_ids"], tensors["topk_weights"], tensors["x"]
    if ids.shape != w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: topk_ids {tuple(ids.shape)} and topk_weights {tuple(w.shape)} must both be "
                         f"[M={x.shape[0]}, top_k]")
    return MoEReplay(str(p), lay, impl, variant, x, ids, w, tensors.get("y"), meta, version, meta.get("x_layout"),
                     tensors.get("x.storage"))


def read(path):
    """Read a replay file of version 1 to :data:`VERSION` (tensors on the CPU): a :class:`Replay`, or
    a :class:`MoEReplay` for an MoE call (version 3, meta kind "moe").

    Raises:
        ValueError naming the path: a missing or unreadable file, a file that is not a replay file
        (its ``format`` metadata, e.g. a checkpoint or a save_quantized file), a file version newer
        than :data:`VERSION` (written by a newer b12x-dual), an unknown variant or implementation
        name, a tensor missing, or a weight or recorded quantized activation that formats.validate
        rejects.
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
        if meta.get("kind") == "moe" and version >= 3:
            return _read_moe(p, version, meta, tensors)
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
    layout = storage = xq = None
    if version >= 2:
        layout = meta.get("x_layout")
        storage = tensors.get("x.storage")
        xm = meta.get("xq")
        if xm is not None:
            if "xq.data" not in tensors or "xq.scale" not in tensors:
                raise ValueError(f"--replay {str(path)!r}: metadata names a quantized activation but tensor "
                                 "'xq.data' or 'xq.scale' is missing")
            xq = QuantizedTensor(xm["fmt"], "activation", tensors["xq.data"], tensors["xq.scale"],
                                 tensors.get("xq.global_scale"),
                                 None if xm["block_shape"] is None else tuple(xm["block_shape"]), tuple(xm["shape"]),
                                 xm.get("scale_layout", "linear"))
            check_quantized_activation(xq, w["fmt"], q.k, name=f"--replay {str(path)!r} xq")
    return Replay(str(p), layer, impl, variant, tensors["x"], tensors.get("y"), q, tensors.get("bias"), opts, meta,
                  version, layout, storage, xq)
