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

The ranking helpers below (:func:`top_slots`, :func:`top_slots_layers`, :func:`top_and_recent_layers`,
:func:`sink_counts`, :func:`layer_rows`, :func:`layer_stat`, ...) are re-exported by
:mod:`kvlab.eviction.base`. Decisions only: nothing here edits a cache.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from kvlab.decode.protocols import EvictView, Keep, Kept, keep_all

# --------------------------------------------------------------------------- ranking helpers


def minmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``(x - min) / (max - min)`` along ``dim``; 0 where max == min."""
    lo = x.amin(dim=dim, keepdim=True)
    span = x.amax(dim=dim, keepdim=True) - lo
    return torch.where(span > 0, (x - lo) / span.clamp_min(1e-30), torch.zeros_like(x))


def top_slots(scores: torch.Tensor, candidates: list[int], k: int) -> list[int]:
    """The ``k`` candidates with the highest ``scores`` (one per candidate); ties go to the later slot."""
    if k <= 0:
        return []
    if k >= len(candidates):
        return list(candidates)
    cand = torch.as_tensor(candidates, dtype=torch.long)
    by_slot = torch.argsort(cand, descending=True)                          # newer slots first ...
    order = torch.argsort(scores.detach().float().cpu()[by_slot], descending=True, stable=True)  # ... among equal scores
    return sorted(cand[by_slot[order[:k]]].tolist())


def _top_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` ``(L, m)``: per row, the ``k`` highest columns (ties: the later column), sorted ascending,
    ``(L, k)`` long on ``x``'s device. One stable sort for all rows."""
    m = x.shape[1]
    order = torch.argsort(x.flip(1), dim=1, descending=True, stable=True)[:, :k]   # newer slots first among ties
    return (m - 1 - order).sort(dim=1).values


