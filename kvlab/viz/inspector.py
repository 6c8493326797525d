"""Cache inspector: which prompt and generated tokens each layer still holds, after any step of a run.

:class:`CacheInspector` watches one run: after every step (``observe(record, cache)``, e.g. from
``kvlab.decode.run(..., on_step=inspector.on_step)`` or a ``for rec in decoding`` loop) it reads the
cache's per-layer live maps (:meth:`kvlab.cache.KVCache.lives`: ledger row per slot) and the policy's
attention statistic of every live entry, and notes the step each ledger row first existed (``born``),
the step it left each layer (``left``) and, per step, the statistic every entry had when last seen on
each layer (once it is gone: its statistic after the step before its eviction — one forward older than
the one its policy read; an entry evicted in the step it first appears, e.g. a prompt longer than the
budget at step 1, has none). It reads only — the cache is never touched. From that history the state
after **any** observed step ``t`` is rebuilt (``at=t``): a row is on layer ``l`` after step ``t`` iff
``born[r] <= t < left[(r, l)]`` (an entry never returns to a layer: evictions and refresh splices only
remove; new K/V get new ledger rows — :meth:`observe` refuses a return). Memory: one ``(L, rows)``
float32 score matrix per observed step. The data functions draw nothing:

* :meth:`token_frame` — one row per ledger row (token written to the cache) by step ``t``: position,
  token text, writer, the step that wrote it (``born``: the first step observed with it), how many
  layers hold it, the step it was first / last evicted from a layer (or, ``rewritten``, the step a
  refresh wrote a newer entry at its position), and its mean score over the layers that hold it (or
  held it when it left);
* :meth:`survival` — ``(L, P)`` booleans over the positions written by step ``t``: layer ``l`` holds
  position ``p``;
* :func:`tokens_html` — the text with every token shaded by the share of layers that keep it, its
  hover title giving position, writer, score and eviction step (notebook 05, the playground);
* :func:`score_stat` — the statistic a policy's evictions are decided by (read generically).
"""
from __future__ import annotations

import bisect
import html
import math

import numpy as np
import pandas as pd

from kvlab.decode.protocols import evict_attr

# what each attention statistic is called in hover titles and captions
STAT_LABELS = {"acc": "accumulated attention", "ema": "EMA attention", "low": "low-attention queries",
               "count": "measured queries"}


def score_stat(policy) -> str | None:
    """The attention statistic that decides ``policy``'s evictions: its ``score_stat`` attribute, else
    ``"acc"`` (accumulated mass) when it ``needs_attention``, else None (it ranks without attention:
    by position, at random)."""
    if policy is None:
        return None
    default = "acc" if evict_attr(policy, "needs_attention") else None
    return getattr(policy, "score_stat", default)


