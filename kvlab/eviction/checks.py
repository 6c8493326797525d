"""The eviction policies' argument checks, in one place: each raises ValueError naming the parameter
and the fix. :mod:`kvlab.eviction.base` re-exports them (``from kvlab.eviction.base import positive_int``
keeps working); a policy calls them from its ``__post_init__``.
"""
from __future__ import annotations

import math


def positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int (entries)")


def nonneg_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}={v!r} must be an int >= 0")


def unit_float(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name}={v!r} must be a number in [0, 1]")


def finite_float(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name}={v!r} must be True or False")


def protected_below(protect_name: str, protect: int, budget_name: str, budget: int) -> None:
    if protect >= budget:
        raise ValueError(f"{protect_name}={protect} must be < {budget_name}={budget}: the protected recent "
                         f"window has to leave room in the budget (lower {protect_name} or raise {budget_name})")


def check_sinks(sinks, protect_name: str, protect: int, budget_name: str, budget: int) -> None:
    """``sinks`` is an int >= 0 and sinks + the protected window leave a ranked slot in the budget."""
    nonneg_int("sinks", sinks)
    if sinks + protect >= budget:
        raise ValueError(f"sinks={sinks} + {protect_name}={protect} must be < {budget_name}={budget}: sinks and the "
                         f"protected window have to leave room in the budget (lower sinks or raise {budget_name})")


def check_recent_budget(budget, recent, per_layer, sinks) -> None:
    """A heavy-hitter policy's parameters (H2O, Scissorhands): ``budget`` entries, the newest ``recent``
    protected, ``per_layer`` a bool, ``sinks`` attention sinks; checked in that order."""
    positive_int("budget", budget)
    nonneg_int("recent", recent)
    protected_below("recent", recent, "budget", budget)
    check_bool("per_layer", per_layer)
    check_sinks(sinks, "recent", recent, "budget", budget)


def check_observation_window(budget: int, window: int, kernel: int) -> None:
    """SnapKV-style prompt compression's parameters (SnapKV, PyramidKV): ValueError naming the parameter."""
    positive_int("budget", budget)
    positive_int("window", window)
    protected_below("window", window, "budget", budget)
    positive_int("kernel", kernel)
    if kernel % 2 == 0:
        raise ValueError(f"kernel={kernel} must be odd (a centred pool keeps the length)")
