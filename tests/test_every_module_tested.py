"""Every module of the packages (formats, kernels_triton, kernels_cute, dispatch) is named by at least one
test file: imported (``import a.b.c``, ``from a.b import c``, ``from a.b.c import x``) or named by its
dotted path in the text (a subprocess, ``python -m``, a path string). A module nothing names has no
test that would fail when it breaks; this test fails instead, naming it. The modules of the mirrored
subpackages (hopper/, vllm_plugin/, apps/) must be named by a test file in the folder of the same path
under tests/.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("formats", "kernels_triton", "kernels_cute", "dispatch")


def _modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(".".join(parts))
    return out


@lru_cache(maxsize=None)
def _named(folder: str = "tests") -> frozenset[str]:
    """Every dotted module name the test files under ``folder`` import or write out."""
    names: set[str] = set()
    texts = []
    for path in (ROOT / folder).rglob("*.py"):
        text = path.read_text()
        texts.append(text)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    blob = "\n".join(texts)
    for mod in _modules():
        if mod in blob or mod.replace(".", "/") + ".py" in blob:  # e.g. a docstring "Modules: formats/_mx.py"
            names.add(mod)
    return frozenset(names)


def test_the_packages_have_modules():
    mods = _modules()
    assert "formats.oracle" in mods and "dispatch.bound" in mods and "kernels_triton.nvfp4" in mods


def test_every_module_is_named_by_a_test_file():
    named = _named()
    missing = [m for m in _modules() if m not in named]
    assert not missing, f"modules no test file imports or names: {missing}"


# Subpackages whose tests sit in a folder of the same path under tests/ (the tests mirror the code).
MIRRORED = ("kernels_triton/hopper", "dispatch/vllm_plugin", "dispatch/apps")


def test_subpackages_are_tested_under_their_mirror_folder():
    """Each module of a mirrored subpackage is named by a test file in tests/<its path>/, so a new
    hopper module, plugin module or application gets its tests beside the others."""
    missing = {}
    for sub in MIRRORED:
        assert (ROOT / "tests" / sub).is_dir(), f"tests/{sub}/ is missing"
        named = _named(f"tests/{sub}")
        prefix = sub.replace("/", ".")
        mods = [m for m in _modules() if m == prefix or m.startswith(prefix + ".")]
        assert mods, sub
        if [m for m in mods if m not in named]:
            missing[f"tests/{sub}"] = [m for m in mods if m not in named]
    assert not missing, f"modules no test file of their mirror folder names: {missing}"


def test_test_file_names_are_unique():
    """pytest imports the test files (folders without __init__.py) by basename, so two files of one
    name in different folders fail collection ("import file mismatch") in whichever process meets the
    second: CI lost a run to tests/formats/test_moe.py beside tests/kernels_triton/test_moe.py."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
