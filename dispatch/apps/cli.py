"""The ``b12x-dual`` command line.

Each subcommand is a module with ``add_parser(subparsers)`` (declares the subcommand and its options)
and ``run(args) -> int`` (does the work, returns the exit status). To add one (``sweep``, ``bench``),
write the module and append its name to SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from importlib.metadata import PackageNotFoundError, version

SUBCOMMANDS = ["dispatch.apps.info", "dispatch.apps.explain", "dispatch.apps.demo", "dispatch.apps.sweep", "dispatch.apps.bench",
               "dispatch.apps.diff"]
"""Modules providing a subcommand, in the order ``--help`` lists them."""


def _version() -> str:
    try:
        return version("b12x-dual")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="b12x-dual",
        description="Quantized linear kernels for NVIDIA SM12x in five formats (Triton and CuTe DSL).",
    )
    p.add_argument("--version", action="version", version=f"b12x-dual {_version()}")
    p.add_argument("-v", "--verbose", dest="log_info", action="store_true",
                   help="log the dispatcher's decisions and skipped layers (INFO)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        mod = importlib.import_module(name)
        sp = mod.add_parser(sub)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.log_info else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