class CacheInspector:
    """Per-layer survival of every cache entry over one run (module docstring). ``stat`` names the
    attention statistic shown as the score (``"acc"`` H2O's accumulated mass, ``"ema"`` Conf-KV's,
    ``"low"`` Scissorhands' count; None: no score)."""

    def __init__(self, stat: str | None = "ema"):
        self.stat = stat
        self.step = 0
        self.steps: list[int] = []                  # the observed steps, increasing
        self.lives: list[list[int]] = []           # per layer: ledger rows live after the last observed step
        self.left: dict[tuple[int, int], int] = {}   # (row, layer) -> step it left that layer
        self.born: list[int] = []                   # row -> first observed step whose cache had the row
        self._seen: list[np.ndarray] = []           # per observed step: (L, rows) statistic when last seen (NaN: never)
        self.ledger = None

    def on_step(self, record, decoding) -> None:
        """``kvlab.decode.run``'s ``on_step`` callback."""
        self.observe(record, decoding.cache)

    def observe(self, record, cache) -> None:
        """Read the cache after ``record``'s step (its evict phase included). Steps must come in order,
        each once; a ledger row back on a layer it had left raises (the history could not say when)."""
        step = int(record.step)
        if self.steps and step <= self.steps[-1]:
            raise ValueError(f"record.step={step} was observed already (last: {self.steps[-1]}); observe each "
                             "step once, in order, or start a new CacheInspector for a new run")
        lives = [list(x) for x in cache.lives]
        attn = cache.layer_attn()
        stat = attn.get(self.stat) if attn is not None and self.stat is not None else None
        n_rows = len(cache.ledger)
        self.born.extend([step] * (n_rows - len(self.born)))
        for l, rows in enumerate(lives):          # every entry ever written that this layer no longer holds
            now = set(rows)
            for r in range(n_rows):
                gone = (r, l) in self.left
                if r not in now and not gone:
                    self.left[(r, l)] = step
                elif r in now and gone:
                    raise ValueError(f"ledger row {r} is back on layer {l} at step {step} after leaving it at step "
                                     f"{self.left[(r, l)]}; the inspector follows decode runs (evictions, refresh "
                                     "splices), not cache surgery that restores entries")
        prev = self._seen[-1] if self._seen else None
        seen = np.full((len(lives), n_rows), np.nan, dtype=np.float32)     # (L, rows)
        if prev is not None:
            seen[:prev.shape[0], :prev.shape[1]] = prev
        if stat is not None:
            for l, rows in enumerate(lives):
                seen[l, rows] = stat[l].detach().float().cpu().numpy()
        self._seen.append(seen)
        self.steps.append(step)
        self.lives, self.step, self.ledger = lives, step, cache.ledger

    @property
    def num_layers(self) -> int:
        return len(self.lives)

    @property
    def first_step(self) -> int:
        self._need()
        return self.steps[0]

    @property
    def score(self) -> dict[tuple[int, int], float]:
        """``(row, layer) -> statistic`` when last seen on that layer, after the last observed step."""
        if not self._seen:
            return {}
        last = self._seen[-1]
        return {(r, l): float(last[l, r]) for l, r in zip(*np.nonzero(~np.isnan(last)))}

    def _need(self) -> None:
        if self.ledger is None:
            raise ValueError("observe at least one step before reading the inspector")

    def _index(self, at: int | None) -> int:
        """Index into :attr:`steps` of step ``at`` (None: the last observed step)."""
        self._need()
        if at is None:
            return len(self.steps) - 1
        i = bisect.bisect_left(self.steps, at) if isinstance(at, (int, np.integer)) and not isinstance(at, bool) else -1
        if i < 0 or i >= len(self.steps) or self.steps[i] != at:
            raise ValueError(f"at={at!r} must be an observed step, {self.steps[0]}..{self.steps[-1]} "
                             "(or None for the last one)")
        return i

    def rows_at(self, at: int | None = None) -> int:
        """How many ledger rows existed after step ``at``."""
        t = self.steps[self._index(at)]
        return bisect.bisect_right(self.born, t)

    def lives_at(self, at: int | None = None) -> list[list[int]]:
        """Per layer, the ledger rows it held after step ``at`` (rebuilt from ``born`` and ``left``), in
        ledger order (the cache's own :attr:`~kvlab.cache.KVCache.lives` are in slot order)."""
        t = self.steps[self._index(at)]
        n = self.rows_at(t)
        never = math.inf
        return [[r for r in range(n) if self.left.get((r, l), never) > t] for l in range(self.num_layers)]

    def token_frame(self, tokenizer=None, at: int | None = None) -> pd.DataFrame:
        """One row per ledger row written by step ``at`` (default: the last observed step; module
        docstring); ``token`` is decoded when a tokenizer is given."""
        i = self._index(at)
        t, seen = self.steps[i], self._seen[i]
        led, L = self.ledger, self.num_layers
        live = [set(rows) for rows in self.lives_at(t)]
        n = self.rows_at(t)
        newer: dict[int, int] = {}                  # row -> the next row written at its position (a refresh splice)
        last_at: dict[int, int] = {}
        for r in range(n):
            p = led.position[r]
            if p in last_at:
                newer[last_at[p]] = r
            last_at[p] = r
        out = []
        for r in range(n):
            held = sum(r in live[l] for l in range(L))
            gone = [s for l in range(L) if (s := self.left.get((r, l))) is not None and s <= t]
            scores = seen[:, r] if r < seen.shape[1] else np.array([])
            scores = scores[~np.isnan(scores)]
            tid = led.token_id[r]
            out.append({"row": r, "position": led.position[r], "token_id": tid,
                        "token": tokenizer.decode([tid]) if tokenizer is not None else str(tid),
                        "writer": led.writer[r], "written_step": led.step[r], "born": self.born[r], "layers": held,
                        "share": held / max(1, L),
                        "first_evicted": min(gone) if gone else None, "last_evicted": max(gone) if gone else None,
                        "rewritten": self.born[newer[r]] if r in newer else None,
                        "score": float(scores.mean()) if len(scores) else float("nan")})
        return pd.DataFrame(out)

    def survival(self, at: int | None = None) -> tuple[list[int], np.ndarray]:
        """``(positions, M)``: the sorted positions of every ledger row written by step ``at`` (default:
        the last observed step), and ``M[l, i]`` = layer ``l`` holds position ``positions[i]`` after it."""
        t = self.steps[self._index(at)]
        led = self.ledger
        pos = sorted(set(led.position[:self.rows_at(t)]))
        col = {p: i for i, p in enumerate(pos)}
        m = np.zeros((self.num_layers, len(pos)), dtype=bool)          # (L, P)
        for l, rows in enumerate(self.lives_at(t)):
            for r in rows:
                m[l, col[led.position[r]]] = True
        return pos, m


