"""Routes as data: which kernels a call launches, with which tile, and why.

A route is decided once, by a pure function of the problem and the device (``route(M, N, K, *,
capability, sm_count, ...)`` in every format module of ``kernels_triton`` and
``kernels_triton.hopper``), and the launcher executes exactly that route: there is no second place
that decides. ``dispatch.explain`` prints the same object, so what it reports is what runs.

``record_launches()`` lists the kernels a block of code actually launched (every launch site goes
through :func:`launched`), so tests can check a route against the launches it caused.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass(frozen=True)
class Route:
    """The kernels one call launches, in order, and why.

    impl: the implementation ("triton", "hopper").
    kernels: the ``@triton.jit`` function names launched, in launch order (e.g.
        ("_quantize_kernel", "_gemm_kernel")); a kernel launched twice appears twice.
    tile: the GEMM tile as text (``TileConfig.__str__``: "BMxBNxBK wW sS [splitkN]"), or "" when the
        route launches no GEMM with a tile of its own.
    split_k: the split-K factor launched (1: none; > 1: a partial-sum workspace and a reduce kernel).
    why: one sentence saying why this route (the rule and the values that decided it).
    """

    impl: str
    kernels: tuple[str, ...]
    tile: str = ""
    split_k: int = 1
    why: str = ""
    options: tuple[tuple[str, object], ...] = field(default=())

    def describe(self) -> str:
        """One line: kernels, tile, split-K and why."""
        tile = f" tile {self.tile}" if self.tile else ""
        split = f" SPLIT_K={self.split_k}" if self.split_k > 1 and "splitk" not in self.tile else ""
        return f"{self.impl}: {' -> '.join(self.kernels)}{tile}{split}: {self.why}"


_state = threading.local()


def launched(name: str) -> None:
    """Record that kernel ``name`` was launched (a no-op unless record_launches() is active)."""
    log: Optional[list] = getattr(_state, "log", None)
    if log is not None:
        log.append(name)


@contextlib.contextmanager
def record_launches() -> Iterator[list[str]]:
    """Collect the names of the kernels launched inside the block (this thread), in order."""
    prev = getattr(_state, "log", None)
    log: list[str] = []
    _state.log = log
    try:
        yield log
    finally:
        _state.log = prev


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded under the kernel's function name."""
    launched(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)))
    return kernel[grid](*args, **kwargs)
