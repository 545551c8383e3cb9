"""The import graph of dispatch/, read from the code (every import, function-local ones included):
no circle, the contract below the registry and the backends, no lower module reaching up into the
facade, plain imports (no importlib) for dispatch -> kernel calls, and b12x loaded only on use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISPATCH = ROOT / "dispatch"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in DISPATCH.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The dispatch modules ``name`` imports (module level or inside a function)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            head = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package itself
            targets = [f"{head}.{a.name}" if f"{head}.{a.name}" in MODULES else head for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _reaches(start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_module_of_dispatch_imports_itself_back():
    circles = [name for name in MODULES if _reaches(name, name)]
    assert circles == []


@pytest.mark.parametrize("lower,upper", [
    ("dispatch.contract", "dispatch.registry"), ("dispatch.contract", "dispatch.backends"),
    ("dispatch.backends", "dispatch.registry"), ("dispatch.registry", "dispatch.bound"),
    ("dispatch.check", "dispatch.api"), ("dispatch.replay", "dispatch.api"),
    ("dispatch.vllm_plugin.ops", "dispatch.api"), ("dispatch.quant_linear", "dispatch.api"),
    ("dispatch.bound", "dispatch.api"), ("dispatch.policy", "dispatch.registry"),
])
def test_a_lower_module_does_not_reach_up(lower, upper):
    assert not _reaches(lower, upper), f"{lower} imports {upper} (directly or through another module)"


def test_registry_and_backends_meet_in_the_contract():
    assert "dispatch.contract" in GRAPH["dispatch.registry"] and "dispatch.contract" in GRAPH["dispatch.backends"]
    assert "dispatch.backends" in GRAPH["dispatch.registry"]


@pytest.mark.parametrize("name", ["dispatch.backends", "dispatch.registry", "dispatch.bound", "dispatch.api",
                                  "dispatch.contract"])
def test_dispatch_reaches_the_kernels_through_plain_imports(name):
    assert "importlib.import_module" not in MODULES[name].read_text()
    assert "importlib.util" not in MODULES[name].read_text()


def test_importing_dispatch_does_not_import_b12x_or_cute_dsl():
    code = ("import sys, dispatch, dispatch.backends, dispatch.bound; dispatch.registry.entries(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('b12x', 'cutlass')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
