"""The ``b12x-dual`` command line."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("b12x-dual")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="b12x-dual", description=__doc__)
    p.add_argument("--version", action="version", version=f"b12x-dual {_version()}")
    p.add_subparsers(dest="command")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
    return 0
