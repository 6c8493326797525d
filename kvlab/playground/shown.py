"""What the playground shows, as plain values: the readouts of a stored run (:data:`READOUTS`,
:func:`readouts`, :func:`fmt`), one shown configuration (:class:`Shown`, :func:`describe`) and the events
a live run streams (:class:`LivePoint`, :class:`Progress`).

Every readout is set beside the *baseline*: the same prompt, mode, student, N, sampling and seed with no
refresh and the full cache (:meth:`Settings.baseline`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.playground.settings import EVICT_PARAMS, POLICY_PARAMS, Settings

# (name, label, format) of every readout, in display order. "g3": three significant digits (one run is
# one sample: more digits would claim a precision it does not have). No readout compares times of two
# separately timed runs: the teacher's time share is measured inside the run itself, and "time vs baseline"
# is timed back to back on demand (Playground.time_vs_baseline).
READOUTS = (("teacher_ppl", "teacher-PPL", "g3"), ("kl", "KL(p_T‖q), nats", "g3"), ("repeat3", "repeat@3", "g3"),
            ("refreshes", "refreshes", "g3"), ("teacher_tokens_pct", "teacher tokens, % of generated", "g3"),
            ("teacher_time_pct", "teacher time, % of student time (in-run)", "g3"),
            ("cache_kib", "cache KiB (mean per step)", "g3"))


def readouts(result: dict, base: dict, mode: str) -> dict:
    """The readout values of a stored run ``result`` (``base``, its baseline, is accepted for the
    callers' symmetry; no readout mixes the two runs' timings).

    ``teacher_tokens_pct``: tokens the teacher processed while decoding (refresh prefills + probes; every
    token in teacher mode) per generated token. ``teacher_time_pct``: the teacher's compute time in this
    run as a % of the rest of this run's time (:func:`kvlab.harness.costs.run_costs` ``teacher_pct``; measured
    inside one run, so no cross-run timing noise; undefined in teacher mode). ``tps``: this run's decode
    speed (shown, never compared with the baseline's separately timed run).
    """
    n = result["tokens"]
    tt = 100.0 if mode == "teacher" else 100.0 * result.get("teacher_tokens", 0) / max(n, 1)
    share = float("nan") if mode == "teacher" else float(result.get("teacher_pct", float("nan")))
    return {"teacher_ppl": result["teacher_ppl"], "kl": result["kl"], "repeat3": result["repeat3"],
            "refreshes": int(result.get("refreshes", 0)), "teacher_tokens_pct": tt, "teacher_time_pct": share,
            "tps": result["tps"], "cache_kib": _mean_kib(result)}


def _mean_kib(result: dict) -> float:
    b = result.get("steps", {}).get("cache_bytes")
    return sum(b) / len(b) / 1024 if b else float("nan")


def fmt(value, spec: str) -> str:
    """``format(value, spec)``; ``"g<n>"``: n significant digits, plain notation in 1e-4 .. 1e7."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    sign = spec.startswith("+")
    spec = spec.lstrip("+")
    if spec.startswith("g") and spec[1:].isdigit():
        if isinstance(value, int) and not isinstance(value, bool):
            return format(value, "+d" if sign else "d")     # counts are exact
        n, v = int(spec[1:]), float(value)
        if v == 0:
            return "0"
        if not 1e-4 <= abs(v) < 1e7:
            return format(v, f"{'+' if sign else ''}.{n - 1}e")
        digits = max(0, n - 1 - math.floor(math.log10(abs(v))))
        r = round(v, digits)
        if r == 0:
            return "0"
        digits = max(0, n - 1 - math.floor(math.log10(abs(r))))
        return format(r, f"{'+' if sign else ''}.{digits}f")
    return format(value, ("+" if sign else "") + spec)


@dataclass(frozen=True)
class Shown:
    """What the view displays for one good configuration (a stored run and its stored baseline)."""

    settings: Settings
    key: str                  # run-store key of the run (runs/<key>.json)
    base_key: str
    result: dict              # the stored result (kvlab.harness.experiment.scored_run)
    base: dict
    readouts: dict
    base_readouts: dict
    tokens: list              # text of each generated token
    base_tokens: list
    prompt_len: int           # cache entries of the prompt (generated token t sits at position prompt_len + t - 1)
    source: str               # "disk" (answered from the store) | "live" (decoded now)
    seconds: float            # from the request to this result (for "disk": lookup + readouts)
    reasons: tuple = ()       # (step, why) of every refresh: the policy's own words (kvlab.playground.why)
    note: str | None = None   # "same tokens as the baseline, so the same PPL" when that is the case

    @property
    def label(self) -> str:
        """A short name of this configuration (legends, pins, exports)."""
        return describe(self.settings)


def describe(s: Settings) -> str:
    """Short label: mode, refresh policy with its parameters, eviction with its budget, student, seed."""
    parts = [s.mode]
    if s.policy != "none":
        parts.append(s.policy + "(" + ",".join(f"{k}={getattr(s, k)}" for k in POLICY_PARAMS[s.policy]
                                               if not (k == "W" and not s.W)) + ")")
    if s.evict != "full":
        parts.append(f"{s.evict}@{s.budget}" + "".join(f",{k}={getattr(s, k)}" for k in EVICT_PARAMS.get(s.evict, ())))
    if s.mode != "teacher":
        parts.append(f"pruned {s.prune_ratio}" if s.student == "pruned" else f"student {s.student}")
    parts.append(f"seed {s.seed}")
    return " · ".join(parts)


@dataclass(frozen=True)
class LivePoint:
    """One decoded step of a live run, streamed while it decodes."""

    stage: str                # "baseline" | "run" | "precompute"
    step: int
    total: int
    token: str
    entropy_bits: float
    refreshed: bool
    source: str
    cache_len: int
    tps: float                # streamed tokens/s so far (decode steps after the first)
    positions: tuple = ()     # the decoding cache now: position and writer of every slot
    writers: tuple = ()


@dataclass(frozen=True)
class Progress:
    stage: str                # "calibration" | "student" | "baseline" | "run" | "precompute"
    done: int
    total: int
    message: str = ""


__all__ = ["LivePoint", "Progress", "READOUTS", "Shown", "describe", "fmt", "readouts"]
