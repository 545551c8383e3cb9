"""``b12x-dual diff``: find the first layer and block where an implementation departs from the oracle.

    b12x-dual diff MODEL [--layers GLOB,...] [--text "..." | --inputs FILE] [--json PATH] [--plot DIR]
    b12x-dual diff --replay FILE

MODEL: a compressed-tensors / ModelOpt / Fp8Config checkpoint folder, this project's safetensors
file (save_quantized), or a folder whose config.json builds a transformers model (quantized here to
``--format``); dispatch.apps.diff_models reads them. Every quantized linear (or the ``--layers``
selection: names or fnmatch globs, comma-separated) is run by every implementation of
dispatch.registry.IMPLS that this device supports (reference, triton, hopper, cute, ...) on
identical quantized operands: the seeded random activations (default, ``--tokens`` rows), the
model's own inputs on ``--text``, or ``--inputs FILE``.

Per layer and implementation (dispatch.check.compare_backend):
  activation  which bytes of quantize_activation(x) differ from formats.quantize: codes per row and
              scale block, block scales, global scale;
  gemm        the GEMM on the oracle's quantized activation against formats.reference_linear, per
              (row, 128-column tile), in multiples of the element-wise bound of formats/bounds.py
              (printed, with its derivation);
  linear      the whole call (apply) the same way;
and the first bad block: layer, implementation, row, column tile (or K-block), and whether the
activation quantization or the GEMM departs first. ``--plot DIR`` writes a heat map per layer and
implementation (rows x column tiles, log10 error/bound).

``--replay FILE`` reruns a call captured by the watchdog (B12X_CHECK; dispatch.replay) on this
machine with every implementation available here, rechecks the output recorded in the file against
the oracle, and says whether the divergence reproduces.

Exit status: 0 when every implementation is within its bounds, 1 otherwise, 2 for bad arguments
(named: a missing MODEL, a --layers glob that matches nothing, an unreadable or foreign or newer
replay file, ...).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from dispatch import check, registry
from dispatch.api import library_versions

from . import _harness as H
from . import argtypes as A
from . import diff_models as DM


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def backends_here(variant: str, M: int, N: int, K: int, dtype: torch.dtype, device: str,
                  impls: Optional[list[str]] = None) -> tuple[dict, dict]:
    """({impl: Backend} that can run this call on ``device``, {impl: why not}) over registry.IMPLS
    (``impls``: a subset), in registry order."""
    dev = H.running_device(device)
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


def diff_layer(layer: DM.Layer, x: torch.Tensor, device: str, impls: Optional[list[str]] = None,
               input_source: str = "") -> dict[str, Any]:
    """Every implementation available here on one layer: {"layer", "variant", "M", "N", "K", "input",
    "results": {impl: compare_backend result}, "skipped": {impl: reason}, "routes": {impl: text},
    "first": {impl, stage, row, tile|kblock} or None, "ok"}."""
    x2 = x.reshape(-1, x.shape[-1]).to(device)
    M, K = x2.shape
    N = layer.qweight.rows
    qw = layer.qweight.to(device)
    bias = None if layer.bias is None else layer.bias.to(device=device, dtype=x2.dtype)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in layer.act_opts.items()}
    run, skipped = backends_here(layer.variant, M, N, K, x2.dtype, device, impls)
    results, routes = {}, {}
    dev = H.running_device(device)
    for impl, backend in run.items():
        with torch.no_grad():
            results[impl] = check.compare_backend(backend, qw, x2, bias, act_opts=opts,
                                                  device_kind=torch.device(device).type)
        routes[impl] = check.route_of(backend, M, N, K, x2.dtype, dev)
    firsts = [(impl, r["first"]) for impl, r in results.items() if r["first"] is not None]
    errors = {impl: r["error"] for impl, r in results.items() if r["error"]}
    first = None
    if firsts:
        impl, f = firsts[0]
        first = {"impl": impl, **f, "weight": results[impl]["weight"]}
    elif errors:
        impl = next(iter(errors))
        first = {"impl": impl, "stage": "error", "detail": errors[impl]}
    return {"layer": layer.name, "variant": layer.variant, "M": M, "N": N, "K": K, "input": input_source,
            "results": results, "skipped": skipped, "routes": routes, "first": first,
            "ok": all(r["ok"] for r in results.values())}


def layer_inputs(model: DM.Model, layers: list[DM.Layer], *, tokens: int, dtype: torch.dtype, seed: int,
                 text: Optional[str], inputs: Optional[str]) -> dict[str, tuple[torch.Tensor, str]]:
    """{layer: (x [M, K], where it came from)}: --inputs, --text, or seeded random activations."""
    got: dict[str, torch.Tensor] = {}
    source = "random"
    if inputs:
        got, source = DM.read_inputs(inputs), f"--inputs {inputs}"
    elif text is not None:
        got, source = DM.capture_text(model, text, dtype), "--text"
    out = {}
    for i, lay in enumerate(layers):
        if lay.name in got:
            x = got[lay.name]
            if x.shape[-1] != lay.qweight.k:
                raise ValueError(f"{source}: the input of layer {lay.name!r} has K={x.shape[-1]}, the layer "
                                 f"K={lay.qweight.k}")
            out[lay.name] = (x.reshape(-1, x.shape[-1]).to(dtype), source)
        else:
            gen = torch.Generator().manual_seed(seed * 100003 + i)
            x = H.make_input((tokens, lay.qweight.k), dtype, gen, "cpu")
            out[lay.name] = (x, f"random (seed {seed}, {tokens} rows)" + (
                "" if source == "random" else f"; not in {source}"))
    return out


def run_diff(model_path: str, *, layers: Optional[list[str]] = None, fmt: str = "nvfp4", tokens: int = 16,
             dtype: torch.dtype = torch.bfloat16, seed: int = 0, text: Optional[str] = None,
             inputs: Optional[str] = None, impls: Optional[list[str]] = None, device: Optional[str] = None,
             progress: bool = True, save_inputs: Optional[str] = None) -> dict[str, Any]:
    """The diff of a MODEL as a JSON-able dict (grids as lists). Raises ValueError for bad arguments
    (named): see dispatch.apps.diff_models.load_model and select."""
    device = device or H.default_device()
    model = DM.load_model(model_path, fmt, layers)
    chosen = DM.select(model.layers, layers)
    xs = layer_inputs(model, chosen, tokens=tokens, dtype=dtype, seed=seed, text=text, inputs=inputs)
    if save_inputs:
        from safetensors.torch import save_file

        save_file({k: v[0].contiguous() for k, v in xs.items()}, save_inputs)
    out_layers = []
    with H.Progress(len(chosen), "diff", enabled=progress) as bar:
        for lay in chosen:
            x, src = xs[lay.name]
            r = diff_layer(lay, x, device, impls, src)
            out_layers.append(r)
            bar.advance(f"{lay.name} {'ok' if r['ok'] else 'DEPARTS'}")
    return _result(model_path, model.kind, out_layers, model.skipped)


def _result(source: str, kind: str, out_layers: list[dict], skipped_modules: dict) -> dict[str, Any]:
    first = next(({"layer": r["layer"], **r["first"]} for r in out_layers if r["first"] is not None), None)
    return {"tool": "b12x-dual diff", "model": source, "kind": kind, "device": H.device_report(),
            "versions": library_versions(), "layers": out_layers, "not_quantized": skipped_modules,
            "first": first, "ok": all(r["ok"] for r in out_layers)}


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
def run_replay(path: str, *, impls: Optional[list[str]] = None, device: Optional[str] = None) -> dict[str, Any]:
    """Rerun a replay file here. Returns run_diff's fields plus "replay": {"layer", "impl", "variant",
    "recorded_on", "recorded_output": check of the file's y against the oracle here (or None),
    "reproduces": True/False, or None when the recorded implementation cannot run here,
    "why_not_here"}. Raises ValueError naming the file (dispatch.replay.read)."""
    from dispatch import replay

    rp = replay.read(path)
    device = device or H.default_device()
    layer = DM.Layer(rp.layer, rp.variant, rp.qweight, rp.bias, rp.act_opts)
    r = diff_layer(layer, rp.x, device, impls, f"replay {Path(path).name}")
    rec_kind = rp.meta.get("device", {}).get("kind", "cpu")
    recorded = None
    if rp.y is not None:
        backend = registry.entries()[(rp.impl, rp.variant)] if rp.impl in registry.IMPLS else None
        if backend is not None and not isinstance(backend, registry.UnsupportedEntry):
            recorded = _recheck_output(backend, rp, rec_kind)
    res = r["results"].get(rp.impl)
    info = {"layer": rp.layer, "impl": rp.impl, "variant": rp.variant, "route": rp.meta.get("route", ""),
            "recorded_on": rp.meta.get("device", {}), "recorded_versions": rp.meta.get("versions", {}),
            "recorded_report": rp.meta.get("report", {}), "recorded_output": recorded,
            "reproduces": None if res is None else (not res["ok"]),
            "why_not_here": r["skipped"].get(rp.impl, "" if res is not None else f"{rp.impl} is not known here")}
    out = _result(path, "replay file", [r], {})
    out["replay"] = info
    return out


def _recheck_output(backend, rp, rec_kind: str) -> dict[str, Any]:
    """The file's recorded output against the oracle here, with the bound of the device that produced it."""
    with torch.no_grad():
        res = check.check_call(backend, rp.qweight, rp.x, rp.y, rp.bias, rp.act_opts, device_kind=rec_kind,
                               requantize=False)
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
    return f"{H.fmt_num(st['worst'])}" + (f" ({st['n_bad']} bad)" if st["n_bad"] else "")


