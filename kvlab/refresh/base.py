"""Refresh machinery shared by the decode loop and the policies (seed 000, "KV Cache Refresh").
Policies decide only; probes may advance the teacher's own cache, never the decoding cache; splices are the loop's,
through the cache module.

A refresh policy is a small frozen object with one decision method::

    should_refresh(record: StepRecord) -> bool

and three optional attributes the loop reads (with these defaults):

* ``window: int | None = None`` — W, the most entries one refresh rewrites (None = ∞);
* ``probe: str | None = None`` — the name of a signal source in :data:`PROBES`;
* ``probe_every: int = 1`` — probe at steps ``t`` with ``t % probe_every == 0``.

At a due step the loop calls ``PROBES[policy.probe](ctx)`` with a :class:`ProbeContext` and puts the
returned :class:`ProbeResult`'s ``signals`` on the step's record (``record.signals``) *before*
asking the policy, so a policy reads its probe as ``record.signals.get(name)``. The loop never
looks at a policy's type. Probes must not edit the decoding cache; a probe that needs the teacher
calls ``ctx.teacher_logits(n)``, which extends the teacher's own cache incrementally (the loop
counts those teacher tokens and time; a later refresh reuses them, so they are counted once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from kvlab.core.metrics import kl_rows


@dataclass(frozen=True, eq=False)
class ProbeContext:
    """What a probe may look at when it runs, at step ``step`` right after ``y_step`` was chosen."""

    teacher: Any                 # LM
    student: Any                 # LM
    cache: Any                   # the decoding (student) KVCache, holds x, y_<step  — read only
    teacher_cache: Any           # the teacher's own KVCache (holds x, y_≤s for its sync point s)
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]      # y_1 .. y_step
    logits: torch.Tensor         # (V,) logits y_step was drawn from (the step's q)
    step: int
    config: Any                  # DecodeConfig
    teacher_logits: Callable[[int], torch.Tensor] = field(repr=False, default=None)
    # teacher_logits(n) -> (V,) logits of p_T(· | x, y_≤n), n < step, extending the teacher cache


@dataclass(frozen=True)
class ProbeResult:
    """Signals for the policy (``record.signals``) and what the probe cost.

    ``cost`` keys are free-form counters (e.g. ``{"teacher_tokens": 3}``,
    ``{"student_passes": 8}``); they are summed per run into ``probe_<key>`` columns.
    """

    signals: Mapping[str, float]
    cost: Mapping[str, float] = field(default_factory=dict)


PROBES: dict[str, Callable[[ProbeContext], ProbeResult]] = {}


def register_probe(name: str):
    """Decorator: ``PROBES[name] = fn`` for ``fn(ctx: ProbeContext) -> ProbeResult``."""
    def deco(fn):
        PROBES[name] = fn
        return fn
    return deco


LN2 = math.log(2.0)


@register_probe("teacher_kl")
def teacher_kl_probe(ctx: ProbeContext) -> ProbeResult:
    """``KL(p_T || p_S)`` at the current step (nats; ``kl_bits`` too).

    ``p_T(· | x, y_<t)`` comes from the teacher's cache caught up to ``y_{t-1}`` (only the tokens
    it has not seen are prefilled); ``p_S`` is the distribution ``y_t`` was drawn from.
    """
    before = len(ctx.teacher_cache)
    t_logits = ctx.teacher_logits(ctx.step - 1)                                   # (V,)
    p_logp = torch.log_softmax(t_logits.float(), -1)
    q_logp = torch.log_softmax(ctx.logits.float().to(p_logp.device), -1)
    kl = float(kl_rows(p_logp[None], q_logp[None])[0])
    return ProbeResult(signals={"kl": kl, "kl_bits": kl / LN2},
                       cost={"teacher_tokens": len(ctx.teacher_cache) - before})


def policy_dict(policy) -> dict | None:
    """A policy as JSON-able config (class name + fields) for run keys and tables.

    A class defined outside kvlab (your own policy, e.g. in a notebook cell) also gets ``code``: a digest
    of its methods' bytecode (:func:`code_digest`), so editing the class and re-running the cell keys new
    runs instead of answering from runs the old code stored.

    A field holding an object with behaviour of its own (an instance of a class or a function, e.g. the
    scorer of :class:`kvlab.eviction.scorer.ScorerPolicy`) is written as its own ``policy_dict`` (class
    name, fields, ``code`` when defined outside kvlab); a function as ``{"function": qualname, "code": …}``.
    Policies without such fields get the same dict as before."""
    if policy is None:
        return None
    from dataclasses import asdict, fields as dc_fields, is_dataclass

    if is_dataclass(policy):
        out = {"policy": type(policy).__name__, **asdict(policy)}
        for f in dc_fields(policy):
            v = getattr(policy, f.name)
            if getattr(v, "__code__", None) is not None:
                out[f.name] = {"function": getattr(v, "__qualname__", repr(v)), "code": _fn_digest(v.__code__)}
            elif hasattr(v, "__dict__") and not isinstance(v, type):      # an object: a dataclass or a plain class
                out[f.name] = policy_dict(v)
    else:
        out = {"policy": type(policy).__name__, **dict(vars(policy))}
    if not type(policy).__module__.startswith("kvlab."):
        out["code"] = code_digest(type(policy))
    return out


def _code_parts(c) -> list:
    """Bytecode, constants (nested code included) and names of one code object; no file names or lines."""
    def const(k):
        if hasattr(k, "co_code"):
            return _code_parts(k)
        return sorted(map(repr, k)) if isinstance(k, frozenset) else repr(k)   # set order varies with the hash seed

    return [c.co_code.hex(), [const(k) for k in c.co_consts], list(c.co_names)]


def _fn_digest(c) -> str:
    import hashlib

    return hashlib.sha256(repr(_code_parts(c)).encode()).hexdigest()[:12]


def code_digest(cls) -> str:
    """12 hex digits naming what a class's methods do: bytecode, constants and names of every function,
    property and static/class method defined in its body (nested code included; file names and line
    numbers excluded, so re-running an unchanged notebook cell gives the same digest)."""
    import hashlib

    parts = []
    for name, v in sorted(vars(cls).items()):
        for fn in (getattr(v, "__func__", None), getattr(v, "fget", None), v):
            c = getattr(fn, "__code__", None)
            if c is not None:
                parts.append([name, _code_parts(c)])
                break
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def validate_policy(policy) -> None:
    """The protocol checks the loop relies on (ValueError naming the attribute)."""
    if not callable(getattr(policy, "should_refresh", None)):
        raise ValueError(f"refresh={policy!r} needs a should_refresh(record) -> bool method")
    w = getattr(policy, "window", None)
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
        raise ValueError(f"refresh.window={w!r} must be a positive int or None (= no window)")
    probe = getattr(policy, "probe", None)
    if probe is not None:
        if probe not in PROBES:
            raise ValueError(f"refresh.probe={probe!r} is not a registered probe; known: {sorted(PROBES)} "
                             "(import the module that registers it)")
        every = getattr(policy, "probe_every", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"refresh.probe_every={every!r} must be a positive int")


# --------------------------------------------------------------------------- calibration


def _check_pct(percentile: float) -> None:
    if not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise ValueError(f"percentile={percentile!r} must be in (0, 100)")


def tau_from_percentile(values: Sequence[float], percentile: float = 95.0) -> float:
    """Threshold at a percentile of a signal (student entropy in bits, or probe KL) on calibration runs."""
    _check_pct(percentile)
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise ValueError("values is empty: run calibration prompts first")
    return float(np.percentile(v, percentile))


def tau_for_budget(values: Sequence[float], per_1k: float = 2.5, probe_every: int = 1) -> float:
    """Threshold so that ~``per_1k`` refreshes fire per 1000 tokens on the calibration signal.

    With a probe every ``M`` tokens only ``1000 / M`` values are seen per 1k tokens, so the
    fraction above threshold is ``per_1k * M / 1000``. (Refreshes change later signals, so this
    is the open-loop budget; the measured rate is in the tables.)
    """
    if not isinstance(per_1k, (int, float)) or not per_1k > 0:
        raise ValueError(f"per_1k={per_1k!r} must be > 0 (refreshes per 1000 tokens)")
    frac = per_1k * probe_every / 1000.0
    if frac >= 1:
        raise ValueError(f"per_1k={per_1k} with probe_every={probe_every} asks every probe to fire")
    return tau_from_percentile(values, 100.0 * (1.0 - frac))


# --------------------------------------------------------------------------- cost accounting


def run_costs(records) -> dict:
    """Per-run refresh cost from a trace's records.

    ``teacher_tokens`` = Σ|Δ_r| (refresh prefills) + probe tokens; ``teacher_s`` the teacher's
    compute time; ``teacher_pct`` = teacher time / the rest of the run's time (in-run overhead).
    """
    recs = list(records)
    out = {
        "refreshes": sum(1 for r in recs if r.refreshed),
        "teacher_tokens": sum(r.teacher_tokens for r in recs),
        "probe_tokens": sum(r.probe_tokens for r in recs),
        "delta_tokens": sum(r.teacher_tokens - r.probe_tokens for r in recs),
        "spliced": sum(r.spliced for r in recs),
        "teacher_s": sum(r.teacher_s for r in recs),
        "probes": sum(1 for r in recs if r.probed),
    }
    extra: dict[str, float] = {}
    for r in recs:
        for k, v in r.probe_cost:
            extra[f"probe_{k}"] = extra.get(f"probe_{k}", 0.0) + float(v)
    out.update(extra)
    total = recs[-1].elapsed_s if recs else 0.0
    rest = total - out["teacher_s"]
    out["teacher_pct"] = 100.0 * out["teacher_s"] / rest if rest > 0 else float("nan")
    return out


def provenance(decoding, every: int = 1):
    """Step a :class:`~kvlab.decode.Decoding` to the end, snapshotting which model wrote each slot.

    Returns ``(records, matrix)``: ``matrix[i, s]`` is 1 if slot ``s`` held a teacher-written entry
    after the ``i``-th snapshot (every ``every`` steps), 0 student, -1 empty.
    """
    records, rows = [], []
    for rec in decoding:
        records.append(rec)
        if rec.step % every == 0:
            rows.append([1 if w == "teacher" else 0 for w in decoding.cache.writers])
    width = max((len(r) for r in rows), default=0)
    mat = np.full((len(rows), width), -1, dtype=np.int8)
    for i, r in enumerate(rows):
        mat[i, :len(r)] = r
    return records, mat
