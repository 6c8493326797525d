"""``from_kvpress(press, budget=...)``: a kvpress press as a kvlab eviction policy, wrappers included.

* a ``ScorerPress`` — :class:`PressPolicy` on it: prompt compression (``every_step=False``, what kvpress
  does) at ``budget`` entries per layer; ``every_step=True`` evicts at decode time too;
* ``DecodingPress(base_press, compression_interval, target_size, hidden_states_buffer_size)`` — decode-time
  eviction of ``base_press``: ``budget`` = ``target_size`` (unless given), a cut every ``interval =
  compression_interval`` steps once a layer is over budget (kvpress cuts every ``compression_interval``
  steps too, so the cache peaks near ``target_size + compression_interval``), the scorer seeing the last
  ``inputs_window = hidden_states_buffer_size`` tokens' layer inputs (at least 1); the prompt is not compressed
  (``DecodingPress`` leaves the prefill alone) unless it is over budget at the first cut;
* ``KeyRerotationPress(press)`` — ``press`` with kvlab's re-rotation: survivors move to consecutive
  positions (``Keep.rerotate``; the cache re-rotates their keys);
* anything else — refused before anything runs (:func:`kvlab.eviction.kvpress.check_press`).

The budget is kvlab's: a fixed number of entries per layer. A press's ``compression_ratio`` is not used to
size the cache (it still enters scores that read it, e.g. StreamingLLMPress's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.eviction.base import (EvictView, Keep, check_bool, keep_all, over_budget, positive_int, sink_counts,
                                 top_and_recent_layers)
from kvlab.eviction.scorer import ScoredEviction

from kvlab.eviction.kvpress.detect import is_press, press_name
from kvlab.eviction.kvpress.support import check_press


@dataclass(frozen=True)
class PressPolicy(ScoredEviction):
    """A kvpress ``ScorerPress`` (``scorer``) at ``budget`` entries per layer, ``sinks`` first positions and
    the newest ``protect`` never evicted; ``every_step`` evicts at decode time, every ``interval`` steps;
    ``rerotate`` re-rotates the survivors; ``inputs_window``: the tokens' layer inputs a decode-time cut
    shows the press. :class:`~kvlab.eviction.scorer.ScorerPolicy` with kvpress's wrappers' settings."""

    scorer: Any
    budget: int
    sinks: int = 0
    protect: int = 0
    every_step: bool = False
    interval: int = 1
    rerotate: bool = False
    inputs_window: int = 128

    def __post_init__(self):
        positive_int("interval", self.interval)
        positive_int("inputs_window", self.inputs_window)
        check_bool("rerotate", self.rerotate)
        self.check()

    def keep(self, view: EvictView) -> Keep:
        if self.every_step and not view.first and self.interval > 1 and view.step % self.interval:
            return keep_all(view, budget=self.budget)
        if not self.rerotate:
            return super().keep(view)
        return self._one_set(view)

    def _one_set(self, view: EvictView) -> Keep:
        """Re-rotation moves every layer's survivors to the same consecutive positions, so every layer keeps
        the same slots: ranked by the layer mean of the head-mean scores (kvpress's KeyRerotationPress keeps
        a top-k per head and layer)."""
        if (not self.every_step and not view.first) or not over_budget(view, self.budget, by_layer=False):
            return keep_all(view, budget=self.budget)
        if not view.uniform:
            raise ValueError(f"{press_name(self.scorer)} with rerotate=True needs one live set for all layers; "
                             "this cache's layers hold different positions")
        n = view.length
        score = torch.stack([self.layer_scores(view, l) for l in range(view.num_layers)]).mean(0)   # (T,)
        sinks = sink_counts(view, self.sinks)[0]
        kept = top_and_recent_layers([score], [n], self.budget, self.protect, [sinks])[0]
        return Keep(tuple(kept), budget=self.budget, rerotate=True)


def from_kvpress(press, budget: int | None = None, *, sinks: int = 0, protect: int = 0,
                 every_step: bool | None = None) -> PressPolicy:
    """``press`` (a kvpress press object, used as is) as a kvlab eviction policy (module docstring).
    ``budget``: entries kept per layer (required except for a ``DecodingPress``, whose ``target_size`` it
    defaults to). ``every_step``: evict at decode time too (default: False, or True for a DecodingPress)."""
    if not is_press(press):
        raise ValueError(f"press={press!r} is not a kvpress press (an instance of a kvpress class); a plain score "
                         "function goes to kvlab.ScorerPolicy(scorer, budget=...)")
    check_press(press, via="from_kvpress", every_step=bool(every_step))
    import kvpress

    kw: dict[str, Any] = {}
    if isinstance(press, kvpress.DecodingPress):
        budget = press.target_size if budget is None else budget
        kw = dict(interval=int(press.compression_interval),
                  inputs_window=max(1, int(press.hidden_states_buffer_size)))
        every_step = True if every_step is None else every_step
        press = press.base_press
    elif isinstance(press, kvpress.KeyRerotationPress):
        kw = dict(rerotate=True)
        press = press.press
    if budget is None:
        raise ValueError(f"budget is required for {press_name(press)}: the entries kept per layer "
                         "(from_kvpress(press, budget=64))")
    return PressPolicy(press, budget=budget, sinks=sinks, protect=protect,
                       every_step=bool(every_step) if every_step is not None else False, **kw)