def first_line(first: Optional[dict]) -> str:
    """The first bad block of a report as one line."""
    if first is None:
        return "every implementation is within its bounds on every layer"
    head = f"layer {first['layer']}, {first['impl']}: " if "layer" in first else f"{first['impl']}: "
    if first["stage"] == "error":
        return head + f"raised {first['detail']}"
    return head + check.describe_first(first) + _weight_note(first.get("weight"))


def _weight_note(w) -> str:
    if not w or w["equal"]:
        return ""
    f = w["first"]
    return (f"; {first_weight_what(f['what'])} of the implementation's prepared weight differs from the layer's at "
            f"weight row {f['row']}, K-block {f['kblock']}")


def first_weight_what(what: str) -> str:
    return {"codes": "a code", "scale": "a block scale", "global_scale": "the global scale"}.get(what, what)


def print_report(result: dict[str, Any], *, plain: bool = False) -> None:
    """The rich table (one row per layer and implementation), the bounds, skips and the first bad block."""
    rows = []
    bounds = {}
    for r in result["layers"]:
        for impl, res in r["results"].items():
            f = res["first"]
            where = "-" if f is None else (f"act row {f['row']} kblk {f['kblock']}" if f["stage"] == "activation"
                                           else f"{f['stage']} row {f['row']} tile {f['tile']}")
            rows.append([r["layer"], r["variant"], f"{r['M']}x{r['N']}x{r['K']}", impl, _act_str(res["activation"]),
                         _stage_str(res["gemm"]), _stage_str(res["linear"]), where,
                         "ok" if res["ok"] else ("ERROR" if res["error"] else "DEPARTS")])
            bounds[(impl, r["variant"], res["out_dtype"])] = res["bound"]
    H.print_table(f"b12x-dual diff {result['model']} ({result['kind']}) on {result['device']['name']}: "
                  "error / bound, max per (row, 128-column tile)",
                  ["layer", "variant", "M x N x K", "impl", "activation vs oracle", "gemm", "linear",
                   "first bad block", "status"], rows, plain=plain)
    for (impl, variant, dt), text in bounds.items():
        print(f"bound {impl} {variant} {dt}: {text}")
    skipped = {}
    for r in result["layers"]:
        for impl, why in r["skipped"].items():
            skipped.setdefault((impl, why), []).append(r["layer"])
    for (impl, why), names in skipped.items():
        print(f"not run: {impl} on {len(names)} layer(s): {why}")
    for r in result["layers"]:
        for impl, res in r["results"].items():
            if res["error"]:
                print(f"ERROR {r['layer']} {impl}: {res['error']}")
    if "replay" in result:
        rp = result["replay"]
        dev = rp["recorded_on"]
        print(f"replay of layer {rp['layer']}: recorded on {dev.get('name', '?')} ({dev.get('capability', dev.get('kind', '?'))}) "
              f"with {rp['impl']} ({rp['variant']}), route: {rp['route'] or '-'}")
        rec = rp["recorded_output"]
        if rec is not None:
            print("recorded output against the oracle here: " + (
                "within the bound" if rec["ok"] else check.describe_first(rec["first"])))
        if rp["reproduces"] is None:
            print(f"reproduces here: cannot tell: {rp['impl']} does not run here ({rp['why_not_here']})")
        else:
            print(f"reproduces here: {'YES' if rp['reproduces'] else 'no'} ({rp['impl']} rerun on this machine)")
    print("first bad block: " + first_line(result["first"]))
    sys.stdout.flush()


