"""The long-context eviction study (issue 36, item 5, quality): KL to the full cache and perplexity of a real
text's continuation at 2k-8k-token contexts, every policy branching from ONE prefill of the prompt.

Per (context ``C``, prompt): the document's tokens ``[P - C, P)`` are the context and ``[P, P + M + 1)`` its
true continuation ``x_1 .. x_{M+1}`` (``P`` fixed per document, :mod:`.long_texts`, so the contexts are nested
and share the continuation). The context is prefilled once per attention-statistics setting the policies need
(:func:`prefill_bases`): one plain prefill of ``[P - C, P - W)`` shared by everything (``W``: the longest
observation window), a copy of it finishing ``[P - W, P)`` with attention for each windowed setting (SnapKV,
PyramidKV, block eviction: their statistics come from the last queries only, so this equals one prefill) and
one prefill with attention over the whole context for the settings that accumulate over every query (H2O,
Scissorhands, Conf-KV; ``below`` only adds Scissorhands' counts, so they share one). Adding a policy adds no
prefill.

Then ONE teacher-forced pass per policy on the text's continuation (not the full cache's greedy continuation:
one pass gives both measures): the full cache's distributions ``p_s`` (``s = 1 .. M``) and each policy's
``q_s``, each policy on its own copy of its base. Step ``s`` feeds ``x_s``, scores, then runs the decode
loop's own evict phase (:func:`kvlab.decode.evict_phase.evict_view` + ``apply_keep``; the first cut at step 1).
Step 1's forward reads the whole context for every policy (``q_1 = p_1``), so the scores average steps
``2 .. M``: ``kl_forced`` = mean ``KL(p_s || q_s)``, ``nll`` = mean ``-log q_s(x_{s+1})`` (``ppl = exp(nll)``),
``mean_len`` = live entries those forwards read (mean over layers), ``kv_bytes16`` = resident K/V bytes at
16 bits (INT8 entries at 1 byte). One stored result per (context, prompt, policy) in the run store.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from kvlab.decode.protocols import measures_at
from kvlab.studies.eviction.long_policies import CONTROL, PROTECT, confkv_control, row_name

STUDY_VERSION = 1


def stat_key(pol) -> tuple | None:
    """The statistics a policy's decisions read, as a prefill group key: None when it needs none;
    ``below`` is left out (it only adds Scissorhands' counts: see the module docstring)."""
    from kvlab.decode.protocols import evict_attr

    if pol is None or not evict_attr(pol, "needs_attention"):
        return None
    return tuple(evict_attr(pol, k) for k in ("ema_decay", "attention_window", "attention_pool", "ema_prefill"))


def _check_policy(pol) -> None:
    from kvlab.decode.protocols import evict_attr

    for attr in ("needs_inputs", "needs_kv"):
        if evict_attr(pol, attr):
            raise ValueError(f"{type(pol).__name__} {attr}: evict-long runs policies that read the cache's "
                             "positions and attention statistics only")


@torch.inference_mode()
def prefill_bases(model, ctx: list[int], policies: dict, on_forward: Callable | None = None) -> dict:
    """``{group key: KVCache}`` holding ``ctx``: ``None`` (no statistics; the full cache's) and one per
    :func:`stat_key` of ``policies`` (module docstring). ``on_forward(n)`` is called with every forward's
    token count (tests count the prefills)."""
    from kvlab.cache import KVCache
    from kvlab.decode.protocols import evict_attr

    def fwd(cache, ids, attention=False):
        if on_forward is not None:
            on_forward(len(ids))
        cache.forward(model, ids, writer="teacher", attention=attention)

    groups: dict[tuple, bool] = {}
    for pol in policies.values():
        k = stat_key(pol)
        if k is not None:
            groups[k] = groups.get(k, False) or bool(evict_attr(pol, "attention_below"))
    windows = [k[1] for k in groups if k[1] is not None]
    w = min(max(windows, default=1), len(ctx) - 1)
    plain = KVCache()
    fwd(plain, ctx[:len(ctx) - w])
    bases = {}
    for key, below in groups.items():
        decay, window, pool, ema_prefill = key
        if window is None:
            c = KVCache()
            c.track_attention(decay, window=None, pool=pool, below=below, ema_prefill=ema_prefill)
            fwd(c, ctx, attention=True)
        else:
            c = plain.copy()
            c.track_attention(decay, window=window, pool=pool, below=below, ema_prefill=ema_prefill)
            fwd(c, ctx[len(ctx) - w:], attention=True)
        bases[key] = c
    fwd(plain, ctx[len(ctx) - w:])
    bases[None] = plain
    return bases


def _record(step: int, logits: torch.Tensor):
    from kvlab.decode import token_stats

    _, ent, top1, margin = token_stats(logits)
    return SimpleNamespace(step=step, entropy_bits=ent, top1_prob=top1, margin=margin)


def _evict(cache, pol, step: int, logits: torch.Tensor, model) -> dict:
    from kvlab.decode.evict_phase import apply_keep, evict_view
    from kvlab.decode.protocols import evict_due

    if not evict_due(pol, step):
        return {}
    view = evict_view(cache, step, _record(step, logits), int(logits.shape[-1]), logits=logits, temperature=1.0,
                      top_p=1.0, first=step == 1)
    decision = pol.keep(view)
    apply_keep(cache, decision, model)
    return decision.signals()


def _read_len(cache) -> float:
    lens = cache.layer_lengths()
    return sum(lens) / len(lens)


class _Row:
    """One policy's forced pass, step by step: scores each forward's logits, then runs the evict phase."""

    def __init__(self, pol, cache, cont: list[int], full_logp: torch.Tensor | None, loose: int | None):
        from kvlab.decode.protocols import evict_attr

        self.pol, self.cache, self.cont, self.full_logp, self.loose = pol, cache, cont, full_logp, loose
        self.need = pol is not None and bool(evict_attr(pol, "needs_attention"))
        self.m = len(cont) - 1
        self.logps, self.kls, self.nlls, self.lens, self.b16, self.chose, self.at_loose = [], [], [], [], [], [], []
        self.conf: list[float] = []

    def score(self, s: int, logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1)
        if self.full_logp is None:
            self.logps.append(lp)
        if s == 1:
            return
        if self.full_logp is not None:
            p = self.full_logp[s - 1]
            self.kls.append(float(torch.sum(p.exp() * (p - lp))))
        self.nlls.append(-float(lp[self.cont[s]]))
        self.lens.append(_read_len(self.cache))
        self.b16.append(float(self.cache.nbytes16()))

    def evict(self, s: int, logits: torch.Tensor, model) -> None:
        if self.pol is None or s >= self.m:                      # the last step's cut is never read
            return
        sig = _evict(self.cache, self.pol, s, logits, model)
        if "confidence" in sig:
            self.conf.append(float(sig["confidence"]))
        if self.loose is not None and "budget" in sig:
            self.chose.append(sig["budget"] == self.loose)
            self.at_loose.append(sig["budget"] == self.loose and _read_len(self.cache) >= self.loose)

    def result(self) -> dict:
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")      # noqa: E731
        out = {"nll": mean(self.nlls), "mean_len": mean(self.lens), "kv_bytes16": mean(self.b16),
               "nll_steps": self.nlls, "len_steps": self.lens, "kl_forced": mean(self.kls) if self.kls else 0.0,
               "kl_steps": self.kls, "frac_loose": mean([float(x) for x in self.chose]),
               "frac_at_loose": mean([float(x) for x in self.at_loose]), "conf_steps": self.conf}
        if self.full_logp is None:
            out["_logp"] = torch.stack(self.logps)                # (M, V): the reference's, never stored
        return out


def _start(first, pol, cont, full_logp, loose, model) -> _Row:
    """A row on a copy of ``first``'s cache (step 1's forward, shared by a statistics group), step 1 scored and
    cut."""
    cache0, logits1 = first
    row = _Row(pol, cache0.copy(), cont, full_logp, loose)
    row.score(1, logits1)
    row.evict(1, logits1, model)
    return row


@torch.inference_mode()
def forced_branch(model, base, first, pol, cont: list[int], full_logp: torch.Tensor | None, loose: int | None,
                  on_forward: Callable | None = None) -> dict:
    """One policy's teacher-forced pass on ``cont`` (``x_1 .. x_{M+1}``) from ``first``: ``(cache, logits)``
    after step 1's forward on a copy of the prefilled base (shared by the policies of one statistics group; the
    copy here leaves it unchanged). ``full_logp`` ``(M, V)``: the full cache's log-probabilities (None: this IS
    the full cache). Returns per-step lists over steps ``2 .. M`` and the summary scalars."""
    row = _start(first, pol, cont, full_logp, loose, model)
    for s in range(2, row.m + 1):
        if on_forward is not None:
            on_forward(1)
        logits = row.cache.forward(model, [cont[s - 1]], writer="teacher", step=s,
                                   attention=row.need and measures_at(row.pol, s))
        row.score(s, logits)
        row.evict(s, logits, model)
    return row.result()


def _bank(model, rows: list[_Row], capacity: int):
    """A bank with one slot per row, each row's cache moved into its slot (its live entries copied)."""
    from kvlab.cache.batch import Bank

    if not rows:
        return None
    bank = Bank.for_model(model, len(rows), capacity=capacity)
    for b, r in enumerate(rows):
        r.cache = bank.adopt(b, r.cache)
    return bank


@torch.inference_mode()
def forced_batch(model, rows: list[_Row], on_forward: Callable | None = None, bank=None) -> None:
    """Steps ``2 .. M`` of several rows (full-precision caches) in one batched forward per step
    (:class:`~kvlab.cache.batch.Bank` + :func:`~kvlab.cache.batch.forward_rows`), each row then cut by its own
    policy; the same computation as :func:`forced_branch` row by row."""
    from kvlab.cache.batch import forward_rows

    if not rows:
        return
    m, cont = rows[0].m, rows[0].cont
    if bank is None:
        bank = _bank(model, rows, max(max(r.cache.layer_lengths()) for r in rows) + m + 2)
    n = len(rows)
    for s in range(2, m + 1):
        if on_forward is not None:
            for _ in rows:
                on_forward(1)
        logits = forward_rows(bank, model, [r.cache for r in rows], [cont[s - 1]] * n, writer="teacher",
                              steps=[s] * n, attention=[r.need and measures_at(r.pol, s) for r in rows])
        for b, r in enumerate(rows):
            r.score(s, logits[b])
            r.evict(s, logits[b], model)


@dataclass(frozen=True)
class Prompt:
    """One (document, context) case: the context's token ids and the continuation ``x_1 .. x_{M+1}``."""

    doc: str
    context: int
    ctx: tuple[int, ...]
    cont: tuple[int, ...]


def run_prompt(model, case: Prompt, policies: dict, *, control: dict | None = None, done: dict | None = None,
               on_forward: Callable | None = None, on_result: Callable | None = None, batch: bool = True) -> dict:
    """Every policy of ``policies`` (``{row name: policy}``; ``"full"`` first, None) on ``case``, from one set of
    prefills. ``control``: ``{Conf-KV-L row: control row}`` — after each Conf-KV-L row its confidence-off
    control at Conf-KV-L's mean length (:func:`~kvlab.studies.eviction.long_policies.confkv_control`).
    ``done``: rows already stored (``{name: result}``), not recomputed (the full cache's reference is, when
    another row is missing: its distributions are needed). ``on_result(name, policy, result)`` as each row
    finishes. ``batch``: the full-precision rows' steps run batched (:func:`forced_batch`), the INT8 rows one by
    one. Returns ``{name: (policy, result)}``."""
    control = control or {}
    done = dict(done or {})
    need = [n for n in policies if n not in done] + [c for a, c in control.items() if c not in done]
    if not need:
        return {}
    for pol in policies.values():
        if pol is not None:
            _check_policy(pol)
    ctx, cont = list(case.ctx), list(case.cont)
    bases = prefill_bases(model, ctx, {n: p for n, p in policies.items()}, on_forward=on_forward)
    firsts: dict = {}

    def first(key, pol_need: bool):
        if key not in firsts:
            if on_forward is not None:
                on_forward(1)
            c = bases[key].copy()
            logits = c.forward(model, [cont[0]], writer="teacher", step=1, attention=pol_need)
            firsts[key] = (c, logits)
        return firsts[key]

    out = {}
    full = forced_branch(model, None, first(None, False), None, cont, None, None, on_forward)
    full_logp = full.pop("_logp")
    if "full" in policies:
        out["full"] = (None, full)
        if on_result is not None and "full" not in done:
            on_result("full", None, full)

    def finish(name, row):
        res = row.result()
        out[name] = (row.pol, res)
        if on_result is not None:
            on_result(name, row.pol, res)
        return res

    def start(pol):
        key = stat_key(pol)
        return _start(first(key, key is not None), pol, cont, full_logp, getattr(pol, "loose", None), model)

    todo = {n: p for n, p in policies.items() if p is not None and n not in done}
    if batch and todo:
        # full-precision rows: started one at a time and adopted into a bank (only their live entries are
        # copied; the context-length copy is dropped at once), then stepped together. INT8 rows: one by one below.
        size = lambda p: getattr(p, "loose", 0) or getattr(p, "budget", 0) or getattr(p, "window", 0) or 0  # noqa: E731
        names = [n for n, p in todo.items() if getattr(p, "int8_window", None) is None]
        rows = []
        bank = None
        if names:
            from kvlab.cache.batch import Bank

            bank = Bank.for_model(model, len(names), capacity=2 * max(size(todo[n]) for n in names) + len(cont) + 64)
        for b, n in enumerate(names):
            r = start(todo[n])
            r.cache = bank.adopt(b, r.cache)
            rows.append(r)
        forced_batch(model, rows, on_forward, bank=bank)
        for n, r in zip(names, rows):
            finish(n, r)
        del bank, rows
    for name, pol in policies.items():
        if pol is None:
            continue
        res = done.get(name)
        if res is not None:
            out[name] = (pol, res)
        elif name not in out:
            res = finish(name, _steps(model, start(pol), on_forward))
        else:
            res = out[name][1]
        if name in control:
            cname = control[name]
            cpol = confkv_control(res["mean_len"], pyramidal=bool(getattr(pol, "pyramidal", True)))
            if cname in done:
                out[cname] = (cpol, done[cname])
            else:
                finish(cname, _steps(model, start(cpol), on_forward))
    return out


@torch.inference_mode()
def _steps(model, row: _Row, on_forward) -> _Row:
    for s in range(2, row.m + 1):
        if on_forward is not None:
            on_forward(1)
        logits = row.cache.forward(model, [row.cont[s - 1]], writer="teacher", step=s,
                                   attention=row.need and measures_at(row.pol, s))
        row.score(s, logits)
        row.evict(s, logits, model)
    return row


def control_rows(names) -> dict[str, str]:
    """``{Conf-KV-L row: its control's row}`` for every ``confkv_l_b<B>`` in ``names``."""
    out = {}
    for n in names:
        if n.startswith("confkv_l_b"):
            out[n] = row_name(CONTROL, int(n.rsplit("_b", 1)[1]))
    return out


def perplexity(nll: float) -> float:
    return float(math.exp(nll)) if nll == nll else float("nan")


def now() -> str:
    return time.strftime("%H:%M:%S")


__all__ = ["Prompt", "prefill_bases", "forced_branch", "run_prompt", "control_rows", "stat_key", "PROTECT"]
