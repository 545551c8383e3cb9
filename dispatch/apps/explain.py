"""``b12x-dual explain``: which implementation serves one call here (or on a described device), why,
and the kernels it launches: ``dispatch.explain`` for a linear layer, ``dispatch.explain_moe`` for
an MoE layer (``--moe``).

    b12x-dual explain --format nvfp4 -m 16 -N 8192 -K 8192 --device h200
    b12x-dual explain --moe --experts 128 --top-k 8 --hidden 2048 --intermediate 768 --format nvfp4 -m 16
    b12x-dual explain --moe --experts 32 --top-k 4 --hidden 2880 --intermediate 2880 --format mxfp4_w4a16 \\
        --activation swigluoai --device gb10 --impl triton
"""

from __future__ import annotations

import argparse
import sys

from dispatch import api, moe, policy
from dispatch.devices import KNOWN_DEVICES
from dispatch.registry import VARIANTS
from formats import MOE_ACTIVATIONS

from . import _harness as H
from . import argtypes as A


def add_moe_arguments(p: argparse.ArgumentParser, *, defaults: bool = False) -> None:
    """The MoE layer's shape options (explain and info share them): --experts, --top-k, --hidden,
    --intermediate, --activation. ``defaults``: Qwen3-30B-A3B's layer (128 experts, top-8, hidden
    2048, moe_intermediate 768, silu) where an option is not given; else they are required with --moe."""
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--experts", type=A.positive_int, default=d(128), help="experts of the layer (E)")
    p.add_argument("--top-k", type=A.positive_int, default=d(8), help="experts per token (top_k)")
    p.add_argument("--hidden", type=A.positive_int, default=d(2048), help="hidden size H (W13's K, W2's rows)")
    p.add_argument("--intermediate", type=A.positive_int, default=d(768),
                   help="the experts' intermediate size I (W13 has 2I rows, W2 I columns)")
    p.add_argument("--activation", choices=MOE_ACTIVATIONS, default="silu",
                   help="the experts' gated activation (default silu; gpt-oss: swigluoai)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("explain",
                              help="which implementation serves one linear or MoE call, why, and its kernels",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", required=True, choices=list(VARIANTS), metavar="FORMAT",
                   help=f"the variant: one of {', '.join(VARIANTS)}")
    p.add_argument("-m", type=A.positive_int, default=1, help="tokens M of the call (default 1)")
    p.add_argument("-N", type=A.positive_int, default=4096, help="linear: output features (default 4096)")
    p.add_argument("-K", type=A.positive_int, default=4096, help="linear: input features (default 4096)")
    p.add_argument("--dtype", choices=list(H.DTYPES), default="bf16", help="linear: activation dtype (default bf16)")
    p.add_argument("--device", type=A.known_device, default=None,
                   help=f"a torch device (default: the one found) or a known part: {', '.join(KNOWN_DEVICES)}")
    p.add_argument("--impl", type=lambda v: _impl(v), default=None,
                   help=f"also show what this request picks: one of {', '.join(policy.REQUESTS)}")
    p.add_argument("--moe", action="store_true",
                   help="an MoE layer (needs --experts, --top-k, --hidden, --intermediate)")
    add_moe_arguments(p)


def _impl(value: str) -> str:
    try:
        return policy.parse_impl(value, "--impl")
    except ValueError as e:
        raise A.Invalid(str(e)) from None


def run(args) -> int:
    try:
        if args.moe:
            missing = [f"--{n.replace('_', '-')}" for n in ("experts", "top_k", "hidden", "intermediate")
                       if getattr(args, n) is None]
            if missing:
                print(f"b12x-dual explain --moe: missing {', '.join(missing)}", file=sys.stderr)
                return 2
            text = moe.explain_moe(args.format, args.m, args.experts, args.top_k, args.hidden, args.intermediate,
                                   args.device, activation=args.activation, impl=args.impl)
        elif args.impl is not None:
            with policy.use_impl(args.impl):
                text = api.explain(args.format, args.m, args.N, args.K, args.device, dtype=H.DTYPES[args.dtype])
        else:
            text = api.explain(args.format, args.m, args.N, args.K, args.device, dtype=H.DTYPES[args.dtype])
    except ValueError as e:  # a bad B12X_IMPL, a shape no backend takes: one clear line, no traceback
        print(f"b12x-dual explain: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="b12x-dual explain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
