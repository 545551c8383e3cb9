"""``b12x-dual info``: the device, library versions, and auto's pick per format and shape class
with the route it takes (kernels launched, tile, split-K, why); with ``--moe``, the same for an MoE
layer (dispatch.moe: default shape Qwen3-30B-A3B's, 128 experts, top-8, hidden 2048, intermediate 768)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dispatch import api, policy, registry
from dispatch.contract import shape_classes
from dispatch.devices import KNOWN_DEVICES, resolve

from . import argtypes as A

VLLM_DEVICE_ENV = "VLLM_TARGET_DEVICE"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "info",
        help="device, library versions, and which implementation serves each format",
        description="Show the device found, the versions of torch, triton, b12x and nvidia-cutlass-dsl, "
                    "and for every format which implementation B12X_IMPL=auto picks for decode "
                    "(M=1, 16) and prefill (M=4096) shapes, why, and the route it takes (the kernels "
                    "launched, their tile and split-K).",
    )
    p.add_argument("--device", type=A.known_device, default=None,
                   help=f"a torch device (default: the one found) or a known part: {', '.join(KNOWN_DEVICES)}")
    p.add_argument("-N", type=A.positive_int, default=4096, help="output features of the example shapes (default 4096)")
    p.add_argument("-K", type=A.positive_int, default=4096, help="input features of the example shapes (default 4096)")
    p.add_argument("--moe", action="store_true",
                   help="also show auto's pick for an MoE layer of every format (--experts, --top-k, --hidden, "
                        "--intermediate, --activation; default Qwen3-30B-A3B's layer)")
    from .explain import add_moe_arguments

    add_moe_arguments(p, defaults=True)
    p.add_argument("--vllm", action="store_true",
                   help="also show, for each vLLM quantization scheme, which linear kernel vLLM picks on this "
                        "platform with and without the b12x-dual plugin, and every reason along its priority list "
                        "(needs vLLM: pip install 'b12x-dual[vllm]')")
    return p


def moe_table(dev, E: int, top_k: int, hidden: int, intermediate: int, activation: str):
    """A rich Table: per variant and shape class (decode M=1, 16; prefill 4096), the MoE table's auto
    pick on ``dev`` (dispatch.moe.decide), its reason and route; a variant nothing serves says why."""
    from rich.markup import escape
    from rich.table import Table

    from dispatch import moe

    table = Table(title=f"auto's choice for an MoE layer (E={E}, top_k={top_k}, H={hidden}, I={intermediate}, "
                        f"{activation})", show_lines=True)
    table.add_column("format")
    classes = [(label, m) for label, m, _ in moe.moe_shape_classes(1)]  # decode M=1 first, then 16, 4096
    for label, _ in classes:
        table.add_column(label)
    for variant in registry.VARIANTS:
        cells = []
        for _, m in classes:
            p = moe.MoEProblem(variant, E, top_k, hidden, intermediate, m, activation)
            try:
                c = moe.decide(policy.Request("auto", "default"), p, dev, log_choice=False)
            except registry.NoBackend as e:
                cells.append(f"[red]none[/]: {escape(str(e))}")
                continue
            route = api.route_text(c.backend.route(p, dev))
            cells.append(f"[bold]{c.impl}[/]: {escape(c.reason)}\n[dim]route[/]: {escape(route)}")
        table.add_row(variant, *cells)
    return table


def run(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # rich assumes 80 columns in a pipe
    try:
        dev = resolve(args.device)
        requested, source = policy.requested_impl()
    except ValueError as e:  # a bad --device or B12X_IMPL: one clear line, no traceback
        Console(stderr=True).print(f"[red]b12x-dual info: {e}[/]")
        return 2
    console.print(f"[bold]device[/]: {api.describe_device(dev)}")
    console.print("[bold]libraries[/]: " + ", ".join(f"{k} {v}" for k, v in api.library_versions().items()))
    console.print(f"[bold]{policy.ENV_VAR}[/]: {requested} (from {source})")
    shapes = shape_classes(args.N, args.K)
    table = Table(title=f"auto's choice (N={args.N}, K={args.K})", show_lines=True)
    table.add_column("format")
    for label in shapes:
        table.add_column(label)
    for variant in registry.VARIANTS:
        cells = []
        for m, n, k in shapes.values():
            c = registry.choose(variant, m, n, k, dev, impl="auto", log_choice=False)
            route = api.route_text(c.backend.route(registry.Problem(variant, m, n, k), dev))
            cells.append(f"[bold]{c.impl}[/]: {c.reason}\n[dim]route[/]: {escape(route)}")
        table.add_row(variant, *cells)
    console.print(table)
    if args.moe:
        console.print(moe_table(dev, args.experts, args.top_k, args.hidden, args.intermediate, args.activation))
    if args.vllm:
        if not torch.cuda.is_available() and not os.environ.get(VLLM_DEVICE_ENV):
            # vLLM cannot infer a platform on a machine without a GPU unless told: its CPU platform
            # is the one this report can describe here (set before vLLM reads it, at first use)
            os.environ[VLLM_DEVICE_ENV] = "cpu"
            console.print(f"[bold]vLLM platform[/]: cpu (no CUDA device: {VLLM_DEVICE_ENV}=cpu set for this report)")
        from dispatch.vllm_plugin import report

        try:
            rows = report.selection_report(n=args.N, k=args.K)
        except ImportError as e:
            Console(stderr=True).print(f"[red]b12x-dual info --vllm: {e}[/]")
            return 2
        console.print("[bold]vLLM's kernel selection[/] (+ passes, - refuses, in priority order)")
        console.print(report.format_rows(rows), markup=False, highlight=False)
    return 0