def plot(result: dict[str, Any], folder: str) -> list[str]:
    """A heat map per layer and implementation: rows x column tiles, log10(error / bound) of the gemm
    stage (linear where there is no gemm). Returns the files written; [] without matplotlib (said)."""
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
        for impl, res in r["results"].items():
            st = res["gemm"] or res["linear"]
            if st is None:
                continue
            g = torch.as_tensor(st["grid"], dtype=torch.float64)
            z = torch.log10(g.clamp(min=1e-6)).clamp(max=6.0)
            fig, ax = plt.subplots(figsize=(max(3.0, 0.5 * g.shape[1] + 2), max(2.5, 0.15 * g.shape[0] + 1.5)))
            im = ax.imshow(z.numpy(), aspect="auto", cmap="magma", vmin=-6, vmax=max(1.0, float(z.max())),
                           interpolation="nearest")
            ax.set_xlabel(f"column tile ({check.TILE_N} columns)")
            ax.set_ylabel("row")
            ax.set_title(f"{r['layer']} {impl} {st['stage']}: log10(error / bound)", fontsize=8)
            fig.colorbar(im, ax=ax)
            if st["first"] is not None:
                ax.scatter([st["first"]["tile"]], [st["first"]["row"]], marker="x", color="cyan")
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{r['layer']}-{impl}") + ".png"
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
                   help="layer names or fnmatch globs, comma-separated (default: every quantized linear)")
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
    p.add_argument("--tokens", type=A.positive_int, default=16, help="rows of the random activations (default 16)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--seed", type=A.nonnegative_int, default=0)
    p.add_argument("--device", type=A.torch_device, default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--json", type=A.output_path, default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", type=_plot_dir, default=None, metavar="DIR",
                   help="write a heat map per layer and implementation into this folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def run(args) -> int:
    """0: every implementation within its bounds; 1: one departs (or raised); 2: bad arguments."""
    if (args.model is None) == (args.replay is None):
        print("b12x-dual diff: error: give MODEL or --replay FILE (one of them)", file=sys.stderr)
        return 2
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
        return 2
    print_report(result, plain=args.plain)
    if args.plot:
        files = plot(result, args.plot)
        print(f"wrote {len(files)} heat map(s) to {args.plot}")
    if args.json:
        H.write_json(args.json, jsonable(result))
        print(f"wrote {args.json}")
    return 0 if result["ok"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="b12x-dual diff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
