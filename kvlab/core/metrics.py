"""Scoring a generation (seed 000, "Scoring" and "Variational lens").
Functions of logits and tokens (plus one teacher forward); nothing is written.

Teacher-PPL alone rewards repetition loops (a looping student can score a *lower* PPL than the
teacher), so every table reports the mean per-step ``KL(p_T || q)`` — the blog's "mismatch"
term — and repeat@3 beside it.

Which steps the KL averages over: ``kl`` is the mean over the steps whose token the
*student* chose (records with ``source == "student"``). Steps picked from teacher logits — OverFill's
first token (the teacher's prefill), the token after a refresh with ``refresh_next="teacher"`` —
have ``q = p_T`` and KL ≈ 0 by construction; averaging them in would lower KL mechanically, not
because the student got better. ``kl_all`` is the mean over every step (the blog's formula with
``q_t`` whatever the token was drawn from). A run without student-chosen steps (``mode="teacher"``)
has ``kl = kl_all`` ≈ 0: every ``q_t`` is ``p_T``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

TAIL = 50  # tail log-prob: last 50 tokens under the teacher

# One line per KL column, for table captions (kvlab.harness.experiment.write_table notes).
KL_NOTE = ("`kl`: mean KL(p_T‖q) in nats over the steps whose token the student chose (teacher-chosen steps — "
           "OverFill's first token, tokens drawn from teacher logits after a refresh — excluded; "
           "teacher mode: all steps, ≈ 0 since q = p_T).")
KL_ALL_NOTE = "`kl_all`: the same mean over every step, teacher-chosen ones included (KL ≈ 0 there)."


def kl_rows(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """Row-wise ``KL(p || q)`` in nats for log-probabilities ``(N, V)`` → ``(N,)``."""
    p_logp, q_logp = p_logp.float(), q_logp.float()
    p = p_logp.exp()
    # p * (log p - log q), with 0 * anything = 0 where p == 0
    return torch.where(p > 0, p * (p_logp - q_logp), torch.zeros_like(p)).sum(-1)


def repeat_at_n(tokens: Sequence[int], n: int = 3) -> float:
    """Fraction of the sequence's n-grams that repeat an earlier n-gram: ``1 - unique/total``."""
    if n <= 0:
        raise ValueError(f"n={n!r} must be positive")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


@torch.inference_mode()
def teacher_logprobs(teacher, prompt_ids: Sequence[int], gen_ids: Sequence[int]) -> torch.Tensor:
    """Teacher log-distributions for every generated position: one uncached forward over
    ``prompt + continuation``. Returns ``(N, V)`` float32 on CPU; row ``t`` is ``log p_T(· | x, y_<t)``."""
    n = len(gen_ids)
    if n == 0:
        raise ValueError("gen_ids is empty: nothing to score")
    ids = torch.tensor([list(prompt_ids) + list(gen_ids)], device=teacher.device)  # (1, L+N)
    out = teacher.model(input_ids=ids, use_cache=False, logits_to_keep=n + 1)
    logits = out.logits[0, :-1].float()                                          # (N, V)
    return torch.log_softmax(logits, dim=-1).cpu()


def student_steps(records) -> list[bool]:
    """Per step: was the token chosen by the student (``record.source == "student"``)?"""
    return [getattr(r, "source", None) == "student" for r in records]


