"""Teacher-forced refresh study: does a teacher-written cache help the student, tokens held fixed?
Its runs go through the run store; the tables are returned to the caller (``python -m kvlab refresh``) that writes
them.

Free-running comparisons mix two effects: a refresh changes the cache, and then the student's
sampled path diverges. Here the tokens are fixed — the teacher's greedy continuation ``y`` of the
prompt ``x`` — and only who wrote the cache over ``x, y_<m`` changes:

* ``student``   — the student prefilled everything (no OverFill);
* ``overfill``  — the teacher prefilled ``x`` (``C_0``), the student wrote ``y_<m``;
* ``window``    — OverFill, then the last ``W`` entries spliced from the teacher's cache
  (``KVCache.splice_last``: a sliding-window refresh at step ``m - 1``);
* ``refreshed`` — the teacher wrote ``x, y_<m`` (a refresh with ``W = ∞`` at step ``m - 1``).

The student then reads ``y_{m-1}, …, y_{N-2}`` on each cache, teacher-forced, and we measure the
mean ``KL(p_T || q_S)`` over the next tokens ``y_m … y_{N-1}`` against the teacher's own
distributions (one uncached teacher forward).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from kvlab.cache import KVCache
from kvlab.decode import run
from kvlab.core.metrics import kl_rows, mde, teacher_logprobs
from kvlab.store import RunStore

CONDITIONS = ("student", "overfill", "window", "refreshed")
FORCED_NOTE = ("`kl`: mean KL(p_T‖q_S) in nats over the teacher-forced tokens y_split … y_{N-1}; every one is a "
               "student prediction (tokens fixed to the teacher's greedy continuation, only the cache's writer differs). "
               "`d_mde`: the smallest paired difference detectable at this n (2.8 × SD / √n; 80 % power, α = 0.05).")


def _check(tokens: int, split: int, window: int) -> None:
    if not isinstance(tokens, int) or tokens < 4:
        raise ValueError(f"tokens={tokens!r} must be an int >= 4")
    if not isinstance(split, int) or not 2 <= split < tokens:
        raise ValueError(f"split={split!r} must be an int in [2, tokens)")
    if not isinstance(window, int) or not 1 <= window < split:
        raise ValueError(f"window={window!r} must be an int in [1, split)")


def condition_caches(teacher, student, context: list[int], n_prompt: int, window: int) -> dict[str, KVCache]:
    """The four caches over ``context`` (prompt + forced tokens) described in the module docstring."""
    t_full, _ = KVCache.prefill(teacher.model, context, writer="teacher")
    s_full, _ = KVCache.prefill(student.model, context, writer="student")
    over, _ = KVCache.prefill(teacher.model, context[:n_prompt], writer="teacher")
    over.forward(student.model, context[n_prompt:], writer="student")
    win = over.copy()
    win.splice_last(t_full, window)
    return {"student": s_full, "overfill": over, "window": win, "refreshed": t_full}


@torch.inference_mode()
def forced_kl(teacher, student, prompt: str, *, tokens: int = 96, split: int = 48, window: int = 8) -> dict:
    """Mean per-token ``KL(p_T || q_S)`` over ``y_split … y_{tokens-1}`` for each cache condition."""
    _check(tokens, split, window)
    y = run(teacher, None, prompt, mode="teacher", max_new_tokens=tokens).tokens       # greedy, fixed N
    x = teacher.encode_prompt(prompt)
    t_logp = teacher_logprobs(teacher, x, y)[split:]                                  # (N - m, V)
    caches = condition_caches(teacher, student, x + y[:split - 1], len(x), window)
    out = {}
    for name, cache in caches.items():
        q = cache.forward(student.model, y[split - 1:tokens - 1], writer="student", logits="all")  # (N - m, V)
        out[name] = float(kl_rows(t_logp, torch.log_softmax(q.float(), -1).cpu()).mean())
    return out


def forced_table(teacher, student, prompts, store: RunStore, *, tokens: int = 96, split: int = 48,
                 window: int = 8, n_boot: int = 2000, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, per-prompt rows): mean ± std KL per condition and the paired change against
    ``overfill`` with a bootstrap 95 % interval over prompts."""
    _check(tokens, split, window)
    rows = []
    for i, prompt in enumerate(prompts):
        cfg = {"kind": "forced_kl", "teacher": teacher.fingerprint, "student": student.fingerprint,
               "prompt": prompt, "tokens": tokens, "split": split, "window": window}
        res = store.get_or_run(cfg, lambda p=prompt: forced_kl(teacher, student, p, tokens=tokens, split=split,
                                                               window=window))
        rows.append({"prompt_idx": i, **res})
    per = pd.DataFrame(rows)
    rng = np.random.default_rng(seed)
    table = []
    for c in CONDITIONS:
        d = (per[c] - per["overfill"]).to_numpy()
        boots = rng.choice(d, size=(n_boot, len(d)), replace=True).mean(1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        table.append({"condition": c, "kl": per[c].mean(), "kl_std": per[c].std(ddof=1) if len(per) > 1 else 0.0,
                      "d_kl_vs_overfill": d.mean(), "d_lo": lo, "d_hi": hi,
                      "d_mde": float("nan") if c == "overfill" else mde(d), "n_prompts": len(per),
                      "tokens": tokens, "split": split, "window": window})
    return pd.DataFrame(table), per
