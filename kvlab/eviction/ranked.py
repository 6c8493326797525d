"""Score and select apart, as NVIDIA kvpress does: :class:`RankedEviction` selects, a subclass scores.

A ranked policy is a frozen dataclass on :class:`RankedEviction` that says how much each entry is worth
to keep, one layer at a time::

    def score(self, view: EvictView, layer: int) -> torch.Tensor:    # (T_l,): higher = keep

and the base does the rest, the same for every policy (H2O, Scissorhands, SnapKV, PyramidKV, Conf-KV,
the kvpress-style scorers of :mod:`kvlab.eviction.scorer`). At a step where the policy is ``due``, every
layer ``l`` holding more than its budget ``b_l`` keeps

* its attention sinks: its first slots whose absolute position is below ``sinks`` (StreamingLLM;
  :func:`sink_counts`); they count against the budget;
* its newest ``w`` slots (the always-kept window: H2O's ``recent``, SnapKV's observation ``window``,
  Conf-KV's ``protect``; the field named by ``newest_field``);
* the ``b_l - w - sinks_l`` other slots with the highest ``score(view, l)`` (ties: the newer slot),
  ranked for all over-budget layers by one batched sort (:func:`top_and_recent_layers`);

and a layer within its budget keeps everything (only over-budget layers are scored). The decision is
per layer (``Keep.layers``; ``Keep.slots`` is layer 0's). What a subclass may override:

* ``score(view, layer)`` — required: ``(T_l,)``, or only its first ``T_l - newest`` entries. Only the
  candidates are read (the slots after the sinks and before the newest window,
  :meth:`RankedEviction.candidates`); a score that depends on which entries compete (Conf-KV's
  min–max over them, SnapKV's pool that stops at the window) reads them from there;
* ``scores_for(view, layers)`` — optional: ``score`` of several layers at once (default: layer by
  layer); Conf-KV normalizes all over-budget layers as one matrix. Same values as ``score``;
* ``budgets(view)`` — entries each layer keeps at this step (default ``budget`` on every layer;
  PyramidKV's pyramid; Conf-KV calls :meth:`RankedEviction.select` with its confidence-gated budget);
* ``due(view)`` — whether this step cuts at all (default every step; SnapKV and PyramidKV: the first,
  when the cache holds the prompt; the scorers: the first unless ``every_step``);
* ``newest_field`` (class attribute) — the field holding the always-kept newest window;
  ``sinks`` and ``per_layer`` are read as attributes (defaults 0 and True; a dataclass field overrides).

**One live set for all layers (``per_layer=False``).** Here, and only here: a policy with a
``per_layer`` field set to False ranks one live set for all layers on the layer mean — the same
slots on every layer, cut when layer 0 (the one live set) is over ``budgets(view)[0]``, ranked by
:meth:`RankedEviction.layer_mean_score` (default: the mean over layers of each layer's ``score`` of
the candidates; SnapKV pools the layer mean of its window mass instead). It needs a uniform cache
(ValueError otherwise) and returns ``Keep.layers = None``. H2O, Scissorhands, SnapKV and Conf-KV keep
the field (part of their run keys) to measure the difference from the per-layer decision.

The ranking helpers (:mod:`kvlab.eviction.ranking`: :func:`top_slots`, :func:`top_slots_layers`,
:func:`top_and_recent_layers`, the batch's :func:`rank_plans`) and the view readers below (:func:`sink_counts`,
:func:`layer_rows`, :func:`layer_stat`, ...) are re-exported by
:mod:`kvlab.eviction.base`. Decisions only: nothing here edits a cache.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvlab.decode.protocols import EvictView, Keep, keep_all
from kvlab.eviction.ranking import (Plan, _bottom_rows, _stack_scores, _top_rows, drop_lowest,  # noqa: F401
                                    masked_minmax, minmax, per_layer, rank_items, rank_plans,
                                    top_and_recent_layers, top_slots, top_slots_layers)

# --------------------------------------------------------------------------- reading the view

def layer_sinks(positions: Sequence[int], sinks: int) -> int:
    """How many of one layer's live slots (in position order) are attention sinks: position < ``sinks``."""
    return sum(1 for p in positions[:sinks] if p < sinks) if sinks else 0


