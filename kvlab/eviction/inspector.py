"""Cache inspector: which prompt and generated tokens each layer still holds.

:class:`CacheInspector` watches one run: after every step (``observe(record, cache)``, e.g. from
``kvlab.decode.run(..., on_step=inspector.on_step)`` or a ``for rec in decoding`` loop) it reads the
cache's per-layer live maps (:meth:`kvlab.cache.KVCache.lives`: ledger row per slot) and the policy's
attention statistic of every live entry, and notes the step at which each entry left each layer and
the statistic it had when it was last seen (the score that decided against it). It reads only — the
cache is never touched. The data functions draw nothing:

* :meth:`token_frame` — one row per ledger row (token written to the cache): position, token text,
  writer, the step that wrote it, how many layers hold it now, the step it was first / last evicted
  from a layer, and its mean score over the layers that hold it (or held it when it left);
* :meth:`survival` — ``(L, P)`` booleans over the positions seen: layer ``l`` holds position ``p``;
* :func:`tokens_html` — the text with every token shaded by the share of layers that keep it, its
  hover title giving position, writer, score and eviction step (what notebook 05 shows).
"""
from __future__ import annotations

import html
from typing import Sequence

import numpy as np
import pandas as pd


class CacheInspector:
    """Per-layer survival of every cache entry over one run (module docstring). ``stat`` names the
    attention statistic shown as the score (``"acc"`` H2O's accumulated mass, ``"ema"`` Conf-KV's)."""

    def __init__(self, stat: str = "ema"):
        self.stat = stat
        self.step = 0
        self.lives: list[list[int]] = []           # per layer: ledger rows live after the last observed step
        self.left: dict[tuple[int, int], int] = {}   # (row, layer) -> step it left that layer
        self.score: dict[tuple[int, int], float] = {}  # (row, layer) -> statistic when last seen on that layer
        self.ledger = None

    def on_step(self, record, decoding) -> None:
        """``kvlab.decode.run``'s ``on_step`` callback."""
        self.observe(record, decoding.cache)

    def observe(self, record, cache) -> None:
        """Read the cache after ``record``'s step (its evict phase included)."""
        lives = [list(x) for x in cache.lives]
        attn = cache.layer_attn()
        stat = attn.get(self.stat) if attn is not None else None
        n_rows = len(cache.ledger)
        for l, rows in enumerate(lives):          # every entry ever written that this layer no longer holds
            now = set(rows)
            for r in range(n_rows):
                if r not in now and (r, l) not in self.left:
                    self.left[(r, l)] = int(record.step)
        for l, rows in enumerate(lives):
            if stat is not None:
                vals = stat[l].detach().float().cpu().tolist()
                for r, v in zip(rows, vals):
                    self.score[(r, l)] = float(v)
        self.lives, self.step, self.ledger = lives, int(record.step), cache.ledger

    @property
    def num_layers(self) -> int:
        return len(self.lives)

    def token_frame(self, tokenizer=None) -> pd.DataFrame:
        """One row per ledger row (module docstring); ``token`` is decoded when a tokenizer is given."""
        led = self.ledger
        if led is None:
            raise ValueError("observe at least one step before reading the inspector")
        live = [set(rows) for rows in self.lives]
        out = []
        for r in range(len(led)):
            held = [l for l in range(self.num_layers) if r in live[l]]
            gone = [self.left[(r, l)] for l in range(self.num_layers) if (r, l) in self.left]
            scores = [self.score[(r, l)] for l in range(self.num_layers) if (r, l) in self.score]
            tid = led.token_id[r]
            out.append({"row": r, "position": led.position[r], "token_id": tid,
                        "token": tokenizer.decode([tid]) if tokenizer is not None else str(tid),
                        "writer": led.writer[r], "written_step": led.step[r], "layers": len(held),
                        "share": len(held) / max(1, self.num_layers),
                        "first_evicted": min(gone) if gone else None, "last_evicted": max(gone) if gone else None,
                        "score": float(np.mean(scores)) if scores else float("nan")})
        return pd.DataFrame(out)

    def survival(self) -> tuple[list[int], np.ndarray]:
        """``(positions, M)``: the sorted positions of every ledger row, and ``M[l, i]`` = layer ``l``
        holds position ``positions[i]`` after the last observed step."""
        led = self.ledger
        pos = sorted(set(led.position))
        col = {p: i for i, p in enumerate(pos)}
        m = np.zeros((self.num_layers, len(pos)), dtype=bool)
        for l, rows in enumerate(self.lives):
            for r in rows:
                m[l, col[led.position[r]]] = True
        return pos, m


def tokens_html(frame: pd.DataFrame, num_layers: int, max_tokens: int | None = None) -> str:
    """The text, every token shaded by the share of layers that keep it (dark = all layers, pale =
    none); hovering a token shows position, writer, layers, score and the step it was evicted."""
    rows = frame.sort_values("position")
    if max_tokens is not None:
        rows = rows.tail(max_tokens)
    spans = []
    for r in rows.itertuples():
        ev = "" if r.first_evicted is None or pd.isna(r.first_evicted) else f", evicted at step {int(r.first_evicted)}"
        title = (f"position {r.position}, written by {r.writer} (step {r.written_step}), kept by {r.layers}/"
                 f"{num_layers} layers, score {r.score:.4g}{ev}")
        alpha = 0.1 + 0.8 * float(r.share)
        spans.append(f'<span title="{html.escape(title)}" style="background: rgba(231, 41, 138, {alpha:.2f}); '
                     f'border-radius: 2px">{html.escape(str(r.token))}</span>')
    return ('<div style="font-family: monospace; white-space: pre-wrap; line-height: 1.6">' + "".join(spans)
            + "</div>")


def survival_figure(inspector: CacheInspector, title: str = ""):
    """Layers × positions survival map of the inspector's last step (dark = held)."""
    from kvlab.viz.base import new_figure

    pos, m = inspector.survival()
    fig = new_figure(figsize=(11, 3.2))
    ax = fig.subplots(1, 1)
    ax.imshow(m, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    ticks = np.linspace(0, len(pos) - 1, min(12, len(pos))).round().astype(int)
    ax.set_xticks(ticks, [str(pos[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title(title or f"which layers hold each position after step {inspector.step}", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["CacheInspector", "tokens_html", "survival_figure"]
