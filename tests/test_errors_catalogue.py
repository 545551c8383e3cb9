"""docs/errors.md: every row names a test that exists (file and function), and there are >= 60 rows."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|\s*(\d+)\s*\|.*\|\s*`(?P<test>tests/[^`]+)`\s*\|\s*$")


def _rows() -> list[tuple[int, str]]:
    rows = []
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows.append((int(m.group(1)), m.group("test")))
    return rows


@lru_cache(maxsize=None)
def _test_functions(path: str) -> frozenset:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))


def test_catalogue_has_at_least_60_numbered_rows():
    numbers = [n for n, _ in _rows()]
    assert len(numbers) >= 60
    assert numbers == list(range(1, len(numbers) + 1)), "rows must be numbered 1, 2, ... without gaps"


def test_every_row_names_an_existing_test():
    missing = []
    for n, test in _rows():
        path, _, name = test.partition("::")
        name = name.split("[", 1)[0]  # a parametrization id may follow the function name
        if not (ROOT / path).is_file() or name not in _test_functions(path):
            missing.append(f"row {n}: {test}")
    assert not missing, "docs/errors.md names tests that do not exist:\n" + "\n".join(missing)
