"""argparse ``type=`` callables for the subcommands: each checks one option's value when the command
line is parsed, before any work starts, and a bad value stops the command with exit status 2 and
``argument --flag: invalid ... 'value' (expected ...)`` (argparse prefixes the flag to the message of
the :class:`argparse.ArgumentTypeError` raised here).

Output paths (``--json``, ``--plot``) are checked the same way: not a directory, writable, and the
parent folder existing or creatable, so that a bad path fails at once instead of after the run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from dispatch.devices import KNOWN_DEVICES, resolve

Invalid = argparse.ArgumentTypeError


def _number(conv: Callable, name: str, article: str, low: float, low_ok: bool) -> Callable[[str], float]:
    want = f"{article} {name} {'>=' if low_ok else '>'} {low:g}"

    def parse(value: str):
        try:
            v = conv(value)
        except (TypeError, ValueError):
            raise Invalid(f"invalid {name} {value!r} (expected {want})") from None
        if v != v or v in (float("inf"), float("-inf")) or (v < low if low_ok else v <= low):
            raise Invalid(f"invalid {name} {value!r} (expected {want})")
        return v

    parse.__name__ = name
    return parse


positive_int = _number(int, "integer", "an", 0, False)
nonnegative_int = _number(int, "integer", "an", 0, True)
positive_float = _number(float, "number", "a", 0, False)
nonnegative_float = _number(float, "number", "a", 0, True)


def _items(value: str) -> list[str]:
    return [v.strip() for v in str(value).split(",") if v.strip()]


def int_list(value: str) -> list[int]:
    """"1,16,4096" -> [1, 16, 4096]: comma-separated positive integers, at least one."""
    items = _items(value)
    try:
        out = [int(v) for v in items]
    except ValueError:
        out = []
    if not out or any(v <= 0 for v in out):
        raise Invalid(f"invalid int list {value!r} (expected comma-separated positive integers)")
    return out


def choice_list(allowed: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """A parser of "a,b" -> ["a", "b"] whose items must come from ``allowed`` (at least one)."""
    allowed = tuple(allowed)

    def parse(value: str) -> list[str]:
        items = _items(value)
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            why = f"unknown {what} {', '.join(map(repr, bad))}; " if bad else ""
            raise Invalid(f"invalid {what} list {value!r} ({why}expected comma-separated names from "
                          f"{', '.join(allowed)})")
        return items

    parse.__name__ = f"{what} list"
    return parse


def known_device(value: str):
    """A part from the policy's table (``h200``, ``rtx_5090``, ...) or a torch device this process
    has -> its DeviceInfo."""
    try:
        return resolve(value)
    except ValueError as e:
        raise Invalid(f"invalid device {value!r} ({e}; parts: {', '.join(KNOWN_DEVICES)})") from None


def torch_device(value: str) -> str:
    """A torch device string that this process can use ("cpu", "cuda", "cuda:1")."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise Invalid(f"invalid torch device {value!r} (expected e.g. cpu, cuda, cuda:0)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index is not None and dev.index >= n):
            raise Invalid(f"invalid torch device {value!r} (this process sees {n} CUDA devices)")
    elif dev.type != "cpu":
        raise Invalid(f"invalid torch device {value!r} (expected cpu or cuda[:index])")
    return value


def output_path(value: str) -> str:
    """A file to write: not a directory, writable if it exists, else its nearest existing ancestor a
    writable directory (the missing folders are created when the file is written).

    Writability is tried, not only looked up (``os.access`` says yes to root everywhere, also where
    no file can be made, e.g. /proc or a read-only mount): an existing file is opened for appending
    (its contents untouched), and a temporary file is created and removed in the nearest existing
    folder."""
    if not value:
        raise Invalid("invalid output path '' (expected a file path)")
    p = Path(value).expanduser().absolute()
    if p.is_dir():
        raise Invalid(f"invalid output path {value!r} (it is a directory; expected a file path)")
    if p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            raise Invalid(f"invalid output path {value!r} (the file exists and is not writable: "
                          f"{e.strerror or e})") from None
        return value
    anc = p.parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise Invalid(f"invalid output path {value!r} ({str(anc)!r} is a file, not a folder)")
    try:
        with tempfile.NamedTemporaryFile(dir=anc, prefix=".b12x-dual-write-probe-"):
            pass
    except OSError as e:
        raise Invalid(f"invalid output path {value!r} (cannot create files under {str(anc)!r}: "
                      f"{e.strerror or e})") from None
    return value


def input_file(value: str) -> str:
    """A file to read: exists, is a file, readable."""
    p = Path(value).expanduser()
    if not p.is_file():
        why = "it is a directory" if p.is_dir() else "no such file"
        raise Invalid(f"invalid input file {value!r} ({why})")
    if not os.access(p, os.R_OK):
        raise Invalid(f"invalid input file {value!r} (not readable)")
    return value
