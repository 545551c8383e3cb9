"""``b12x-dual diff``: is the checkpoint sound, and where does an implementation first depart from the oracle?

    b12x-dual diff MODEL [--layers GLOB,...] [--tokens M,M,...] [--text "..." | --inputs FILE] [--json PATH] [--plot DIR]
    b12x-dual diff --replay FILE

MODEL: a compressed-tensors / ModelOpt / Fp8Config checkpoint folder, this project's safetensors
file (save_quantized), or a folder whose config.json builds a transformers model (quantized here to
``--format``); dispatch.apps.diff_models reads them, in the model's forward order. Every quantized
linear (or the ``--layers`` selection: names or fnmatch globs, comma-separated; ``layers.0...`` and
``model.layers.0...`` name the same layer) goes through two stages.

The checkpoint stage, before any kernel runs (formats.validate.scan_values): NaN weight codes (e4m3
0x7F/0xFF), NaN, Inf, zero or negative scales, E8M0 bytes 0xFF (NaN), each with its positions; and
the oracle (formats.reference_linear) on the layer's finite inputs, where a non-finite output is a
finding too. Findings say whether the checkpoint is sound; they are not implementation failures.

The implementation stage: every implementation of dispatch.registry.IMPLS that this device supports
(reference, triton, hopper, cute, ...) on identical quantized operands, for every token count M
whose route differs on this device (:func:`auto_tokens`: a decode M, an M above 16, a prefill M and
each M where an implementation's kernels, tile, split-K or compile options change; or ``--tokens``),
with seeded random activations, the model's own inputs on ``--text``, or ``--inputs FILE``. Per
layer, M and implementation (dispatch.check.compare_backend):
  activation  which bytes of quantize_activation(x) differ from formats.quantize: codes per row and
              scale block, block scales, global scale;
  gemm        the GEMM on the oracle's quantized activation against formats.reference_linear, per
              (row, 128-column tile), in multiples of the element-wise bound of formats/bounds.py
              (printed, with its derivation), and its bias (dispatch.check.bias_stats);
  linear      the whole call (apply) the same way;
the route each M took per implementation (Backend.route), and the first departure: layer (in
forward order), M, implementation, row, column tile (or K-block with its columns), and whether the
activation quantization or the GEMM departs first. ``--plot DIR`` writes a heat map per layer, M
and implementation (rows x column tiles, log10 error/bound).

MoE layers (dispatch.moe_check; diff_models reads them from transformers Qwen3-MoE and Mixtral
folders and checkpoints whose experts are modules ``<layer>.experts.<e>.<proj>``) run in the same forward
order: the checkpoint stage scans every expert's W13 and W2 (findings name the expert); the
implementation stage routes the activations with the layer's router (softmax top-k, renormalized as
the layer asks) and runs every MoE implementation of dispatch.moe's table here: the call against
formats.reference_moe (formats.bounds.moe_bound), then on a departure each expert alone (the first
wrong expert), then in it each step (W13 input quantization, W13 GEMM, activation, W2 input
quantization, W2 GEMM) where the implementation exposes them, or the weighted combine.

``--replay FILE`` reruns a call captured by the watchdog (B12X_CHECK; dispatch.replay) on this
machine with every implementation available here, on the input layout the call had (strides,
storage offset), rechecks the output recorded in the file against the oracle on the
implementation's recorded quantized activation, prints the watchdog's own report beside it, and
says whether the divergence reproduces (an MoE file: on its recorded routing, naming the first wrong
expert and step).

Exit status: 0 the checkpoint is sound and every implementation agrees with the oracle; 1 an
implementation departs (or raised), the checkpoint sound; 3 the checkpoint is not sound, every
implementation agrees; 4 both; 2 bad arguments (named: a missing MODEL, a --layers glob that
matches nothing, an unreadable or foreign or newer replay file, ...).
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional, Union

import torch

import formats
from dispatch import check, moe_check, registry
from dispatch.api import library_versions
from dispatch.devices import DeviceInfo
from formats.validate import UNSOUND, describe_finding, scan_scalar, scan_values

from . import _harness as H
from . import argtypes as A
from . import diff_models as DM

EXIT_OK, EXIT_DEPARTS, EXIT_ARGS, EXIT_CHECKPOINT, EXIT_BOTH = 0, 1, 2, 3, 4
"""Exit statuses: sound and agreeing; an implementation departs; bad arguments; the checkpoint is
not sound (implementations agree); both."""

DECODE_M, ABOVE_16_M, PREFILL_M = 1, 17, 300
"""The token counts every default run covers: a decode call, the first M past the 16-row decode
buckets, and a prefill M (over 256, no power of two, so every M tile is partly filled)."""
MAX_AUTO_M = 4096
""":func:`auto_tokens` looks for route changes from M = 1 to this."""


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def _device_info(device: Union[str, DeviceInfo]) -> DeviceInfo:
    return device if isinstance(device, DeviceInfo) else H.running_device(device)


def backends_here(variant: str, M: int, N: int, K: int, dtype: torch.dtype, device: Union[str, DeviceInfo],
                  impls: Optional[list[str]] = None) -> tuple[dict, dict]:
    """({impl: Backend} that can run this call on ``device`` (a torch device name, or a DeviceInfo
    such as dispatch.devices.KNOWN_DEVICES["h200"]), {impl: why not}) over registry.IMPLS
    (``impls``: a subset), in registry order."""
    dev = _device_info(device)
    run, skipped = {}, {}
    for impl in registry.IMPLS:
        if impls is not None and impl not in impls:
            continue
        entry = registry.entries()[(impl, variant)]
        ok, why = registry.check(entry, registry.Problem(variant, M, N, K, dtype), dev)
        if ok:
            run[impl] = entry
        else:
            skipped[impl] = why
    return run, skipped


def _route(backend, M: int, N: int, K: int, dtype, dev, opts: dict):
    try:
        return backend.route(registry.Problem(backend.variant, M, N, K, dtype), dev, **opts)
    except Exception as e:  # noqa: BLE001  (reported as such; it must not stop the diff)
        return f"(route unavailable: {type(e).__name__}: {e})"


def route_key(route) -> tuple:
    """What distinguishes two routes: the kernels launched, the tile and split-K (kernels_triton.Route;
    not the compile-time int classes in ``options``, which alternate with M's divisibility); the
    text of a route that cannot be computed."""
    if isinstance(route, str):
        return (route,)
    return (route.kernels, route.tile, route.split_k)


def route_short(route) -> str:
    """A route in one short phrase: kernels, tile, split-K (no reason)."""
    if isinstance(route, str):
        return route
    if not route.kernels:
        return "formats.reference_linear (float64 oracle, no kernel)"
    tile = f" tile {route.tile}" if route.tile else ""
    split = f" SPLIT_K={route.split_k}" if route.split_k > 1 and "splitk" not in route.tile else ""
    return " -> ".join(route.kernels) + tile + split


def auto_tokens(variant: str, N: int, K: int, dtype: torch.dtype, device: Union[str, DeviceInfo],
                impls: Optional[list[str]] = None, act_opts: Optional[dict] = None) -> list[int]:
    """The token counts a default diff of a (variant, N, K) layer runs: {DECODE_M, ABOVE_16_M,
    PREFILL_M} and every M in 1..MAX_AUTO_M at which the route (:func:`route_key`) of an
    implementation that runs on ``device`` (a torch device name or a DeviceInfo) changes, ascending.
    Pure: Backend.route, so a described device gives the answer the real one would. ``act_opts``:
    the layer's activation options (a static scale drops the amax kernel from a route)."""
    opts = tuple(sorted(k for k, v in (act_opts or {}).items() if v is not None))
    return list(_auto_tokens(variant, N, K, dtype, device, None if impls is None else tuple(impls), opts))


@functools.lru_cache(maxsize=256)
def _auto_tokens(variant, N, K, dtype, device, impls, opts) -> tuple[int, ...]:
    dev = _device_info(device)
    run, _ = backends_here(variant, DECODE_M, N, K, dtype, device, None if impls is None else list(impls))
    # a static scale's value does not change a route; its presence does (no amax kernel)
    static = {k: 1.0 for k in opts}
    ms = {DECODE_M, ABOVE_16_M, PREFILL_M}
    for backend in run.values():
        prev = None
        for M in range(1, MAX_AUTO_M + 1):
            key = route_key(_route(backend, M, N, K, dtype, dev, static))
            if key != prev:
                ms.add(M)
                prev = key
    return tuple(sorted(ms))


def diff_layer(layer: DM.Layer, x: torch.Tensor, device: str, impls: Optional[list[str]] = None,
               input_source: str = "") -> dict[str, Any]:
    """Every implementation available here on one layer and one input: {"layer", "variant", "M",
    "N", "K", "input", "results": {impl: compare_backend result}, "skipped": {impl: reason},
    "routes": {impl: Route.describe()}, "route_short": {impl: kernels and tile}, "first": {impl,
    stage, row, tile|kblock, ...} or None, "ok"}. ``x`` keeps its strides (a replayed call's layout)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.device != torch.device(device):
        x2 = x2.to(device)
    M, K = x2.shape
    N = layer.qweight.rows
    qw = layer.qweight.to(device)
    bias = None if layer.bias is None else layer.bias.to(device=device, dtype=x2.dtype)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in layer.act_opts.items()}
    run, skipped = backends_here(layer.variant, M, N, K, x2.dtype, device, impls)
    results, routes, short = {}, {}, {}
    dev = H.running_device(device)
    for impl, backend in run.items():
        with torch.no_grad():
            results[impl] = check.compare_backend(backend, qw, x2, bias, act_opts=opts,
                                                  device_kind=torch.device(device).type)
        r = _route(backend, M, N, K, x2.dtype, dev, opts)
        routes[impl] = r if isinstance(r, str) else r.describe()
        short[impl] = route_short(r)
    firsts = [(impl, r["first"]) for impl, r in results.items() if r["first"] is not None]
    errors = {impl: r["error"] for impl, r in results.items() if r["error"]}
    first = None
    if firsts:
        impl, f = firsts[0]
        first = {"impl": impl, "M": M, **f, "weight": results[impl]["weight"]}
    elif errors:
        impl = next(iter(errors))
        first = {"impl": impl, "M": M, "stage": "error", "detail": errors[impl]}
    return {"layer": layer.name, "variant": layer.variant, "M": M, "N": N, "K": K, "input": input_source,
            "results": results, "skipped": skipped, "routes": routes, "route_short": short, "first": first,
            "ok": all(r["ok"] for r in results.values())}


# ---------------------------------------------------------------------------------------------
# MoE layers
# ---------------------------------------------------------------------------------------------
def _moe_problem(layer: moe_check.MoELayer, M: int, dtype: torch.dtype):
    from dispatch import moe as dmoe

    static = dmoe.STATIC_SCALE_OPTION.get(registry.variant(layer.variant).fmt)
    return dmoe.MoEProblem(layer.variant, layer.num_experts, layer.top_k, layer.hidden, layer.intermediate, M,
                           layer.activation, dtype, layer.w13_bias is not None or layer.w2_bias is not None,
                           static is not None and all(o.get(static) is not None
                                                      for o in (layer.w13_act_opts, layer.w2_act_opts)))


def moe_backends_here(layer: moe_check.MoELayer, M: int, dtype: torch.dtype, device: Union[str, DeviceInfo],
                      impls: Optional[list[str]] = None) -> tuple[dict, dict]:
    """({impl: MoEBackend} of dispatch.moe's table that can run this layer's M-token call on
    ``device``, {impl: why not}), in registry order."""
    from dispatch import moe as dmoe

    dev = _device_info(device)
    problem = _moe_problem(layer, M, dtype)
    run, skipped = {}, {}
    for impl in registry.IMPLS:
        if impls is not None and impl not in impls:
            continue
        entry = dmoe.entries()[(impl, layer.variant)]
        ok, why = dmoe.verdict(entry, problem, dev)
        if ok:
            run[impl] = entry
        else:
            skipped[impl] = why
    return run, skipped


def auto_tokens_moe(layer: moe_check.MoELayer, dtype: torch.dtype, device: Union[str, DeviceInfo],
                    impls: Optional[list[str]] = None) -> list[int]:
    """The token counts a default diff of an MoE layer runs: {DECODE_M, ABOVE_16_M, PREFILL_M} and
    every M in 1..MAX_AUTO_M at which the route (kernels, tile) of an MoE implementation that runs on
    ``device`` changes, ascending (MoEBackend.route: pure)."""
    dev = _device_info(device)
    run, _ = moe_backends_here(layer, DECODE_M, dtype, device, impls)
    ms = {DECODE_M, ABOVE_16_M, PREFILL_M}
    for backend in run.values():
        prev = None
        for M in range(1, MAX_AUTO_M + 1):
            try:
                r = backend.route(_moe_problem(layer, M, dtype), dev)
                key = route_key(r)
            except Exception as e:  # noqa: BLE001
                key = (f"{type(e).__name__}: {e}",)
            if key != prev:
                ms.add(M)
                prev = key
    return sorted(ms)


def diff_moe_layer(layer: moe_check.MoELayer, x: torch.Tensor, device: str, impls: Optional[list[str]] = None,
                   input_source: str = "", routing: Optional[tuple] = None) -> dict[str, Any]:
    """Every MoE implementation available here on one MoE layer and one input x [M, H], routed by the
    layer's router (dispatch.moe_check.route_tokens) or by ``routing`` (topk_ids, topk_weights: a
    replayed call's): {"layer", "kind": "moe", "variant", "M", "E", "top_k", "H", "I", "input",
    "routing": {"topk_ids", "topk_weights", "renormalize"}, "results": {impl: compare_moe result},
    "skipped", "routes", "route_short", "first": {"impl", "kind", "stage", "expert", "row", ...} or
    None, "ok"}."""
    x2 = x.reshape(-1, x.shape[-1]).to(device)
    M = x2.shape[0]
    lay = layer.to(device)
    if routing is None:
        ids, w = moe_check.route_tokens(x2, lay.router, lay.top_k)
    else:
        ids, w = (t.to(device) for t in routing)
    run, skipped = moe_backends_here(lay, M, x2.dtype, device, impls)
    dev = H.running_device(device)
    results, routes, short = {}, {}, {}
    for impl, backend in run.items():
        results[impl] = moe_check.compare_moe(backend, lay, x2, ids, w, device_kind=torch.device(device).type)
        try:
            r = backend.route(_moe_problem(lay, M, x2.dtype), dev)
        except Exception as e:  # noqa: BLE001
            r = f"(route unavailable: {type(e).__name__}: {e})"
        routes[impl] = r if isinstance(r, str) else r.describe()
        short[impl] = route_short(r) if not isinstance(r, str) and r.kernels else (
            r if isinstance(r, str) else "formats.reference_moe (float64 oracle, no kernel)")
    first = None
    for impl, res in results.items():
        if res["first"] is not None:
            first = {"impl": impl, "kind": "moe", "M": M, **res["first"], "weight": res["weight"]}
            break
    return {"layer": layer.name, "kind": "moe", "variant": layer.variant, "M": M, "E": layer.num_experts,
            "top_k": ids.shape[1], "H": layer.hidden, "I": layer.intermediate, "input": input_source,
            "routing": {"topk_ids": ids.cpu().tolist(), "topk_weights": w.cpu().tolist(),
                        "renormalize": layer.renormalize},
            "results": results, "skipped": skipped, "routes": routes, "route_short": short, "first": first,
            "ok": all(r["ok"] for r in results.values())}


def moe_oracle_findings(layer: moe_check.MoELayer, x: torch.Tensor, limit: int = 8) -> list[dict]:
    """formats.reference_moe on x routed by the layer's router: a finding where a finite input row
    gives a non-finite output, with positions {"M", "row", "column"}."""
    x2 = x.reshape(-1, x.shape[-1]).cpu()
    lay = layer.to("cpu")
    ids, w = moe_check.route_tokens(x2, lay.router, lay.top_k)
    ref = formats.reference_moe(x2, lay.w13, lay.w2, ids, w, activation=lay.activation, renormalize=lay.renormalize,
                                w13_bias=lay.w13_bias, w2_bias=lay.w2_bias, a16=registry.variant(lay.variant).a16,
                                w13_act_opts=lay.w13_act_opts or None, w2_act_opts=lay.w2_act_opts or None)
    bad = ~torch.isfinite(ref) & torch.isfinite(x2).all(dim=1, keepdim=True)
    n = int(bad.sum())
    if not n:
        return []
    pos = [{"M": x2.shape[0], "row": int(r), "column": int(c)} for r, c in bad.nonzero()[:limit].tolist()]
    return [{"tensor": "oracle output", "kind": "nonfinite_output", "severity": UNSOUND, "count": n,
             "what": NONFINITE_OUTPUT_MOE, "positions": pos}]


def moe_findings(layer: moe_check.MoELayer) -> list[dict]:
    """formats.validate.scan_values of every expert's W13 and W2 ("experts.<e>.w13.scale", ...) and
    scan_scalar of the static activation scales, each finding with its "expert"."""
    fs = []
    for e in range(layer.num_experts):
        for stem, q in (("w13", layer.w13[e]), ("w2", layer.w2[e])):
            fs += [dict(f, expert=e) for f in scan_values(q, name=f"experts.{e}.{stem}")]
    for stem, opts in (("w13", layer.w13_act_opts), ("w2", layer.w2_act_opts)):
        for key, t in opts.items():
            if isinstance(t, torch.Tensor):
                vals = t.reshape(-1)
                for e in range(vals.numel()):
                    fs += [dict(f, expert=e) if vals.numel() > 1 else f
                           for f in scan_scalar(vals[e], f"{stem} input {key}" + (f" (expert {e})" if vals.numel() > 1
                                                                                 else ""))]
    return fs


def _lookup(got: dict, name: str):
    for n in DM.spellings(name):
        if n in got:
            return got[n]
    return None


def layer_inputs(model: DM.Model, layers: list[DM.Layer], *, tokens: Optional[list[int]], dtype: torch.dtype,
                 seed: int, text: Optional[str], inputs: Optional[str], device: str = "cpu",
                 impls: Optional[list[str]] = None) -> dict[str, list[tuple[torch.Tensor, str]]]:
    """{layer: [(x [M, K], where it came from), ...]}: the --inputs or --text activations (their
    own M), else seeded random activations of each M of ``tokens`` (None: :func:`auto_tokens`)."""
    got: dict[str, torch.Tensor] = {}
    source = "random"
    if inputs:
        got, source = DM.read_inputs(inputs), f"--inputs {inputs}"
    elif text is not None:
        got, source = DM.capture_text(model, text, dtype), "--text"
    out = {}
    for i, lay in enumerate(layers):
        moe = isinstance(lay, moe_check.MoELayer)
        k = lay.hidden if moe else lay.qweight.k
        x = _lookup(got, lay.name)
        if x is not None:
            if x.shape[-1] != k:
                raise ValueError(f"{source}: the input of layer {lay.name!r} has K={x.shape[-1]}, the layer "
                                 f"K={k}")
            out[lay.name] = [(x.reshape(-1, x.shape[-1]).to(dtype), source)]
            continue
        if moe:
            ms = tokens or auto_tokens_moe(lay, dtype, device, impls)
        else:
            ms = tokens or auto_tokens(lay.variant, lay.qweight.rows, k, dtype, device, impls, lay.act_opts)
        out[lay.name] = []
        for m in ms:
            gen = torch.Generator().manual_seed((seed * 100003 + i) * 8191 + m)
            x = H.make_input((m, k), dtype, gen, "cpu")
            out[lay.name].append((x, f"random (seed {seed}, {m} rows)" + (
                "" if source == "random" else f"; not in {source}")))
    return out


# ---------------------------------------------------------------------------------------------
# The checkpoint stage
# ---------------------------------------------------------------------------------------------
NONFINITE_OUTPUT = ("non-finite oracle output(s) for finite input rows: the layer's own codes and scales "
                    "give NaN or Inf (output column n is weight row n)")
NONFINITE_OUTPUT_MOE = ("non-finite oracle output(s) for finite input rows: the MoE layer's experts, routed by its "
                        "own router, give NaN or Inf")


def oracle_findings(layer: DM.Layer, x: torch.Tensor, device: str, limit: int = 8) -> list[dict]:
    """The oracle (formats.reference_linear) on ``x``: a finding where an input row that is finite
    gives a non-finite output, with positions {"M", "row", "column"}."""
    a16 = registry.variant(layer.variant).a16
    x2 = x.reshape(-1, x.shape[-1]).to(device)
    bias = None if layer.bias is None else layer.bias.to(device=device, dtype=x2.dtype)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in layer.act_opts.items()}
    with torch.no_grad():
        ref = formats.reference_linear(x2, layer.qweight.to(device), bias, a16=a16, out_dtype=x2.dtype, **opts)
    bad = ~torch.isfinite(ref.cpu()) & torch.isfinite(x2.cpu()).all(dim=1, keepdim=True)
    n = int(bad.sum())
    if not n:
        return []
    pos = [{"M": x2.shape[0], "row": int(r), "column": int(c)} for r, c in bad.nonzero()[:limit].tolist()]
    return [{"tensor": "oracle output", "kind": "nonfinite_output", "severity": UNSOUND, "count": n,
             "what": NONFINITE_OUTPUT, "positions": pos}]


def checkpoint_stage(layers: list[DM.Layer], xs: dict, refused: dict, device: str) -> dict[str, Any]:
    """The checkpoint stage (before any kernel): per layer, formats.validate.scan_values of the
    weight (of every expert's W13 and W2 for an MoE layer, each finding with its "expert"),
    scan_scalar of static activation scales, the oracle's finiteness on each finite input
    (:func:`oracle_findings`), and the findings of modules the converters refused (``refused``).
    Returns {"sound": no finding of severity "unsound", "findings": [{"layer", **finding}, ...] in
    forward order, "layers": {layer: [findings]}}."""
    per: dict[str, list[dict]] = {}
    for name, fs in refused.items():
        per[name] = [dict(f, refused=True) for f in fs]
    for lay in layers:
        moe = isinstance(lay, moe_check.MoELayer)
        if moe:
            fs = moe_findings(lay)
        else:
            fs = scan_values(lay.qweight, name="weight")
            for key, t in lay.act_opts.items():
                if isinstance(t, torch.Tensor):
                    fs += scan_scalar(t, f"input {key}")
        for x, _src in xs.get(lay.name, []):
            got = moe_oracle_findings(lay, x) if moe else oracle_findings(lay, x, device)
            if got:
                fs += got
                break  # the first M that shows it
        if fs:
            per[lay.name] = fs
    findings = [{"layer": name, **f} for name, fs in per.items() for f in fs]
    return {"sound": not any(f["severity"] == UNSOUND for f in findings), "findings": findings, "layers": per}


def run_diff(model_path: str, *, layers: Optional[list[str]] = None, fmt: str = "nvfp4",
             tokens: Optional[list[int]] = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
             text: Optional[str] = None, inputs: Optional[str] = None, impls: Optional[list[str]] = None,
             device: Optional[str] = None, progress: bool = True, save_inputs: Optional[str] = None) -> dict[str, Any]:
    """The diff of a MODEL as a JSON-able dict (grids as lists). ``tokens``: the M of each run (None:
    :func:`auto_tokens` per layer). Raises ValueError for bad arguments (named): see
    dispatch.apps.diff_models.load_model and select."""
    device = device or H.default_device()
    model = DM.load_model(model_path, fmt, layers)
    chosen = DM.select(model.layers, layers, also=tuple(model.refused))
    refused = {n: f for n, f in model.refused.items() if not layers or any(DM.matches(n, p) for p in layers)}
    xs = layer_inputs(model, chosen, tokens=tokens, dtype=dtype, seed=seed, text=text, inputs=inputs,
                      device=device, impls=impls)
    if save_inputs:
        from safetensors.torch import save_file

        save_file({k: v[0][0].contiguous() for k, v in xs.items()}, save_inputs)
    ckpt = checkpoint_stage(chosen, xs, refused, device)
    out_layers = []
    with H.Progress(sum(len(v) for v in xs.values()), "diff", enabled=progress) as bar:
        for lay in chosen:
            for x, src in xs[lay.name]:
                if isinstance(lay, moe_check.MoELayer):
                    r = diff_moe_layer(lay, x, device, impls, src)
                else:
                    r = diff_layer(lay, x, device, impls, src)
                r["checkpoint"] = ckpt["layers"].get(lay.name, [])
                out_layers.append(r)
                bar.advance(f"{lay.name} M={r['M']} {'ok' if r['ok'] else 'DEPARTS'}")
    return _result(model_path, model.kind, out_layers, model.skipped, ckpt, order=model.order, notes=model.notes)


def exit_status(agree: bool, sound: bool) -> int:
    """:data:`EXIT_OK`, :data:`EXIT_DEPARTS`, :data:`EXIT_CHECKPOINT` or :data:`EXIT_BOTH`."""
    if agree:
        return EXIT_OK if sound else EXIT_CHECKPOINT
    return EXIT_DEPARTS if sound else EXIT_BOTH


def _result(source: str, kind: str, out_layers: list[dict], skipped_modules: dict, ckpt: dict,
            order: str = "", notes: Optional[list] = None) -> dict[str, Any]:
    first = next(({"layer": r["layer"], **r["first"]} for r in out_layers if r["first"] is not None), None)
    agree = all(r["ok"] for r in out_layers)
    tokens: dict[str, list[int]] = {}
    for r in out_layers:
        tokens.setdefault(r["layer"], []).append(r["M"])
    res = {"tool": "b12x-dual diff", "model": source, "kind": kind, "device": H.device_report(),
           "versions": library_versions(), "order": order, "notes": list(notes or []), "tokens": tokens,
           "layers": out_layers,
           "not_quantized": skipped_modules, "checkpoint": ckpt, "first": first, "agree": agree,
           "ok": agree and ckpt["sound"], "exit": exit_status(agree, ckpt["sound"])}
    res["verdict"] = verdict(res)
    return res


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
def run_replay(path: str, *, impls: Optional[list[str]] = None, device: Optional[str] = None) -> dict[str, Any]:
    """Rerun a replay file here, on the input layout the call had (dispatch.replay.rebuild_x).
    Returns run_diff's fields plus "replay": {"layer", "impl", "variant", "route", "recorded_on",
    "recorded_versions", "recorded_report" (the watchdog's), "recorded_output": check of the file's y
    against the oracle here on the recorded quantized activation (or None), "stage_rechecked":
    whether the file holds that activation, "layout": how x was rebuilt (or "input layout
    differs: ..."), "layout_rebuilt": bool, "reproduces": True/False, or None when the recorded
    implementation cannot run here, "why_not_here", "version"}. Raises ValueError naming the file
    (dispatch.replay.read)."""
    from dispatch import replay

    rp = replay.read(path)
    device = device or H.default_device()
    if isinstance(rp, replay.MoEReplay):
        return _run_replay_moe(rp, path, impls, device)
    layer = DM.Layer(rp.layer, rp.variant, rp.qweight, rp.bias, rp.act_opts)
    x, how = replay.rebuild_x(rp, device)
    ckpt = checkpoint_stage([layer], {rp.layer: [(rp.x, "")]}, {}, device)
    r = diff_layer(layer, x, device, impls, f"replay {Path(path).name}")
    r["checkpoint"] = ckpt["layers"].get(rp.layer, [])
    rec_kind = rp.meta.get("device", {}).get("kind", "cpu")
    recorded = None
    if rp.y is not None:
        backend = registry.entries()[(rp.impl, rp.variant)] if rp.impl in registry.IMPLS else None
        if backend is not None and not isinstance(backend, registry.UnsupportedEntry):
            recorded = _recheck_output(backend, rp, rec_kind)
    res = r["results"].get(rp.impl)
    a16 = registry.variant(rp.variant).a16
    info = {"layer": rp.layer, "impl": rp.impl, "variant": rp.variant, "route": rp.meta.get("route", ""),
            "recorded_on": rp.meta.get("device", {}), "recorded_versions": rp.meta.get("versions", {}),
            "recorded_report": rp.meta.get("report", {}), "recorded_output": recorded,
            "stage_rechecked": rp.xq is not None or a16, "version": rp.version,
            "layout": how, "layout_rebuilt": not how.startswith("input layout differs"),
            "reproduces": None if res is None else (not res["ok"]),
            "why_not_here": r["skipped"].get(rp.impl, "" if res is not None else f"{rp.impl} is not known here")}
    out = _result(path, "replay file", [r], {}, ckpt)
    out["replay"] = info
    return out


def _run_replay_moe(rp, path: str, impls: Optional[list[str]], device: str) -> dict[str, Any]:
    """An MoE replay file (version 3): the call rerun here on its recorded routing with every MoE
    implementation available (each departure split by expert and step), the recorded output rechecked
    against the oracle with formats.bounds.moe_bound, and whether the divergence reproduces."""
    from dispatch import moe as dmoe
    from dispatch import replay

    x, how = replay.rebuild_x(rp, device)
    lay = moe_check.MoELayer(**{f: getattr(rp.layer, f) for f in replay.MoEExperts.__dataclass_fields__})
    ckpt_findings = moe_findings(lay)
    ckpt = {"sound": not any(f["severity"] == UNSOUND for f in ckpt_findings),
            "findings": [{"layer": lay.name, **f} for f in ckpt_findings],
            "layers": {lay.name: ckpt_findings} if ckpt_findings else {}}
    r = diff_moe_layer(lay, x, device, impls, f"replay {Path(path).name}", routing=(rp.topk_ids, rp.topk_weights))
    r["checkpoint"] = ckpt_findings
    recorded = None
    if rp.y is not None:
        ref_backend = dmoe.entries()[("reference", rp.variant)]
        with torch.no_grad():
            res = moe_check.compare_moe(ref_backend, lay, rp.x, rp.topk_ids, rp.topk_weights, y=rp.y, split=False,
                                        prepared=ref_backend.prepare(lay.w13, lay.w2, activation=lay.activation))
        recorded = moe_check.summarize(res)
    res = r["results"].get(rp.impl)
    info = {"layer": rp.layer.name, "impl": rp.impl, "variant": rp.variant, "kind": "moe",
            "route": rp.meta.get("route", ""), "recorded_on": rp.meta.get("device", {}),
            "recorded_versions": rp.meta.get("versions", {}), "recorded_report": rp.meta.get("report", {}),
            "recorded_output": recorded, "stage_rechecked": False, "version": rp.version, "layout": how,
            "layout_rebuilt": not how.startswith("input layout differs"),
            "reproduces": None if res is None else (not res["ok"]),
            "why_not_here": r["skipped"].get(rp.impl, "" if res is not None else f"{rp.impl} is not known here")}
    out = _result(path, "replay file", [r], {}, ckpt)
    out["replay"] = info
    return out


def _recheck_output(backend, rp, rec_kind: str) -> dict[str, Any]:
    """The file's recorded output against the oracle here, with the bound of the device that produced
    it, on the implementation's recorded quantized activation where the file has it (version 2)."""
    with torch.no_grad():
        res = check.check_call(backend, rp.qweight, rp.x, rp.y, rp.bias, rp.act_opts, device_kind=rec_kind,
                               requantize=False, xq=rp.xq)
    return check.summarize(res)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _act_str(act) -> str:
    if act is None:
        return "-"
    if act["equal"]:
        return "= oracle"
    parts = []
    if act["n_code_bytes"]:
        parts.append(f"codes: rows {act['codes_rows']}")
    if act["scale_blocks"]:
        parts.append(f"scales: (row, K-block) {[tuple(b) for b in act['scale_blocks'][:4]]}")
    if act["global_scale"]:
        parts.append("global scale")
    return "; ".join(parts)


def _stage_str(st) -> str:
    if st is None:
        return "-"
    out = f"{H.fmt_num(st['worst'])}" + (f" ({st['n_bad']} bad)" if st["n_bad"] else "")
    b = st.get("bias")
    if b and b.get("flagged"):
        out += f" BIASED {b[b['which']]:+.2g}"
    return out


def first_line(first: Optional[dict]) -> str:
    """The first departure of a report as one line."""
    if first is None:
        return "every implementation is within its bounds on every layer"
    head = f"layer {first['layer']}" if "layer" in first else ""
    head += f" (M={first['M']})" if "M" in first else ""
    head = (head + ", " if head else "") + f"{first['impl']}: "
    if first["stage"] == "error":
        return head + f"raised {first['detail']}"
    if first.get("kind") == "moe":
        return head + moe_check.describe_first(first) + moe_check.weight_note(first.get("weight"))
    return head + check.describe_first(first) + _weight_note(first.get("weight"))


def _weight_note(w) -> str:
    if not w or w["equal"]:
        return ""
    f = w["first"]
    return (f"; {first_weight_what(f['what'])} of the implementation's prepared weight differs from the layer's at "
            f"weight row {f['row']}, K-block {f['kblock']}")


def first_weight_what(what: str) -> str:
    return {"codes": "a code", "scale": "a block scale", "global_scale": "the global scale",
            "tensor_scale": "the per-tensor scale"}.get(what, what)


def checkpoint_line(ckpt: dict) -> str:
    """Whether the checkpoint is sound, as one statement (the first finding when it is not)."""
    bad = [f for f in ckpt["findings"] if f["severity"] == UNSOUND]
    if not bad:
        warn = len(ckpt["findings"])
        return ("the checkpoint is sound (no NaN code; no NaN, Inf, zero or negative scale; the oracle finite on "
                "every finite input)" + (f"; {warn} warning(s)" if warn else ""))
    layers = sorted({f["layer"] for f in bad})
    f = bad[0]
    return (f"the checkpoint is NOT sound: {len(bad)} finding(s) in {len(layers)} layer(s); first: layer "
            f"{f['layer']}: {describe_finding(f)}")


def verdict(result: dict[str, Any]) -> str:
    """The final line: the implementations' statement, the checkpoint's statement, the exit status."""
    if result["agree"]:
        impl = "every implementation agrees with the oracle (within its bound, no bias) on every layer and M"
    else:
        impl = "an implementation departs from the oracle (" + first_line(result["first"]) + ")"
    return f"{impl}; {checkpoint_line(result['checkpoint'])} (exit {result['exit']})"


def _where(f) -> str:
    if f is None:
        return "-"
    if "bias" in f:
        return f"{f['stage']} bias"
    if f["stage"] == "activation":
        return f"act row {f['row']} kblk {f['kblock']}"
    return f"{f['stage']} row {f['row']} tile {f['tile']}"


def print_report(result: dict[str, Any], *, plain: bool = False) -> None:
    """The checkpoint findings, the table (one row per layer, M and implementation), the bounds, the
    routes each M took, skips, the replay's context, the first departure and the verdict."""
    ckpt = result["checkpoint"]
    if ckpt["findings"]:
        H.print_table(f"checkpoint stage ({len(ckpt['findings'])} finding(s), before any kernel ran)",
                      ["layer", "severity", "tensor", "count", "finding"],
                      [[f["layer"], f["severity"], f["tensor"], f["count"],
                        describe_finding(f).split(": ", 1)[1] + (" (not run: the converters refuse it)"
                                                                 if f.get("refused") else "")]
                       for f in ckpt["findings"]], plain=plain)
    rows = []
    bounds = {}
    for r in result["layers"]:
        if r.get("kind") == "moe":
            continue
        for impl, res in r["results"].items():
            rows.append([r["layer"], r["variant"], f"{r['M']}x{r['N']}x{r['K']}", impl, _act_str(res["activation"]),
                         _stage_str(res["gemm"]), _stage_str(res["linear"]), _where(res["first"]),
                         "ok" if res["ok"] else ("ERROR" if res["error"] else "DEPARTS")])
            bounds[(impl, r["variant"], res["out_dtype"])] = res["bound"]
    title = f"b12x-dual diff {result['model']} ({result['kind']}) on {result['device']['name']}"
    if rows or not any(r.get("kind") == "moe" for r in result["layers"]):
        H.print_table(f"{title}: error / bound, max per (row, 128-column tile)",
                      ["layer", "variant", "M x N x K", "impl", "activation vs oracle", "gemm", "linear",
                       "first bad block", "status"], rows, plain=plain)
    else:
        print(title)
    for (impl, variant, dt), text in bounds.items():
        print(f"bound {impl} {variant} {dt}: {text}")
    _print_moe(result, plain)
    routes: dict[tuple, list[str]] = {}
    for r in result["layers"]:
        for impl, text in r.get("route_short", {}).items():
            if impl != "reference":  # the oracle: formats.reference_linear at every M, no kernel
                routes.setdefault((r["variant"], r["M"], impl, text), []).append(r["layer"])
    if routes:
        print("routes exercised (Backend.route on this device: kernels, tile; the reference runs no kernel):")
        for (variant, m, impl, text), names in routes.items():
            print(f"  {variant} M={m} {impl}: {text} ({len(names)} layer(s))")
    if result.get("order"):
        print(f"layer order: {result['order']}")
    for note in result.get("notes") or []:
        print(f"note: {note}")
    skipped = {}
    for r in result["layers"]:
        for impl, why in r["skipped"].items():
            skipped.setdefault((impl, why), set()).add(r["layer"])
    for (impl, why), names in skipped.items():
        print(f"not run: {impl} on {len(names)} layer(s): {why}")
    for r in result["layers"]:
        for impl, res in r["results"].items():
            if res["error"]:
                print(f"ERROR {r['layer']} M={r['M']} {impl}: {res['error']}")
    if "replay" in result:
        rp = result["replay"]
        dev = rp["recorded_on"]
        print(f"replay of layer {rp['layer']} (file version {rp['version']}): recorded on {dev.get('name', '?')} "
              f"({dev.get('capability', dev.get('kind', '?'))}) with {rp['impl']} ({rp['variant']}), "
              f"route: {rp['route'] or '-'}")
        print(rp["layout"])
        reported = (rp.get("recorded_report") or {}).get("first")
        describe = moe_check.describe_first if rp.get("kind") == "moe" else check.describe_first
        print("recorded by the watchdog: " + (describe(reported) if reported else "(no report in the file)"))
        rec = rp["recorded_output"]
        if rec is not None and rp.get("kind") == "moe":
            print("recorded output against the oracle here (formats.bounds.moe_bound, the recorded routing): " + (
                "within the bound" if rec["ok"] else moe_check.describe_first(rec["first"])))
        elif rec is not None:
            stage = ("" if rp["stage_rechecked"] else " (the file holds no quantized activation of the implementation "
                     "(version 1): the output is checked on the oracle's, so an activation fault reads as a gemm one)")
            print("recorded output against the oracle here: " + (
                "within the bound" if rec["ok"] else check.describe_first(rec["first"])) + stage)
        if rp["reproduces"] is None:
            print(f"reproduces here: cannot tell: {rp['impl']} does not run here ({rp['why_not_here']})")
        else:
            print(f"reproduces here: {'YES' if rp['reproduces'] else 'no'} ({rp['impl']} rerun on this machine"
                  + ("" if rp["layout_rebuilt"] else ", on a contiguous copy of x") + ")")
    print("first bad block: " + first_line(result["first"]))
    print("verdict: " + result["verdict"])
    sys.stdout.flush()


def _moe_where(res: dict) -> tuple[str, str, str]:
    """(first wrong expert, step, block) of one MoE result, as table cells."""
    f = res["first"]
    if f is None:
        return "-", "-", "-"
    if f["stage"] == "error":
        return "-", "error", "-"
    expert = str(f.get("expert", "-"))
    block = (f"token {f['row']} kblk {f['kblock']}" if "kblock" in f else f"token {f['row']} tile {f['tile']}")
    return expert, f["stage"], block


def _print_moe(result: dict[str, Any], plain: bool) -> None:
    """The MoE table (one row per MoE layer, M and implementation) and the MoE bounds."""
    rows, bounds = [], {}
    for r in result["layers"]:
        if r.get("kind") != "moe":
            continue
        for impl, res in r["results"].items():
            expert, step, block = _moe_where(res)
            worst = "-" if res["moe"] is None else (H.fmt_num(res["moe"]["worst"]) + (
                f" ({res['moe']['n_bad']} bad)" if res["moe"]["n_bad"] else ""))
            rows.append([r["layer"], r["variant"], f"{r['M']}x{r['H']} E={r['E']} top{r['top_k']} I={r['I']}", impl,
                         worst, expert, step, block, "ok" if res["ok"] else ("ERROR" if res["error"] else "DEPARTS")])
            bounds[(r["variant"], res["out_dtype"])] = res["bound"]
    if not rows:
        return
    H.print_table("MoE layers: error / bound of the call, max per (token, 128-column tile); on a departure the first "
                  "wrong expert (each run alone), its first wrong step and block",
                  ["layer", "variant", "M x H, experts", "impl", "moe", "expert", "step", "first bad block", "status"],
                  rows, plain=plain)
    for (variant, dt), text in bounds.items():
        print(f"bound moe {variant} {dt}: {text}")
    print("bound of each step of an expert: w13_gemm / w2_gemm: formats.bounds.gemm_bound (float32 output) on the "
          "implementation's own quantized input; act_fn: formats.bounds.moe_activation_bound "
          "((32 + 2 max(1, alpha) |g|) 2^-24 |a|); w13_input / w2_input: byte for byte against formats.quantize")


def plot(result: dict[str, Any], folder: str) -> list[str]:
    """A heat map per layer, M and implementation: rows x column tiles, log10(error / bound) of the
    gemm stage (linear where there is no gemm); named <layer>-<impl>.png, or <layer>-M<M>-<impl>.png
    where a layer ran several M. Returns the files written; [] without matplotlib (said)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"--plot: matplotlib is not importable ({type(e).__name__}: {e}); no plots written")
        return []
    Path(folder).mkdir(parents=True, exist_ok=True)
    written = []
    for r in result["layers"]:
        several = len(result.get("tokens", {}).get(r["layer"], [])) > 1
        for impl, res in r["results"].items():
            st = res.get("gemm") or res.get("linear") or res.get("moe")
            if st is None:
                continue
            g = torch.as_tensor(st["grid"], dtype=torch.float64)
            z = torch.log10(g.clamp(min=1e-6)).clamp(max=6.0)
            fig, ax = plt.subplots(figsize=(max(3.0, 0.5 * g.shape[1] + 2), max(2.5, 0.15 * g.shape[0] + 1.5)))
            im = ax.imshow(z.numpy(), aspect="auto", cmap="magma", vmin=-6, vmax=max(1.0, float(z.max())),
                           interpolation="nearest")
            ax.set_xlabel(f"column tile ({check.TILE_N} columns)")
            ax.set_ylabel("row")
            ax.set_title(f"{r['layer']} M={r['M']} {impl} {st['stage']}: log10(error / bound)", fontsize=8)
            fig.colorbar(im, ax=ax)
            if st["first"] is not None:
                ax.scatter([st["first"]["tile"]], [st["first"]["row"]], marker="x", color="cyan")
            stem = f"{r['layer']}-M{r['M']}-{impl}" if several else f"{r['layer']}-{impl}"
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) + ".png"
            fig.tight_layout()
            fig.savefig(Path(folder) / name, dpi=100)
            plt.close(fig)
            written.append(str(Path(folder) / name))
    return written


def jsonable(result: dict[str, Any]) -> dict[str, Any]:
    """The result with tensors as lists (grids rounded to 4 significant digits)."""
    def conv(o):
        if isinstance(o, torch.Tensor):
            return [[float(f"{v:.4g}") if math.isfinite(v) else v for v in row] for row in o.tolist()]
        if isinstance(o, dict):
            return {k: conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [conv(v) for v in o]
        return o

    return conv(result)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _plot_dir(value: str) -> str:
    """--plot DIR: a folder, existing or creatable (not a file)."""
    p = Path(value).expanduser()
    if p.exists() and not p.is_dir():
        raise A.Invalid(f"invalid folder {value!r} (it is a file; expected a folder for the heat maps)")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("diff", help="find the first layer and block where an implementation departs "
                              "from the oracle; --replay FILE reruns a captured call",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="checkpoint folder, b12x-dual .safetensors file, or transformers model folder")
    p.add_argument("--replay", type=A.input_file, default=None, metavar="FILE",
                   help="rerun a replay file written by the watchdog (B12X_CHECK)")
    p.add_argument("--layers", default=None, metavar="GLOB[,GLOB]",
                   help="layer names or fnmatch globs, comma-separated, with or without the 'model.' prefix "
                        "(default: every quantized linear)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="capture each linear's input from the model's forward on this text")
    src.add_argument("--inputs", type=A.input_file, default=None, metavar="FILE",
                     help="safetensors {layer: activations [..., K]}")
    p.add_argument("--save-inputs", type=A.output_path, default=None, metavar="FILE",
                   help="write the inputs used, for --inputs")
    p.add_argument("--format", choices=list(registry.VARIANTS), default="nvfp4",
                   help="what a transformers model folder is quantized to (default nvfp4)")
    p.add_argument("--impls", type=A.choice_list(registry.IMPLS, "implementation"), default=None,
                   help=f"comma list from {','.join(registry.IMPLS)} (default: every one this device runs)")
    p.add_argument("--tokens", type=A.int_list, default=None, metavar="M[,M]",
                   help="rows of the random activations, one run per M (default: a decode M, 17, 300 and every "
                        "M at which a route changes on this device)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--seed", type=A.nonnegative_int, default=0)
    p.add_argument("--device", type=A.torch_device, default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--json", type=A.output_path, default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", type=_plot_dir, default=None, metavar="DIR",
                   help="write a heat map per layer and implementation into this folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def run(args) -> int:
    """The exit status: 0 sound and agreeing, 1 an implementation departs, 2 bad arguments, 3 the
    checkpoint is not sound, 4 both (:func:`exit_status`)."""
    if (args.model is None) == (args.replay is None):
        print("b12x-dual diff: error: give MODEL or --replay FILE (one of them)", file=sys.stderr)
        return EXIT_ARGS
    try:
        if args.replay:
            result = run_replay(args.replay, impls=args.impls, device=args.device)
        else:
            layers = None if args.layers is None else [s.strip() for s in args.layers.split(",") if s.strip()]
            result = run_diff(args.model, layers=layers, fmt=args.format, tokens=args.tokens,
                              dtype=H.DTYPES[args.dtype], seed=args.seed, text=args.text, inputs=args.inputs,
                              impls=args.impls, device=args.device, progress=not args.no_progress,
                              save_inputs=args.save_inputs)
    except ValueError as e:
        print(f"b12x-dual diff: error: {e}", file=sys.stderr)
        return EXIT_ARGS
    print_report(result, plain=args.plain)
    if args.plot:
        files = plot(result, args.plot)
        print(f"wrote {len(files)} heat map(s) to {args.plot}")
    if args.json:
        H.write_json(args.json, jsonable(result))
        print(f"wrote {args.json}")
    return result["exit"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="b12x-dual diff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
