"""Shared argument checks for policies (ValueError naming the parameter).
Pure functions; they touch nothing.
"""
from __future__ import annotations

import math


def positive_int(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        extra = " or None (no window)" if allow_none else ""
        raise ValueError(f"{name}={v!r} must be a positive int{extra}")


def nonneg_float(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0:
        raise ValueError(f"{name}={v!r} must be a finite number >= 0")