def sink_counts(view: EvictView, sinks: int) -> list[int]:
    """Per layer, how many of its live slots are attention sinks: slots whose absolute position is
    below ``sinks`` (StreamingLLM: the first ``sinks`` positions are never evicted). Slots are in
    position order, so a layer's sinks are its first ``sink_counts[l]`` slots."""
    if not sinks:
        return [0] * view.num_layers
    return [layer_sinks(pos, sinks) for pos in view.layer_positions]


def layer_stat(view: EvictView, name: str) -> torch.Tensor:
    """``view.attn[name]`` as an ``(L, T)`` matrix, for policies that rank one live set for all layers.

    The per-layer sequence (entry ``l`` of shape ``(T_l,)``) is stacked; that needs every layer to
    hold the same live positions (``view.uniform``), else ValueError. A tensor already ``(L, T)``
    passes through, and a ``(T,)`` tensor (one row for all layers) is broadcast to ``(L, T)``."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor):
        return stat if stat.dim() == 2 else stat.view(1, -1).expand(view.num_layers, -1)
    if not view.uniform:
        raise ValueError(f"attn[{name!r}] differs per layer (per-layer live sets); this policy ranks one live set "
                         "for all layers — rank each layer's own slots and return Keep.layers instead")
    return torch.stack(list(stat))                                                # (L, T)


def layer_rows(view: EvictView, name: str) -> list[torch.Tensor]:
    """``view.attn[name]`` as one ``(T_l,)`` tensor per layer, for policies that decide per layer:
    a per-layer sequence as is, an ``(L, T)`` matrix split into its rows, a ``(T,)`` tensor (one row
    for all layers) shared."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor):
        return list(stat.unbind(0)) if stat.dim() == 2 else [stat] * view.num_layers
    return list(stat)


def layer_block(view: EvictView, name: str, layers: Sequence[int]) -> torch.Tensor | list[torch.Tensor]:
    """The rows ``layers`` of ``view.attn[name]``: an ``(len(layers), T)`` tensor when the view carries the
    statistic as one matrix (no per-layer work; the whole matrix itself when ``layers`` is every layer), else
    one ``(T_l,)`` tensor per layer (:func:`layer_row`)."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor) and stat.dim() == 2:
        if len(layers) == stat.shape[0] and list(layers) == list(range(stat.shape[0])):
            return stat
        return stat[torch.as_tensor(list(layers), dtype=torch.long, device=stat.device)]
    return [layer_row(view, name, l) for l in layers]


def layer_row(view: EvictView, name: str, layer: int) -> torch.Tensor:
    """Layer ``layer``'s row of ``view.attn[name]``, ``(T_l,)`` (:func:`layer_rows`' entry)."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor):
        return stat[layer] if stat.dim() == 2 else stat
    return stat[layer]


def over_budget(view: EvictView, budget: int, by_layer: bool = True) -> bool:
    """Some layer holds more than ``budget`` entries (``by_layer=False``: layer 0, the one live set)."""
    if not by_layer:
        return view.length > budget
    return any(len(p) > budget for p in view.layer_positions)


