"""Retrieval at 2k–8k tokens under KV-cache eviction: the RULER-style tasks of :mod:`.ruler`, one prefill per
case shared by every policy and both settings, accuracy with Wilson intervals (issue 36, item 5).

**One prefill per case.** The case's context (instruction + haystack) is prefilled ONCE, in chunks of ``chunk``
tokens, with the full cache, measuring the attention mass the tracking policies rank by (H2O's accumulated
mass and Conf-KV's EMA share one tracker: every query, β = 0.9). Every (setting, policy) then branches from a
copy of that cache (:meth:`KVCache.copy`) and decodes on its own (:meth:`Decoding.resume`):

* ``prefill`` — the copy also takes the question as one more chunk (the whole prompt prefilled with the full
  cache, attention measured); the first answer token comes from the full cache, the policy cuts the cache to
  its budget at that step, and every later answer token is read from the cut cache (the setting of
  :mod:`.needle`).
* ``streamed`` — the question is fed through the decode loop teacher-forced, one token per step, the policy
  evicting at every step (the first cut on the haystack alone): the mechanism of :mod:`.needle`'s
  ``streamed`` setting. The policy never sees the question before it must cut.

SnapKV measures only its observation window (the last ``window`` queries before its cut). Its branch copies
the shared cache minus its last ``window`` entries (:meth:`KVCache.append_from`) and re-runs those tokens
with the window's attention measured: a ``window``-token forward over the context, not a second prefill.

Budgets: every policy holds at most ``budget`` entries after its first cut. Sliding (4 sinks + newest, original
positions), StreamingLLM (4 sinks + newest, re-rotated to positions inside the cache), H2O (half heavy hitters,
half recent: ``recent = budget // 2``, as the paper), SnapKV (its one cut at ``budget`` minus the tokens the
run appends afterwards, window ``budget // 8``, so its peak is ``budget`` too), Conf-KV (:func:`.needle.needle_confkv`:
``loose = budget``, ``tight = 3/4·budget``; its mean memory, which its confidence sets, is the table's
``mean_cache_len``). The answer is decoded greedily until a newline or the task's answer length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from kvlab.studies.eviction.ruler import TASKS, RulerCase, make_cases, score

SETTINGS = ("prefill", "streamed")
POLICIES = ("full", "sliding", "streamingllm", "h2o", "snapkv", "confkv")
LENGTHS = (2048, 4096, 8192)
MAX_POSITIONS = 8192          # the embedded SmolLM2-135M-Instruct's max_position_embeddings


@dataclass(frozen=True)
class LongGrid:
    """What ``python -m kvlab needle-long`` runs: ``n`` cases of every (task, length) (one int, or one per length),
    each policy at ``budget`` in each setting; cells whose full-cache accuracy is below ``threshold`` are left out
    of the table. ``screen``: after a cell's first ``screen`` cases, a cell whose full cache is below
    ``threshold`` on them runs no more cases (0: run every cell to ``n``)."""

    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = LENGTHS
    n: int | tuple[int, ...] = 60
    budget: int = 256
    policies: tuple[str, ...] = POLICIES
    settings: tuple[str, ...] = SETTINGS
    gamma: float = 0.9
    threshold: float = 0.8
    chunk: int = 1024
    seed: int = 0
    screen: int = 5

    def __post_init__(self):
        check_grid(self)

    def n_at(self, length: int) -> int:
        """Cases per task at ``length``."""
        return self.n if isinstance(self.n, int) else self.n[self.lengths.index(length)]


def _ints(name: str, values, lo: int) -> None:
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < lo for v in values):
        raise ValueError(f"{name}={list(values)!r} must be ints >= {lo}")


def check_grid(g: LongGrid) -> None:
    """Validate a grid before any model loads (ValueError naming the parameter and the fix)."""
    bad = [t for t in g.tasks if t not in TASKS]
    if not g.tasks or bad:
        raise ValueError(f"tasks={list(g.tasks)!r}: unknown {bad}; choose from {TASKS}")
    _ints("lengths", g.lengths, 64)
    if max(g.lengths) > MAX_POSITIONS:
        raise ValueError(f"lengths={list(g.lengths)!r}: the embedded model has {MAX_POSITIONS} positions; "
                         f"use lengths <= {MAX_POSITIONS - 64} tokens of prompt (the answer needs positions too)")
    ns = [g.n] if isinstance(g.n, int) else list(g.n)
    _ints("n", ns, 1)
    if len(ns) not in (1, len(g.lengths)):
        raise ValueError(f"n={g.n!r}: give one count, or one per length ({len(g.lengths)} lengths)")
    _ints("screen", [g.screen], 0)
    _ints("budget", [g.budget], 64)
    _ints("chunk", [g.chunk], 16)
    if g.budget >= min(g.lengths):
        raise ValueError(f"budget={g.budget} must be below the shortest length {min(g.lengths)}: otherwise nothing "
                         "is evicted")
    for name, vals, allowed in (("policies", g.policies, POLICIES), ("settings", g.settings, SETTINGS)):
        badv = [v for v in vals if v not in allowed]
        if not vals or badv:
            raise ValueError(f"{name}={list(vals)!r}: unknown {badv}; choose from {allowed}")
    if not 0.0 <= g.gamma <= 1.0:
        raise ValueError(f"gamma={g.gamma!r} must be in [0, 1] (Conf-KV's confidence threshold)")
    if not 0.0 <= g.threshold <= 1.0:
        raise ValueError(f"threshold={g.threshold!r} must be in [0, 1] (full-cache accuracy a cell needs)")


def policy(name: str, budget: int, appended: int, gamma: float = 0.9):
    """The registered policy ``name`` at ``budget`` (module docstring); ``appended``: tokens the run appends
    after the first cut (SnapKV's cut leaves room for them). ``full`` is None (no eviction)."""
    from kvlab.eviction import EVICTION_POLICIES as E
    from kvlab.studies.eviction.needle import needle_confkv

    window = budget // 8
    made = {"full": lambda: None,
            "sliding": lambda: E.entry("sliding").at_budget(budget, sinks=4),
            "streamingllm": lambda: E.entry("streamingllm").at_budget(budget, sinks=4),
            "h2o": lambda: E.entry("h2o").at_budget(budget, recent=budget // 2),
            "snapkv": lambda: E.entry("snapkv").at_budget(max(window + 1, budget - appended), recent=window),
            "confkv": lambda: needle_confkv(budget, gamma)}
    if name not in made:
        raise ValueError(f"policy={name!r} must be one of {POLICIES}")
    return made[name]()


def tracker(pol) -> dict | None:
    """The attention tracking ``pol`` asks of the cache (:meth:`KVCache.track_attention`'s arguments), or None."""
    from kvlab.decode.protocols import evict_attr

    if pol is None or not evict_attr(pol, "needs_attention"):
        return None
    return {"ema_decay": evict_attr(pol, "ema_decay"), "window": evict_attr(pol, "attention_window"),
            "pool": evict_attr(pol, "attention_pool"), "below": evict_attr(pol, "attention_below"),
            "ema_prefill": evict_attr(pol, "ema_prefill")}


def shared_tracker(pols: Sequence) -> dict | None:
    """The one tracker of the shared prefill: that of every policy measuring all queries (they must agree);
    window policies (SnapKV) measure their window on their own branch."""
    full = {tuple(sorted(t.items())) for t in map(tracker, pols) if t is not None and t["window"] is None}
    if len(full) > 1:
        raise ValueError(f"the policies track attention differently ({sorted(full)}): one shared prefill cannot "
                         "serve them; give them the same ema_decay / pool / below / ema_prefill")
    return dict(next(iter(full))) if full else None


def prefill(lm, ids: Sequence[int], track: dict | None, chunk: int):
    """A new full cache of ``ids`` prefilled ``chunk`` tokens per forward, attention measured when ``track``;
    returns ``(cache, last logits)``. The one prefill of a case (the tests count its calls)."""
    import torch

    from kvlab.cache import KVCache

    cache = KVCache()
    if track is not None:
        cache.track_attention(**track)
    with torch.inference_mode():
        for i in range(0, len(ids), chunk):
            logits = cache.forward(lm.model, list(ids[i:i + chunk]), writer="teacher", step=-1,
                                   attention=track is not None)
    return cache, logits


def _extend(lm, cache, ids: Sequence[int], track: dict | None):
    import torch

    with torch.inference_mode():
        return cache.forward(lm.model, list(ids), writer="teacher", step=-1, attention=track is not None)


def window_branch(lm, src, ids: Sequence[int], track: dict):
    """A cache of ``ids`` for a window-measuring policy: ``src``'s entries but the last ``window`` copied
    (no recomputation), those re-run with the window's attention measured. Returns ``(cache, logits)``."""
    from kvlab.cache import KVCache

    w = min(int(track["window"]), len(ids) - 1)
    cache = KVCache()
    cache.append_from(src, len(ids) - w)
    cache.track_attention(**track)
    return cache, _extend(lm, cache, ids[len(ids) - w:], track)


def _decode(lm, cache, logits, pol, forced: Sequence[int], answer_tokens: int) -> dict:
    """Greedy answer on ``cache`` under ``pol`` after the teacher-forced ``forced`` tokens; stops at a newline
    that follows some answer text (a leading newline, as vt's answers start, does not stop it)."""
    import torch

    from kvlab.decode import DecodeConfig, Decoding, Sampling

    cfg = DecodeConfig(mode="teacher", max_new_tokens=answer_tokens + len(forced), sampling=Sampling(), chat=False,
                       evict=pol, forced=tuple(forced))
    d = Decoding.resume(lm, cache, logits=logits, role="teacher", config=cfg)
    recs, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for rec in d:
            recs.append(rec)
            if len(recs) > len(forced) and "\n" in lm.tokenizer.decode(d.tokens[len(forced):]).lstrip():
                break
    lens = [r.cache_len for r in recs]
    return {"text": lm.tokenizer.decode(d.tokens[len(forced):], skip_special_tokens=True),
            "question_steps": len(forced), "cache_len": lens, "evicted": sum(r.evicted for r in recs),
            "decode_s": time.perf_counter() - t0}


def _config(lm, case: RulerCase, setting: str, name: str, pol, forced: Sequence[int], chunk: int) -> dict:
    from kvlab.decode import DecodeConfig, Sampling

    cfg = DecodeConfig(mode="teacher", max_new_tokens=case.answer_tokens + len(forced), sampling=Sampling(),
                       chat=False, evict=pol, forced=tuple(forced))
    return {"kind": "needle_long", "teacher": lm.fingerprint, "task": case.task, "prompt": case.prompt,
            "answers": list(case.answers), "setting": setting, "policy_name": name, "decode": cfg.to_dict(),
            "chunk": chunk, "stop": "newline"}


def question_ids(lm, case: RulerCase) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the question's tokens as they follow the context in the prompt's tokenization."""
    hay, full = lm.encode_prompt(case.context, chat=False), lm.encode_prompt(case.prompt, chat=False)
    if full[: len(hay)] == hay:
        return hay, full[len(hay):]
    return hay, [int(i) for i in lm.tokenizer(case.question, add_special_tokens=False)["input_ids"]]


def case_runs(lm, case: RulerCase, grid: LongGrid, store, compute: bool = True) -> list[dict] | None:
    """Every (setting, policy) run of ``case``, stored; at most ONE prefill of the case (none when every run is
    stored already). One dict per run: the stored result plus ``setting`` and ``policy``. ``compute=False``: None
    instead of computing a missing run."""
    hay, q = question_ids(lm, case)
    jobs = []
    for setting in grid.settings:
        forced = q if setting == "streamed" else []
        appended = case.answer_tokens + len(forced)
        for name in grid.policies:
            pol = policy(name, grid.budget, appended, grid.gamma)
            jobs.append((setting, name, pol, forced, _config(lm, case, setting, name, pol, forced, grid.chunk)))
    got = [store.reused(j[4]) for j in jobs]
    if any(g is None for g in got) and not compute:
        return None
    if any(g is None for g in got):
        track = shared_tracker([j[2] for j in jobs])
        t0 = time.perf_counter()
        base, base_logits = prefill(lm, hay, track, grid.chunk)
        prefill_s = time.perf_counter() - t0
        whole = None
        for i, (setting, name, pol, forced, key) in enumerate(jobs):
            if got[i] is not None:
                continue
            if setting == "prefill" and whole is None:
                whole = base.copy()
                whole_logits = _extend(lm, whole, q, track)
            src, ids, logits = (whole, hay + q, whole_logits) if setting == "prefill" else (base, hay, base_logits)
            own = tracker(pol)
            if own is not None and own["window"] is not None:
                cache, logits = window_branch(lm, src, ids, own)
            else:
                cache = src.copy()
            res = _decode(lm, cache, logits, pol, forced, case.answer_tokens)
            res.update(prompt_tokens=len(hay) + len(q), prefill_s=prefill_s)
            got[i] = store.get_or_run(key, lambda res=res: res)
    return [{**g, "setting": j[0], "policy": j[1]} for j, g in zip(jobs, got)]


def run_grid(lm, grid: LongGrid, store, progress: bool = True, log=print,
             time_limit: float | None = None) -> pd.DataFrame:
    """Every case of ``grid`` (per-run rows, :func:`run_row`), resuming from ``store``; rep-major, so a run cut
    short has covered every cell about equally, and a cell the full cache fails on its first ``grid.screen``
    cases stops there (:class:`LongGrid`)."""
    cases = [c for L in grid.lengths for c in make_cases(lm.tokenizer, grid.tasks, [L], grid.n_at(L), grid.seed)]
    cases.sort(key=lambda c: (c.rep, c.length))
    full = "prefill" if "prefill" in grid.settings else "streamed"
    hits: dict = {}                     # (task, length) -> full-cache correct per case so far
    rows, t0, missing = [], time.perf_counter(), 0
    for k, case in enumerate(cases):
        seen = hits.get((case.task, case.length), [])
        if grid.screen and case.rep >= grid.screen and "full" in grid.policies and seen \
                and sum(seen[:grid.screen]) / len(seen[:grid.screen]) < grid.threshold:
            continue
        got = case_runs(lm, case, grid, store, compute=time_limit is None or time.perf_counter() - t0 < time_limit)
        if got is None:
            missing += 1
            continue
        for r in got:
            rows.append(run_row(case, r, grid.budget))
            if r["policy"] == "full" and r["setting"] == full:
                hits.setdefault((case.task, case.length), []).append(rows[-1]["correct"])
        if progress:
            log(f"[{time.strftime('%H:%M:%S')}] needle-long {k + 1}/{len(cases)} {case.task} {case.length} "
                f"rep {case.rep}: {time.perf_counter() - t0:.0f} s")
    if missing:
        log(f"needle-long: time limit {time_limit:g} s: {missing} of {len(cases)} cases not run (rerun to resume)")
    return pd.DataFrame(rows)


def run_row(case: RulerCase, res: dict, budget: int) -> dict:
    correct, partial = score(case.task, res["text"], case.answers)
    q = res.get("question_steps", 0)
    lens = res["cache_len"]
    ans = lens[q:] or lens
    return {"task": case.task, "setting": res["setting"], "policy": res["policy"], "length": case.length,
            "rep": case.rep, "depth": case.depth, "prompt_tokens": res["prompt_tokens"], "budget": budget,
            "answers": " ".join(case.answers), "text": res["text"], "correct": correct, "partial": partial,
            "mean_cache_len": sum(ans) / len(ans), "max_cache_len": max(ans), "prefill_s": res["prefill_s"],
            "decode_s": res["decode_s"]}


__all__ = ["LongGrid", "SETTINGS", "POLICIES", "LENGTHS", "check_grid", "policy", "tracker", "shared_tracker",
           "prefill", "window_branch", "case_runs", "run_grid", "run_row", "question_ids"]
