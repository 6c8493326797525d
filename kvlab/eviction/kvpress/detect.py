"""Whether an object is a kvpress press, without importing kvpress (kvlab imports it only when a press is used)."""
from __future__ import annotations


def is_press(obj) -> bool:
    """``obj`` is an instance of a class defined in the kvpress package, or of a subclass of one (a press
    you derived from ``kvpress.ScorerPress`` in a notebook counts)."""
    if isinstance(obj, type):
        return False
    return any((getattr(c, "__module__", "") or "").split(".")[0] == "kvpress" for c in type(obj).__mro__)


def press_name(press) -> str:
    """How messages name a press: its class name."""
    return type(press).__name__
