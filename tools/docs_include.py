"""Docs include code from the real files: refresh or check the included snippets in docs/*.md.

In a markdown file, a directive line followed by a fenced code block:

    <!-- include: kernels_triton/nvfp4.py#native-kernel -->
    ```python
    ...the lines between the markers, verbatim...
    ```

In the source, the snippet sits between two marker lines (any comment leader, indentation free):

    # [native-kernel]
    ...
    # [/native-kernel]

    python tools/docs_include.py           # check: exit 1 and list every stale block / missing marker
    python tools/docs_include.py --write   # rewrite every docs/*.md block from its source

Paths are relative to the repository root. A directive without a fence after it gets one on --write.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^<!--\s*include:\s*(?P<path>[^#\s]+)#(?P<name>[\w.-]+)\s*-->\s*$")
LANGS = {".py": "python", ".md": "markdown", ".toml": "toml", ".sh": "bash"}


class IncludeError(ValueError):
    """A directive whose source file or markers are missing or malformed."""


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the directive
    path: str
    name: str
    current: str | None  # the fenced block's text now (None: no fence follows)


def snippet(root: Path, path: str, name: str) -> str:
    """The lines between ``[name]`` and ``[/name]`` marker lines of root/path (verbatim, joined)."""
    src = root / path
    if not src.is_file():
        raise IncludeError(f"{path}: no such file")
    lines = src.read_text().splitlines()
    open_re = re.compile(rf"^\s*(#|//|<!--)\s*\[{re.escape(name)}\]")
    close_re = re.compile(rf"^\s*(#|//|<!--)\s*\[/{re.escape(name)}\]")
    starts = [i for i, ln in enumerate(lines) if open_re.match(ln)]
    ends = [i for i, ln in enumerate(lines) if close_re.match(ln)]
    if len(starts) != 1 or len(ends) != 1:
        raise IncludeError(f"{path}: marker [{name}] found {len(starts)} times, [/{name}] {len(ends)} times "
                           "(each must appear exactly once)")
    if ends[0] <= starts[0]:
        raise IncludeError(f"{path}: [/{name}] comes before [{name}]")
    return "\n".join(lines[starts[0] + 1:ends[0]])


def _fence_at(lines: list[str], i: int) -> tuple[int, int] | None:
    """(first, last) line indices of a fenced block starting at lines[i], or None."""
    if i >= len(lines) or not lines[i].startswith("```"):
        return None
    for j in range(i + 1, len(lines)):
        if lines[j].startswith("```"):
            return i, j
    return None


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    out = []
    for i, ln in enumerate(lines):
        m = DIRECTIVE.match(ln)
        if m:
            fence = _fence_at(lines, i + 1)
            cur = "\n".join(lines[fence[0] + 1:fence[1]]) if fence else None
            out.append(Block(doc, i + 1, m["path"], m["name"], cur))
    return out


def refresh(text: str, root: Path) -> str:
    """``text`` with every included block replaced by its source snippet (IncludeError if one is missing)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        ln = lines[i]
        out.append(ln)
        m = DIRECTIVE.match(ln)
        i += 1
        if not m:
            continue
        body = snippet(root, m["path"], m["name"])
        lang = LANGS.get(Path(m["path"]).suffix, "")
        fence = _fence_at(lines, i)
        opener = lines[fence[0]] if fence else f"```{lang}"
        out += [opener, *body.split("\n"), "```"]
        if fence:
            i = fence[1] + 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def check(root: Path = ROOT, docs: list[Path] | None = None) -> list[str]:
    """Problems, one line each: stale blocks, directives without a fence, missing files or markers."""
    problems = []
    for doc in docs if docs is not None else sorted((root / "docs").glob("*.md")):
        for b in blocks(doc):
            where = f"{doc.relative_to(root)}:{b.line} ({b.path}#{b.name})"
            try:
                want = snippet(root, b.path, b.name)
            except IncludeError as e:
                problems.append(f"{where}: {e}")
                continue
            if b.current is None:
                problems.append(f"{where}: no fenced code block follows the directive")
            elif b.current != want:
                problems.append(f"{where}: the block differs from the source (run tools/docs_include.py --write)")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the blocks in docs/*.md from their sources")
    args = p.parse_args(argv)
    if args.write:
        for doc in sorted((ROOT / "docs").glob("*.md")):
            text = doc.read_text()
            try:
                new = refresh(text, ROOT)
            except IncludeError as e:
                print(f"{doc.relative_to(ROOT)}: {e}", file=sys.stderr)
                return 1
            if new != text:
                doc.write_text(new)
                print(f"updated {doc.relative_to(ROOT)}")
        return 0
    problems = check()
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
