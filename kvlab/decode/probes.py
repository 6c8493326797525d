"""Probes: named signal sources a refresh policy may ask the loop to run (``policy.probe``), registered in
:data:`PROBES`. At a due step the loop calls ``PROBES[policy.probe](ctx)`` with a :class:`ProbeContext` and puts the
returned :class:`ProbeResult`'s ``signals`` on the step's record before asking the policy. Probes must not edit the
decoding cache; a probe that needs the teacher calls ``ctx.teacher_logits(n)``, which extends the teacher's own
cache incrementally (the loop counts those tokens once). Built in: ``teacher_kl``; :mod:`kvlab.uncertainty.mc`
registers ``mc_dropout``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
