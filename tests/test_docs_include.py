"""docs/*.md include code from the real files (tools/docs_include.py): every included block matches
its source, and the tool itself finds stale blocks, missing markers and missing fences."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_include", ROOT / "tools" / "docs_include.py")
docs_include = importlib.util.module_from_spec(_spec)
sys.modules["docs_include"] = docs_include  # dataclasses look their module up there
_spec.loader.exec_module(docs_include)


def test_every_included_block_matches_its_source():
    problems = docs_include.check(ROOT)
    assert not problems, "\n".join(problems)


def test_docs_use_the_mechanism():
    """docs/triton.md includes the native kernels (so the check above has something to check)."""
    blocks = docs_include.blocks(ROOT / "docs" / "triton.md")
    assert {b.name for b in blocks} >= {"native-kernel"}
    assert len(blocks) >= 5


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("a = 0\n# [part]\ndef f():\n    return 1\n# [/part]\nb = 2\n")
    doc = tmp_path / "docs" / "d.md"
    doc.write_text("# Title\n\n<!-- include: pkg/m.py#part -->\n```python\nold\n```\n\ntext\n")
    return tmp_path, doc


def test_write_refreshes_and_check_then_passes(tree):
    root, doc = tree
    assert any("differs" in p for p in docs_include.check(root))
    doc.write_text(docs_include.refresh(doc.read_text(), root))
    assert doc.read_text() == ("# Title\n\n<!-- include: pkg/m.py#part -->\n```python\ndef f():\n    return 1\n"
                               "```\n\ntext\n")
    assert docs_include.check(root) == []


def test_check_fails_when_the_source_changes(tree):
    root, doc = tree
    doc.write_text(docs_include.refresh(doc.read_text(), root))
    (root / "pkg" / "m.py").write_text("# [part]\ndef f():\n    return 2\n# [/part]\n")
    problems = docs_include.check(root)
    assert len(problems) == 1 and "d.md:3" in problems[0] and "differs" in problems[0]


@pytest.mark.parametrize("source,msg", [
    ("def f():\n    return 1\n", "found 0 times"),
    ("# [part]\n# [part]\nx\n# [/part]\n", "found 2 times"),
    ("# [/part]\nx\n# [part]\n", "comes before"),
])
def test_check_fails_on_a_missing_or_broken_marker(tree, source, msg):
    root, _ = tree
    (root / "pkg" / "m.py").write_text(source)
    problems = docs_include.check(root)
    assert len(problems) == 1 and msg in problems[0]
    with pytest.raises(docs_include.IncludeError, match=msg):
        docs_include.refresh((root / "docs" / "d.md").read_text(), root)


def test_missing_file_and_missing_fence(tree):
    root, doc = tree
    doc.write_text("<!-- include: pkg/none.py#part -->\n\n<!-- include: pkg/m.py#part -->\ntext\n")
    problems = docs_include.check(root)
    assert any("no such file" in p for p in problems) and any("no fenced code block" in p for p in problems)
    doc.write_text("<!-- include: pkg/m.py#part -->\ntext\n")
    assert docs_include.refresh(doc.read_text(), root) == (
        "<!-- include: pkg/m.py#part -->\n```python\ndef f():\n    return 1\n```\ntext\n")
