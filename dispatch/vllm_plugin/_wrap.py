"""How the plugin patches vLLM: once.

Every patch of a vLLM class or module (a method wrapped so that the plugin's selection or checks run
around vLLM's own) must apply once however often its trigger fires (each model load, each worker
process, each import hook). The wrapper carries ``__b12x_dual_original__``, the function it
replaced: a second call sees it and leaves the attribute alone, and the original stays reachable.
"""

from __future__ import annotations


def wrap_once(owner, attr: str, make, *, static: bool = False) -> bool:
    """Replace ``owner.<attr>`` (a class's method or a module's function) with ``make(original)``,
    marked ``__b12x_dual_original__ = original`` and given the original's name and docstring
    (``static``: set as a staticmethod, for a staticmethod of a class), unless the attribute already
    carries that mark. Returns whether it wrapped. Raises AttributeError if ``owner`` has no ``attr``."""
    original = getattr(owner, attr)
    if getattr(original, "__b12x_dual_original__", None) is not None:
        return False
    wrapper = make(original)
    wrapper.__b12x_dual_original__ = original
    wrapper.__doc__, wrapper.__name__ = original.__doc__, original.__name__
    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)
    return True
