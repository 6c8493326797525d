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

from dataclasses import dataclass, replace
from typing import Any

from kvlab.eviction.base import EvictView, Keep, check_bool, keep_all, positive_int
from kvlab.eviction.scorer import ScoredEviction

from .detect import is_press, press_name
from .support import check_press


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
        decision = super().keep(view)
        return replace(decision, rerotate=True) if self.rerotate else decision


def from_kvpress(press, budget: int | None = None, *, sinks: int = 0, protect: int = 0,
                 every_step: bool | None = None) -> PressPolicy:
    """``press`` (a kvpress press object, used as is) as a kvlab eviction policy (module docstring).
    ``budget``: entries kept per layer (required except for a ``DecodingPress``, whose ``target_size`` it
    defaults to). ``every_step``: evict at decode time too (default: False, or True for a DecodingPress)."""
    if not is_press(press):
        raise ValueError(f"press={press!r} is not a kvpress press (an instance of a kvpress class); a plain score "
                         "function goes to kvlab.ScorerPolicy(scorer, budget=...)")
    check_press(press, via="from_kvpress")
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
