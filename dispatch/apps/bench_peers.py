"""``b12x-dual bench --peers gemlite``: other libraries' equivalents of each format, timed in the same
process with the same timer, the same activations and the same master weight as our rows.

gemlite (PyPI ``gemlite``, pure Python + Triton; ``pip install b12x-dual[peers]``) is imported
lazily, only when asked for. Each peer quantizes the bf16 master weight itself (its own recipe) and
quantizes the activations inside its forward, so its row is the whole linear, as ours is in mode
"linear". A peer that cannot be imported, built or run on this device is a row with the error,
never a crash of the bench. Its tuned configurations are keyed by GPU name; it has none for the
H200, so there its H100 configuration (the same sm_90 chip) is loaded and the output says so.

Accuracy beside ours: ``err_vs_unquantized`` = ||y - x . W^T|| / ||x . W^T|| over the checked rows,
against the float64 product of the bf16 activations and the unquantized (bf16) master weight; the
bench computes the same figure for our rows, so the two columns compare like with like (each
format's quantization error plus its arithmetic).

Mapping (ours -> gemlite 0.6 helper; where the recipes differ, the row's note says how):
    fp8_tensor   A8W8_fp8_dynamic                  per-channel weight, per-token activation scales
    fp8_block    A8W8_fp8_dynamic(block_quant)     128 x 128 weight blocks, 1 x 128 activations
    mxfp8        A8W8_MXFP_dynamic
    nvfp4        A4W4_NVFP_dynamic
    mxfp4        A4W4_MXFP_dynamic
    nvfp4_w4a16  A16W4_NVFP
    mxfp4_w4a16  A16W4_MXFP
    mxfp8_w8a16  A16W8_MXFP
    fp8_channel  A8W8_fp8_dynamic                  the same recipe: per-channel weight, per-token activation scales
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dispatch.devices import current_device

from . import _harness as H

PEERS = ("gemlite",)
GEMLITE_PIN = "gemlite==0.6.0.post2"


@dataclass(frozen=True)
class PeerFormat:
    helper: str
    kwargs: tuple = ()
    note: str = ""


GEMLITE_FORMATS: dict[str, PeerFormat] = {
    "fp8_tensor": PeerFormat("A8W8_fp8_dynamic", (), "per-channel weight / per-token activation scales (ours: per-tensor)"),
    "fp8_block": PeerFormat("A8W8_fp8_dynamic", (("block_quant", True),), "128x128 weight / 1x128 activation blocks"),
    "mxfp8": PeerFormat("A8W8_MXFP_dynamic"),
    "nvfp4": PeerFormat("A4W4_NVFP_dynamic"),
    "mxfp4": PeerFormat("A4W4_MXFP_dynamic"),
    "nvfp4_w4a16": PeerFormat("A16W4_NVFP"),
    "mxfp4_w4a16": PeerFormat("A16W4_MXFP"),
    "mxfp8_w8a16": PeerFormat("A16W8_MXFP"),
    "fp8_channel": PeerFormat("A8W8_fp8_dynamic"),
}


class PeerUnavailable(RuntimeError):
    """The peer library cannot run here (not installed, no GPU, import failed); the message says why."""


def load_gemlite() -> tuple[Any, dict[str, Any]]:
    """Import gemlite and pick its tuned configuration; (module, info) or PeerUnavailable.

    info: version, and config_note saying which tuned configuration was loaded (the H100 one on an
    H200 or any other sm_90 part gemlite has none for)."""
    if not torch.cuda.is_available():
        raise PeerUnavailable("gemlite needs a CUDA GPU; no CUDA device here")
    try:
        import gemlite  # noqa: PLC0415 (lazy: only for --peers gemlite)
        from gemlite import core as gcore
    except Exception as e:  # not installed, or its import failed on this machine
        raise PeerUnavailable(f"gemlite not importable ({type(e).__name__}: {str(e)[:160]}); "
                              f"install it with `pip install b12x-dual[peers]` ({GEMLITE_PIN})") from None
    name = torch.cuda.get_device_name()
    info: dict[str, Any] = {"version": getattr(gemlite, "__version__", "?"), "device": name}
    tag = gcore.get_default_cache_config()
    if tag is not None:
        info["config_note"] = f"gemlite's tuned config for this GPU: {os.path.basename(tag)}"
    elif current_device().is_sm90:
        h100 = os.path.join(os.path.dirname(gcore.__file__), "configs", "h100.json")
        ok = gcore.GemLiteLinearTriton.load_config(h100)
        info["config_note"] = (f"gemlite has no tuned config for {name}; loaded its H100 config "
                               f"(h100.json, the same sm_90 chip){'' if ok else ' -- FAILED to load, autotuning'}")
    else:
        info["config_note"] = f"gemlite has no tuned config for {name}; it autotunes"
    return gemlite, info


def unquantized_error(y: torch.Tensor, x: torch.Tensor, w_bf16_64: torch.Tensor, rows: torch.Tensor) -> float:
    """||y - x . W^T|| / ||x . W^T|| over ``rows``, against the float64 product of the bf16
    activations and the unquantized bf16 weight (as float64 [N, K])."""
    r = rows.to(y.device)
    ref = x[r].to(torch.float64) @ w_bf16_64.T
    d = y.reshape(-1, y.shape[-1])[r].to(torch.float64) - ref
    return float(d.norm() / ref.norm().clamp_min(1e-300))


def _gemlite_layer(gemlite, variant: str, w_bf16: torch.Tensor):
    spec = GEMLITE_FORMATS[variant]
    N, K = w_bf16.shape
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device=w_bf16.device)
    with torch.no_grad():
        lin.weight.copy_(w_bf16)
    helper = getattr(gemlite.helper, spec.helper)(device=str(w_bf16.device), dtype=torch.bfloat16, **dict(spec.kwargs))
    return helper.from_linear(lin, del_orig=True)


def known_failure(variant: str) -> Optional[str]:
    """Why gemlite's equivalent of ``variant`` is not attempted here, or None. Its NVFP4 kernels
    (dot_scaled with e4m3 scales) fail to compile on sm_90 with Triton < 3.7 (triton#7549, fixed by
    #9772), and its autotuner then compiles and fails every candidate, each printing an MLIR dump:
    minutes per shape (docs/results.md has the H200 run that showed it)."""
    import triton

    if "NVFP" not in GEMLITE_FORMATS[variant].helper or not torch.cuda.is_available():
        return None
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    if current_device().is_sm90 and (major, minor) < (3, 7):
        return (f"not attempted: gemlite's NVFP4 kernels do not compile on sm_90 with Triton {triton.__version__} "
                "('PassManager::run failed' in TritonGPUAccelerateMatmul, triton#7549)")
    return None


def time_peers(session, cfg, variants: list[str], peers: list[str], state: dict,
               over_budget=lambda: False) -> list[str]:
    """The peer rows of one (shape, M): kind "peer", name the peer, the variant it stands in for;
    timed like ours ("linear": whole layer, bf16 in and out), or ``error``/``skipped`` with why.
    ``state`` caches the import and each variant's first failure per run (a variant that failed is
    not retried: gemlite's autotuner can spend minutes failing). Returns progress labels."""
    labels = []
    failed = state.setdefault("_failed", {})
    for peer in peers:
        if peer.startswith("_"):
            continue
        if peer not in state:
            try:
                state[peer] = load_gemlite() + (None,)
            except PeerUnavailable as e:
                state[peer] = (None, {}, str(e))
        mod, info, why = state[peer]
        for v in variants:
            row = {"kind": "peer", "name": peer, "variant": v, "mode": "linear", **cfg.common}
            labels.append(f"{cfg.shape.id} M={cfg.M} {v} {peer}")
            spec = GEMLITE_FORMATS.get(v)
            if why is not None or spec is None:
                row.update({"skipped": why or f"{peer} has no equivalent of {v}", "us": None})
                session.results.append(row)
                continue
            row.update({"peer_helper": spec.helper, "peer_note": spec.note, "peer_version": info.get("version")})
            skip = known_failure(v) or (over_budget() and "time budget spent")
            if skip or (peer, v) in failed:
                row.update({"skipped": skip} if skip else {"error": f"failed earlier in this run: {failed[(peer, v)]}"})
                row["us"] = None
                session.results.append(row)
                continue
            try:
                w0 = cfg.cache.w.to(torch.bfloat16)
                ns = min(len(cfg.xs), 5 if session.gpu else 1)
                layers = [_gemlite_layer(mod, v, w0 if i == 0 else w0.clone()) for i in range(ns)]
                fns = [(lambda x=x, layer=layer: layer(x)) for x, layer in zip(cfg.xs, layers)]
                # bytes as for our rows: the peer's own weight tensors + bf16 activation + bf16 output
                w_bytes = sum(t.numel() * t.element_size() for t in layers[0].parameters())
                w_bytes += sum(t.numel() * t.element_size() for t in layers[0].buffers())
                row["bytes"] = w_bytes + cfg.x_bytes + cfg.M * cfg.shape.N * 2
                row["n_sets"] = len(fns)
                row.update(session.timer(fns, cfg.M))
                y = fns[0]()
                row["err_vs_unquantized"] = unquantized_error(y, cfg.xs[0], cfg.cache.wd(None), cfg.rows)
                session.record(row)
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}"
                failed[(peer, v)] = msg
                row.update({"error": msg, "us": None, "traceback": traceback.format_exc(limit=2)[-800:]})
                session.results.append(row)
            finally:
                torch.cuda.empty_cache() if session.gpu else None
    return labels


