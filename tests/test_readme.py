"""README.md as a new user reads it: its quick use runs and prints what the README shows, every doc
under docs/ is linked from it, and no doc or link points outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _quick_use() -> tuple[str, list[str]]:
    """The quick use's Python block, and the output it shows: the comment lines right after each
    print() (a comment line is '# ' followed by what is printed)."""
    block = re.search(r"```python\n(.*?)```", _section(README.read_text(), "Quick use"), re.S).group(1)
    lines = block.splitlines()
    shown = []
    for i, line in enumerate(lines):
        if line.startswith("print("):
            assert i + 1 < len(lines) and lines[i + 1].startswith("# "), f"print without its output: {line}"
            shown.append(lines[i + 1][2:])
    return block, shown


def test_quick_use_prints_what_the_readme_shows():
    code, shown = _quick_use()
    assert len(shown) == 2 and "dispatch.linear(" in code and "QuantLinear" in code
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout.splitlines()
    # The README shows a run without an SM12x GPU; where auto picks another implementation for the
    # layer on this device (cute on SM120/SM121 with b12x), the line names that one, as the
    # README's text says.
    import torch

    import dispatch

    auto = dispatch.choose("mxfp8", 4, 256, 512, dispatch.current_device(), impl="auto", log_choice=False).impl
    want = [shown[0], shown[1].rsplit(" ", 1)[0] + " " + auto]
    assert shown[1].endswith(" triton") and (auto == "triton" or torch.cuda.is_available())
    assert printed == want, f"README shows {want}, the code printed {printed}"


def test_every_doc_is_linked_from_the_readme():
    text = README.read_text()
    missing = [d.name for d in DOCS if f"](docs/{d.name})" not in text]
    assert not missing, f"docs not linked from README.md: {missing}"


def _targets(doc: Path):
    """(what, resolved path) for every markdown link to a file (relative to the doc) and every
    `../` path in a doc's text, resolved both from the doc's folder and from the repository root
    (where the docs' commands run)."""
    text = doc.read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code blocks hold code, not links
    for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", prose):
        if not re.match(r"[a-z]+:", m.group(1)):  # not http:, https:, mailto:
            yield m.group(0), (doc.parent / m.group(1)).resolve()
    for m in re.finditer(r"(?<![\w./])((?:\.\./)+[\w.\-/]+)", text):
        if not text[:m.start()].endswith("]("):
            yield m.group(1), (doc.parent / m.group(1)).resolve()
            yield m.group(1), (ROOT / m.group(1)).resolve()


def test_no_doc_points_outside_the_repository_and_every_link_resolves():
    problems = []
    for doc in [README, *DOCS]:
        for what, path in _targets(doc):
            if ROOT not in path.parents and path != ROOT:
                problems.append(f"{doc.relative_to(ROOT)}: {what} is outside the repository")
            elif what.startswith("]") and not path.exists():
                problems.append(f"{doc.relative_to(ROOT)}: {what} does not exist")
    assert not problems, "\n".join(problems)
