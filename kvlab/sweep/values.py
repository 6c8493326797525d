"""Grid-spec values: the spec error type and how a scalar, list or range table expands to values.
Pure functions; they touch nothing.
"""
from __future__ import annotations

import math


class SpecError(ValueError):
    """A grid spec is invalid; the message names the key and the fix."""


def _err(key: str, msg: str) -> SpecError:
    return SpecError(f"grid spec key {key!r}: {msg}")


def _check_keys(table, allowed, where: str) -> None:
    if not isinstance(table, dict):
        raise _err(where, f"must be a table, got {type(table).__name__}")
    for k in table:
        if k not in allowed:
            raise _err(f"{where}.{k}" if where else k, f"unknown key; allowed here: {', '.join(allowed)}")


def expand_values(value, key: str) -> list:
    """A scalar, a list, or a range table ``{start, stop, step}`` (stop inclusive) / ``{start, stop, num}``."""
    if isinstance(value, dict):
        _check_keys(value, ("start", "stop", "step", "num"), key)
        if "start" not in value or "stop" not in value or ("step" in value) == ("num" in value):
            raise _err(key, "a range needs start, stop and exactly one of step or num, "
                            "e.g. {start = 4, stop = 8, step = 1}")
        a, b = value["start"], value["stop"]
        for k in ("start", "stop"):
            if isinstance(value[k], bool) or not isinstance(value[k], (int, float)):
                raise _err(f"{key}.{k}", f"must be a number, got {value[k]!r}")
        if "num" in value:
            n = value["num"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise _err(f"{key}.num", f"must be a positive int, got {n!r}")
            if n == 1:
                return [a]
            vals = [round(a + (b - a) * i / (n - 1), 10) for i in range(n)]
            if isinstance(a, int) and isinstance(b, int) and all(float(v).is_integer() for v in vals):
                return [int(v) for v in vals]      # integer endpoints, integer points: keep ints
            return vals
        s = value["step"]
        if isinstance(s, bool) or not isinstance(s, (int, float)) or s == 0 or not math.isfinite(s) or (b - a) * s < 0:
            raise _err(f"{key}.step", f"step={s!r} must be non-zero and go from start={a} towards stop={b}")
        n = int(math.floor((b - a) / s + 1e-9)) + 1
        if all(isinstance(x, int) for x in (a, b, s)):
            return [a + i * s for i in range(n)]
        return [round(a + i * s, 10) for i in range(n)]
    if isinstance(value, list):
        if not value:
            raise _err(key, "an empty list gives an empty grid; give at least one value")
        out = []
        for i, v in enumerate(value):
            if isinstance(v, (dict, list)):
                raise _err(f"{key}[{i}]", "list items must be scalars")
            out.append(v)
        return out
    return [value]