def peer_info(state: dict) -> dict:
    out = {}
    for p, entry in state.items():
        if not p.startswith("_"):
            _, info, why = entry
            out[p] = {"available": True, **info} if why is None else {"available": False, "why": why}
    return out


def print_peers(result: dict, *, plain: bool = False) -> None:
    """ours (linear) vs each peer row of the same (shape, M, variant): time, speed-up, error."""
    rows = [r for r in result["results"] if r["kind"] == "peer"]
    if not rows:
        return
    for p, info in (result.get("peers") or {}).items():
        print(f"{p}: " + (f"{info.get('version')} -- {info.get('config_note')}" if info.get("available")
                          else f"not run: {info.get('why')}"))
    # ours: the production row where it ran (hopper on sm_90), else the readable kernels' row
    ours = {}
    for name in ("triton", "hopper"):
        ours.update({(r["shape"], r["M"], r["variant"]): r for r in result["results"]
                     if r["kind"] == "impl" and r["name"] == name and r["mode"] == "linear"})
    table = []
    for r in rows:
        o = ours.get((r["shape"], r["M"], r["variant"]), {})
        ou, pu = o.get("us"), r.get("us")
        table.append([r["shape"], r["M"], r["variant"], H.fmt_num(ou, ".1f") if ou else "-",
                      H.fmt_num(pu, ".1f") if pu else "-", f"{pu / ou:.2f}x" if ou and pu else "-",
                      H.fmt_num(o.get("err_vs_unquantized")), H.fmt_num(r.get("err_vs_unquantized")),
                      (r.get("error") or r.get("skipped") or r.get("peer_note") or "")[:90]])
    H.print_table("ours (hopper where it ran, else triton; whole linear) vs peers: us, speed-up of ours = t(peer) / t(ours), "
                  "||y - x.W^T|| / ||x.W^T|| vs the unquantized weight",
                  ["shape", "M", "variant", "ours us", "peer us", "ours faster", "ours err", "peer err", "peer note / error"],
                  table, plain=plain)