def score(trace, teacher) -> dict:
    """All per-run numbers of the blog's tables for one :class:`kvlab.decode.Trace`.

    Needs the trace's ``model_logprobs`` (run with ``keep_dists=True``) for the KL terms: ``kl``
    over student-chosen steps, ``kl_all`` over all steps (see the module docstring),
    ``kl_student_steps`` how many steps ``kl`` averages, ``kl_steps`` the per-step values.
    """
    toks = trace.tokens
    n = len(toks)
    t_logp = teacher_logprobs(teacher, trace.prompt_ids, toks)                  # (N, V)
    chosen = t_logp[torch.arange(n), torch.tensor(toks)]                        # (N,)
    out = {
        "tokens": n,
        "teacher_ppl": math.exp(-float(chosen.mean())),
        "tail_logprob": float(chosen[-TAIL:].mean()),
        "repeat3": repeat_at_n(toks, 3),
        "chars": len(trace.text),
        "ttft_s": trace.ttft_s,
        "total_s": trace.total_s,
        "tps": (n - 1) / (trace.total_s - trace.ttft_s) if n > 1 and trace.total_s > trace.ttft_s else float("nan"),
        "e2e_tps": n / trace.total_s if trace.total_s > 0 else float("nan"),
    }
    q_logp = trace.model_logprobs
    mine = torch.tensor(student_steps(trace.records), dtype=torch.bool)            # (N,)
    out["kl_student_steps"] = int(mine.sum())
    if q_logp is not None:
        kl = kl_rows(t_logp, q_logp)                                                # (N,)
        if getattr(trace.config, "evict", None) is None:
            # without eviction a teacher-chosen step's q *is* p_T (cached vs uncached forward of the same model
            # over the same tokens): its KL is 0 by construction, stored as 0 rather than the ±1e-8 that another
            # reduction order gives. With eviction the teacher's cache lost entries, so its KL is real.
            exact = torch.tensor([r.source == "teacher" for r in trace.records], dtype=torch.bool)   # (N,)
            kl = torch.where(exact, torch.zeros_like(kl), kl)
        out["kl_all"] = float(kl.mean())
        out["kl"] = float(kl[mine].mean()) if bool(mine.any()) else out["kl_all"]
        out["kl_steps"] = kl.tolist()
    else:
        out["kl"] = out["kl_all"] = float("nan")
    out["teacher_logprobs"] = chosen.tolist()
    return out


# --------------------------------------------------------------------------- power: the smallest paired difference a table can detect

MDE_FACTOR = 2.8   # z_{1-α/2} + z_{power} = 1.96 + 0.84: 80 % power at two-sided α = 0.05
MDE_NOTE = ("`*_mde`: the smallest paired mean difference detectable at this n with 80 % power at α = 0.05, "
            "MDE = 2.8 × SD(per-prompt differences) / √n; an interval that crosses 0 with |Δ| < MDE is "
            "\"no detectable difference at n\", not evidence of no effect.")


def mde(diffs) -> float:
    """Minimum detectable paired mean difference: ``2.8 · SD(diffs) / √n`` (80 % power, two-sided α = 0.05,
    normal approximation); NaN below 2 pairs."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    d = d[~np.isnan(d)]
    return float("nan") if len(d) < 2 else float(MDE_FACTOR * d.std(ddof=1) / math.sqrt(len(d)))


def add_mde(paired, per_run, base: str, metrics) -> "object":
    """``paired`` (one row per ``policy``, from a paired bootstrap against ``base``) with a
    ``d_<m>_mde`` column per metric, from the per-prompt differences in ``per_run``."""
    b = per_run[per_run.policy == base].set_index("prompt_idx")
    out = paired.copy()
    for m in metrics:
        vals = []
        for name in out.policy:
            g = per_run[per_run.policy == name].set_index("prompt_idx")
            idx = b.index.intersection(g.index)
            vals.append(float("nan") if name == base else mde((g.loc[idx, m] - b.loc[idx, m]).to_numpy()))
        out[f"d_{m}_mde"] = vals
    return out


def verdict(d: float, lo: float, hi: float, mde_: float, n: int, lower_is_better: bool = True) -> str:
    """One phrase for a paired difference: which side the interval lies on, or "no detectable
    difference at n = N (MDE x)" when it crosses 0."""
    if any(v != v for v in (lo, hi)):
        return f"n too small for an interval (n = {n})"
    if lo > 0 or hi < 0:
        better = (hi < 0) == lower_is_better
        return f"{'lower' if hi < 0 else 'higher'} ({'better' if better else 'worse'}): Δ {d:+.3f} [{lo:+.3f}, {hi:+.3f}], n = {n}"
    return f"no detectable difference at n = {n} (Δ {d:+.3f} [{lo:+.3f}, {hi:+.3f}]; MDE {mde_:.3f})"