def layer_mean(stat: torch.Tensor, cols: list[int], weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers of ``stat`` (L, T) at columns ``cols`` (optionally layer-weighted) -> (len(cols),)."""
    x = stat[:, cols].float()
    if weights is None:
        return x.mean(0)
    w = weights.to(x.device, x.dtype).view(-1, 1)
    return (w * x).sum(0) / w.sum()


# --------------------------------------------------------------------------- the base class


class RankedEviction:
    """Budget, sinks, the always-kept newest window and the per-layer top-k around a subclass's
    ``score(view, layer) -> (T_l,)`` (module docstring). Not a dataclass: a subclass is a frozen
    dataclass whose fields are its own (and its run key)."""

    newest_field = "recent"         # the field holding the newest entries every layer keeps
    sinks = 0                       # attention sinks (a policy with a ``sinks`` field overrides)
    per_layer = True                # False: one live set for all layers, ranked on the layer mean

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        """Layer ``layer``'s entries, ``(T_l,)``: higher = keep. Only the candidates are read (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must define score(view, layer) -> (T_l,) scores")

    def scores_for(self, view: EvictView, layers: Sequence[int]) -> list[torch.Tensor] | torch.Tensor:
        """:meth:`score` of each of ``layers`` (the over-budget ones); a policy may compute them for all
        layers at once (Conf-KV) — the same values as ``score`` layer by layer — and return them as one
        ``(len(layers), T)`` matrix (H2O, Scissorhands, Conf-KV when the view carries its statistic as one)."""
        return [self.score(view, l) for l in layers]

    @property
    def newest(self) -> int:
        """The newest entries every layer keeps (the ``newest_field`` field)."""
        return getattr(self, self.newest_field)

    def budgets(self, view: EvictView) -> list[int]:
        """Entries each layer keeps at this step (default ``budget`` on every layer)."""
        return [self.budget] * view.num_layers

    def due(self, view: EvictView) -> bool:
        """Whether this step cuts (default every step)."""
        return True

    def candidates(self, view: EvictView, layer: int) -> tuple[int, int]:
        """``(lo, hi)``: layer ``layer``'s ranked slots are ``lo .. hi - 1`` (after its sinks, before its newest)."""
        pos = view.layer_positions[layer]
        return layer_sinks(pos, self.sinks), len(pos) - self.newest

    def keep(self, view: EvictView) -> Keep:
        return rank_plans([self.plan(view)])[0]

    def keep_rows(self, views: Sequence[EvictView]) -> list[Keep]:
        """:meth:`keep` of each of ``views`` (the rows of a batch), the rows' rankings done together
        (:func:`rank_plans`); the same decisions as ``keep`` row by row. A subclass that overrides ``keep``
        (rather than :meth:`plan`) decides by it, row by row."""
        if type(self).keep is not RankedEviction.keep:
            return [self.keep(v) for v in views]
        return rank_plans([self.plan(v) for v in views])

    def plan(self, view: EvictView) -> Keep | Plan:
        """The step's decision up to its ranking (a :class:`Plan`), or the decision itself (a Keep) when
        nothing is ranked. A subclass that sets its own budgets per step overrides this (Conf-KV)."""
        if not self.due(view):
            return keep_all(view, budget=self.budget)
        return self.plan_select(view, self.budgets(view), budget=self.budget)

    def select(self, view: EvictView, budgets: Sequence[int], **info) -> Keep:
        """The decision under per-layer ``budgets``; ``info`` (the step's budget, ...) goes into the Keep."""
        return rank_plans([self.plan_select(view, budgets, **info)])[0]

    def plan_select(self, view: EvictView, budgets: Sequence[int], **info) -> Keep | Plan:
        """:meth:`select` up to its ranking: a :class:`Plan` of the over-budget layers' scores (a Keep when
        none is over budget, or ``per_layer=False``)."""
        if not self.per_layer:
            return self.select_mean(view, budgets[0], info)
        lengths = [len(p) for p in view.layer_positions]
        if all(n <= b for n, b in zip(lengths, budgets)):
            return keep_all(view, **info)
        over = [l for l, (n, b) in enumerate(zip(lengths, budgets)) if n > b]
        got = self.scores_for(view, over)
        if isinstance(got, torch.Tensor) and len(over) == len(lengths):
            scores = got                                  # every layer's scores as one (L, T) matrix
        else:
            scores = [None] * len(lengths)
            for l, x in zip(over, got):
                scores[l] = x
        return Plan(scores, lengths, list(budgets), self.newest, sink_counts(view, self.sinks), info)

    def layer_mean_score(self, view: EvictView, lo: int, hi: int) -> torch.Tensor:
        """``per_layer=False``: the one live set's candidates ``lo .. hi - 1`` scored by the mean over
        layers of each layer's ``score``, ``(hi - lo,)``."""
        return torch.stack([self.score(view, l)[lo:hi].float() for l in range(view.num_layers)]).mean(0)

    def select_mean(self, view: EvictView, budget: int, info: dict) -> Keep:
        """``per_layer=False`` (module docstring): one live set for all layers, ranked on the layer mean."""
        n = view.length
        if n <= budget:
            return keep_all(view, **info)
        if not view.uniform:
            raise ValueError(f"{type(self).__name__}(per_layer=False) ranks one live set for all layers, but this "
                             "cache's live sets differ per layer: use per_layer=True")
        lo, hi = self.candidates(view, 0)
        kept = top_slots(self.layer_mean_score(view, lo, hi), list(range(lo, hi)), budget - self.newest - lo)
        return Keep(tuple(range(lo)) + tuple(kept) + tuple(range(hi, n)), **info)

    # ------------------------------------------------------------------ over a resident bank's columns

    def column_score(self, cols) -> torch.Tensor | None:
        """Every layer's scores over a resident bank's columns (:class:`kvlab.cache.resident.ColumnView`),
        ``(L, B, C)``, higher = keep: what :meth:`score` gives the same entries. None (the default): the policy does
        not decide over columns."""
        return None

    @property
    def decides_columns(self) -> bool:
        """Whether :meth:`column_drop` decides as :meth:`keep` does: a ``column_score`` of its own, per layer, and
        the base's budgets, due steps and planning (Conf-KV's confidence budgets, SnapKV's one cut do not)."""
        t, base = type(self), RankedEviction
        return bool(self.per_layer) and t.column_score is not base.column_score and all(
            getattr(t, m) is getattr(base, m) for m in ("plan", "keep", "keep_rows", "budgets", "due"))

    def column_drop(self, cols) -> torch.Tensor:
        """The entries each layer of each row of a resident bank drops at this step, down to ``budget`` (``(L, B)``
        long columns when every layer drops one, else an ``(L, B, C)`` bool mask): the lowest :meth:`column_score`
        after the sinks (positions below ``sinks``) and the newest window (the keys above ``newest_key - newest``),
        ties to the older slot — the entries :meth:`keep` drops."""
        if not self.decides_columns:
            raise ValueError(f"{type(self).__name__} does not decide over a resident bank's columns "
                             "(decides_columns is False): run it through keep / keep_rows")
        return self.column_select(cols, self.column_score(cols), torch.full_like(cols.key[..., 0], self.budget))

    def column_protected(self, cols) -> torch.Tensor:
        """``(L, B, C)`` bool: the columns no ranking may drop: free ones, the newest window, the sinks."""
        protected = ~cols.live | (cols.key > cols.newest_key - self.newest)
        return protected | (cols.positions < self.sinks) if self.sinks else protected

    def column_select(self, cols, score: torch.Tensor, budgets: torch.Tensor,
                      protected: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`column_drop` under ``budgets`` ``(L, B)`` (entries each layer of each row keeps) by ``score``
        (``protected``: :meth:`column_protected`, computed when None)."""
        protected = self.column_protected(cols) if protected is None else protected
        return drop_lowest(score, protected, cols.key, (cols.counts() - budgets).clamp_min(0))

    def rank_layer(self, scores: torch.Tensor, n: int, budget: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision: the slots it keeps of ``n`` under ``budget``, its first ``sinks`` slots
        sinks, ranked by ``scores`` ``(n,)`` (or the first ``n - newest`` of them)."""
        return top_and_recent_layers([scores], [n], budget, self.newest, [sinks])[0]