def _title(r, num_layers: int, score_name: str) -> str:
    rewritten = getattr(r, "rewritten", None)
    if rewritten is not None and not pd.isna(rewritten):
        ev = f", rewritten at step {int(rewritten)} (a refresh wrote a newer entry at this position)"
    elif r.first_evicted is None or pd.isna(r.first_evicted):
        ev = ", never evicted"
    elif r.layers == 0 and r.last_evicted != r.first_evicted:
        ev = f", evicted at step {int(r.first_evicted)} (from the last layer at step {int(r.last_evicted)})"
    elif r.layers == 0:
        ev = f", evicted at step {int(r.first_evicted)} from every layer"
    else:
        ev = f", evicted at step {int(r.first_evicted)} from {num_layers - r.layers} of {num_layers} layers"
    if not pd.isna(r.score):
        score = f"{score_name} {r.score:.4g}"
    elif r.first_evicted is not None and not pd.isna(r.first_evicted) and r.first_evicted == r.born:
        score = "no score (evicted in the step it was written, before the inspector read it)"
    else:
        score = "no attention score"
    step = "prompt" if r.written_step < 0 else f"step {r.written_step}"
    return (f"position {r.position}, written by {r.writer} ({step}), kept by {r.layers}/{num_layers} layers, "
            f"{score}{ev}")


def tokens_html(frame: pd.DataFrame, num_layers: int, max_tokens: int | None = None, score_name: str = "score",
                rewritten: bool = False) -> str:
    """The text, every token shaded by the share of layers that keep it (dark = all layers, pale =
    none); hovering a token shows position, writer, layers, score (``score_name``) and the step it was
    evicted. Entries a refresh rewrote are left out (their position shows the newer entry) unless
    ``rewritten``."""
    rows = frame.sort_values("position", kind="stable")
    if not rewritten and "rewritten" in rows:
        rows = rows[rows.rewritten.isna()]
    if max_tokens is not None:
        rows = rows.tail(max_tokens)
    spans = []
    for r in rows.itertuples():
        title = _title(r, num_layers, score_name)
        alpha = 0.1 + 0.8 * float(r.share)
        spans.append(f'<span title="{html.escape(title)}" style="background: rgba(231, 41, 138, {alpha:.2f}); '
                     f'border-radius: 2px">{html.escape(str(r.token))}</span>')
    return ('<div style="font-family: monospace; white-space: pre-wrap; line-height: 1.6">' + "".join(spans)
            + "</div>")


def survival_figure(inspector: CacheInspector, title: str = "", at: int | None = None):
    """Layers × positions survival map after step ``at`` (default: the last observed step; dark = held)."""
    from kvlab.harness.figures import new_figure

    pos, m = inspector.survival(at)
    t = inspector.steps[inspector._index(at)]
    fig = new_figure(figsize=(11, 3.2))
    ax = fig.subplots(1, 1)
    ax.imshow(m, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    ticks = np.linspace(0, len(pos) - 1, min(12, len(pos))).round().astype(int)
    ax.set_xticks(ticks, [str(pos[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title(title or f"which layers hold each position after step {t}", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["STAT_LABELS", "CacheInspector", "score_stat", "survival_figure", "tokens_html"]
