"""The ranking the ranked policies share (:mod:`kvlab.eviction.ranked`, which re-exports it): per layer, the
top-k of a policy's scores around the sinks and the newest window, ties to the newer slot.

:func:`top_and_recent_layers` ranks one row's layers; :func:`rank_plans` ranks the :class:`Plan` s of every row
of a batch at once (:meth:`~kvlab.eviction.ranked.RankedEviction.keep_rows`): the over-budget layers of all rows
grouped by (sinks, budget, length), one batched threshold (few drops: :func:`_bottom_rows`) or sort
(:func:`_top_rows`) and one host transfer per group — a row's ``(L, T)`` score matrix enters as one block. Row
by row, the same decisions. Decisions only: nothing here edits a cache.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from kvlab.decode.protocols import Keep, Kept



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
    if d == 1:                                                                      # the usual step: one drop
        return x.argmin(dim=1, keepdim=True)                                        # the first (oldest) lowest
    t = torch.topk(x, d, dim=1, largest=False).values[:, -1:]                      # (L, 1) the d-th lowest
    less = x < t
    eq = x == t
    need = d - less.sum(1, keepdim=True)                                            # how many ties go
    drop = less | (eq & (eq.cumsum(1) <= need))
    return drop.nonzero()[:, 1].view(x.shape[0], d)                                 # row-major: sorted per row


def drop_lowest(score: torch.Tensor, protected: torch.Tensor, key: torch.Tensor,
                k: torch.Tensor | None = None) -> torch.Tensor:
    """Per layer and row of a resident bank (:class:`kvlab.cache.resident.ColumnView`: ``(L, B, C)`` tensors), the
    ``k[l, b]`` columns (``(L, B)``; None: one each) of the lowest ``score`` among those not ``protected``, ties: the
    lowest ``key`` (the oldest slot) first, as :func:`_bottom_rows`. One drop per layer and row: ``(L, B)`` long
    columns (one masked ``argmin``); otherwise an ``(L, B, C)`` bool mask (one sort by key, one stable sort by score)."""
    s = score.float().masked_fill(protected, float("inf"))
    one = k is None or (int(k.min()) == 1 and int(k.max()) == 1)
    if one:
        low = s.amin(-1, keepdim=True)                                              # (L, B, 1)
        return torch.where(s == low, key, torch.iinfo(key.dtype).max).argmin(-1)    # (L, B) the oldest lowest
    if int(k.max()) <= 0:
        return torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    by_key = key.argsort(-1)                                                        # oldest first
    order = by_key.gather(-1, s.gather(-1, by_key).argsort(dim=-1, stable=True))        # (L, B, C) drop order
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return rank < k[..., None]


def masked_minmax(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`minmax` along the last dim over the entries ``keep`` (bool, same shape) only: the same numbers there
    (0 where they are all equal); elsewhere undefined."""
    out = ~keep
    lo = x.masked_fill(out, float("inf")).amin(-1, keepdim=True)
    span = x.masked_fill(out, float("-inf")).amax(-1, keepdim=True) - lo
    if bool((span > 0).all()):                     # (L, B, 1): no row all equal, no where over the whole tensor
        return (x - lo) / span.clamp_min(1e-30)
    return torch.where(span > 0, (x - lo) / span.clamp_min(1e-30), torch.zeros_like(x))


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


def per_layer(kept: Sequence[Sequence[int]], **kw) -> Keep:
    """A per-layer decision (``kept[l]``: layer ``l``'s kept slots) as a :class:`Keep`: ``slots`` are
    layer 0's, ``layers`` all of them."""
    layers = tuple(k if isinstance(k, Kept) else tuple(k) for k in kept)
    return Keep(layers[0], layers=layers, **kw)