def _bottom_rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` ``(L, m)``: per row, the ``d`` columns :func:`_top_rows` leaves out when it keeps ``m - d`` (the lowest;
    ties: the older column goes first), sorted ascending, ``(L, d)``. O(m) per row: the ``d``-th lowest value by
    ``topk``, then every column below it and the oldest columns equal to it."""
    t = torch.topk(x, d, dim=1, largest=False).values[:, -1:]                      # (L, 1) the d-th lowest
    less = x < t
    eq = x == t
    need = d - less.sum(1, keepdim=True)                                            # how many ties go
    drop = less | (eq & (eq.cumsum(1) <= need))
    return drop.nonzero()[:, 1].view(x.shape[0], d)                                 # row-major: sorted per row


def top_slots_layers(scores: Sequence[torch.Tensor], k: int) -> list[list[int]]:
    """Per layer, :func:`top_slots` over the contiguous candidates ``0 .. m_l - 1`` of ``scores[l]``
    ``(m_l,)``: the ``k`` highest, ties to the later slot, sorted. One batched sort on the scores'
    device and one host transfer when every layer has the same ``m`` (the usual case: the same
    number of entries per layer), else layer by layer."""
    ms = {int(s.numel()) for s in scores}
    if len(ms) != 1:
        return [top_slots(s, list(range(int(s.numel()))), k) for s in scores]
    m = ms.pop()
    if k <= 0:
        return [[] for _ in scores]
    if k >= m:
        return [list(range(m)) for _ in scores]
    return _top_rows(_stack_scores(scores), k).cpu().tolist()


def _stack_scores(scores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Equal-length per-layer scores as one float ``(L, m)`` tensor (on the first one's device)."""
    dev = scores[0].device
    return torch.stack([s.detach().to(dev).float().reshape(-1) for s in scores])


def top_and_recent_layers(scores: Sequence[torch.Tensor | None], lengths: Sequence[int], budget: int | Sequence[int],
                          recent: int, sinks: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Per layer ``l`` holding ``lengths[l]`` entries under its budget ``b_l`` (``budget``, or
    ``budget[l]`` per layer): every slot when within ``b_l``, else its first ``sinks[l]`` slots
    (attention sinks, :func:`sink_counts`; none by default), its newest ``recent`` slots and the
    ``b_l - recent - sinks[l]`` others with the highest ``scores[l]`` (ties: newer) — the ranked
    policies' per-layer rule, with the over-budget layers ranked by one batched sort (and one host
    transfer) per (sink count, budget, length). ``scores[l]`` is read only for an over-budget layer."""
    sinks = [0] * len(lengths) if sinks is None else list(sinks)
    budgets = [budget] * len(lengths) if isinstance(budget, int) else list(budget)
    over = [l for l, n in enumerate(lengths) if n > budgets[l]]
    kept: list = [None] * len(lengths)
    for l, kp in zip(over, rank_items([(scores[l], lengths[l], budgets[l], recent, sinks[l]) for l in over])):
        kept[l] = kp
    return [tuple(range(n)) if kp is None else kp for kp, n in zip(kept, lengths)]


def rank_items(items: Sequence[tuple]) -> list:
    """The kept slots of each over-budget item ``(scores, n, budget, recent, sinks)`` — one layer of one row:
    :func:`top_and_recent_layers`' rule. ``scores`` ``(T,)``, or ``(G, T)``: a block of ``G`` layers alike
    (then the item's answer is a list of ``G`` kept-slot sequences). Items alike in ``(sinks, budget, n,
    recent)`` are ranked together, one batched sort (or threshold) and one host transfer per group, whichever
    rows and layers they come from: a batch's decisions (:func:`rank_plans`) cost one ranking per group, not
    one per row."""
    kept: list = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for j, (_, n, b, r, s) in enumerate(items):
        groups.setdefault((s, b, n, r), []).append(j)
    for (s, b, n, recent), js in sorted(groups.items()):
        blocks = [items[j][0][..., s: n - recent] for j in js]
        sizes = [x.shape[0] if x.dim() == 2 else 0 for x in blocks]         # 0: one layer's (m,) scores
        k = b - recent - s
        got = _rank_group(blocks, n, k, s, recent)
        at = 0
        for j, g in zip(js, sizes):
            kept[j] = got[at: at + g] if g else got[at]
            at += max(g, 1)
    return kept


def _rank_group(blocks: list[torch.Tensor], n: int, k: int, s: int, recent: int) -> list:
    """One group of :func:`rank_items`: ``blocks`` (each ``(m,)`` or ``(G, m)``: candidates' scores) -> one
    kept-slot sequence per row, in order."""
    if len({int(x.shape[-1]) for x in blocks}) != 1:          # scores of unequal length: one by one
        rows = [r for x in blocks for r in (x.unbind(0) if x.dim() == 2 else (x,))]
        return [tuple(range(s)) + tuple(t + s for t in top) + tuple(range(n - recent, n))
                for top in top_slots_layers(rows, k)]
    m = int(blocks[0].shape[-1])
    R = sum(x.shape[0] if x.dim() == 2 else 1 for x in blocks)
    x = None
    if 0 < m - k <= k:                                        # few drops: name them (no kept tuples built)
        x = _stack_blocks(blocks)
        if not torch.isnan(x).any():
            return [Kept(n, d) for d in (_bottom_rows(x, m - k).cpu() + s).tolist()]
    if k <= 0:
        mid = torch.empty(R, 0, dtype=torch.long)
    elif k >= m:
        mid = torch.arange(s, s + m).expand(R, m)
    else:
        mid = _top_rows(x if x is not None else _stack_blocks(blocks), k).cpu() + s
    full = torch.cat([torch.arange(s).expand(R, s), mid, torch.arange(n - recent, n).expand(R, recent)], dim=1)
    return [tuple(row) for row in full.tolist()]


def _stack_blocks(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Equal-width score rows and ``(G, m)`` blocks as one float ``(R, m)`` tensor (on the first one's device)."""
    if len(blocks) == 1 and blocks[0].dim() == 2:
        return blocks[0].detach().float()
    if all(x.dim() == 2 for x in blocks):
        dev = blocks[0].device
        return torch.cat([x.detach().to(dev).float() for x in blocks])
    return _stack_scores([r for x in blocks for r in (x.unbind(0) if x.dim() == 2 else (x,))])


class Plan(NamedTuple):
    """A ranked policy's decision with the ranking left to do (:meth:`RankedEviction.plan`): per layer its
    ``scores`` (None within budget), ``lengths``, ``budgets``, ``sinks``; the newest ``recent`` kept; ``info``
    goes into the Keep. :func:`rank_plans` ranks many plans (a batch's rows) at once."""

    scores: list
    lengths: list[int]
    budgets: list[int]
    recent: int
    sinks: list[int]
    info: dict


def rank_plans(plans: Sequence) -> list[Keep]:
    """Each of ``plans`` (a :class:`Plan`, or a :class:`Keep` already decided) as its :class:`Keep`: the
    over-budget layers of every plan ranked together (:func:`rank_items`: one ranking per (sinks, budget,
    length) group for all rows and layers). Plan by plan, the same decisions as :func:`top_and_recent_layers`."""
    items, where = [], []
    for i, p in enumerate(plans):
        if not isinstance(p, Plan):
            continue
        L = len(p.lengths)
        if isinstance(p.scores, torch.Tensor) and p.scores.dim() == 2 and p.scores.shape[0] == L \
                and len({(n, b, s) for n, b, s in zip(p.lengths, p.budgets, p.sinks)}) == 1 \
                and p.lengths[0] > p.budgets[0]:                  # every layer alike and over: one block
            items.append((p.scores, p.lengths[0], p.budgets[0], p.recent, p.sinks[0]))
            where.append((i, None))
            continue
        for l, n in enumerate(p.lengths):
            if n > p.budgets[l]:
                items.append((p.scores[l], n, p.budgets[l], p.recent, p.sinks[l]))
                where.append((i, l))
    kept = {i: [None] * len(p.lengths) for i, p in enumerate(plans) if isinstance(p, Plan)}
    for (i, l), kp in zip(where, rank_items(items)):
        if l is None:
            kept[i] = list(kp)
        else:
            kept[i][l] = kp
    return [per_layer([tuple(range(n)) if kp is None else kp for kp, n in zip(kept[i], p.lengths)], **p.info)
            if isinstance(p, Plan) else p for i, p in enumerate(plans)]


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


def per_layer(kept: Sequence[Sequence[int]], **kw) -> Keep:
    """A per-layer decision (``kept[l]``: layer ``l``'s kept slots) as a :class:`Keep`: ``slots`` are
    layer 0's, ``layers`` all of them."""
    layers = tuple(k if isinstance(k, Kept) else tuple(k) for k in kept)
    return Keep(layers[0], layers=layers, **kw)


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
        (:func:`rank_plans`); the same decisions as ``keep`` row by row."""
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

    def rank_layer(self, scores: torch.Tensor, n: int, budget: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision: the slots it keeps of ``n`` under ``budget``, its first ``sinks`` slots
        sinks, ranked by ``scores`` ``(n,)`` (or the first ``n - newest`` of them)."""
        return top_and_recent_layers([scores], [n], budget, self.newest, [sinks])[0]
