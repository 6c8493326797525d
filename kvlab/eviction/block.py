"""Block-wise eviction with OpenVINO GenAI's semantics (seed 003; ``cache_eviction.cpp``, ``kvcrush.cpp``).
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache (``KVCache.evict``) removes and
re-rotates.

The cache is cut, by slot, into three areas of whole blocks of ``bs = block_size`` entries:

* start area: slots ``[0, S)``, ``S = start_blocks·bs`` — never evicted;
* evictable area: ``nb = ⌊(n - S - R)/bs⌋`` complete blocks from ``S`` on;
* recent area: the rest — the newest ``R = recent_blocks·bs`` slots plus the partial block
  before them (``n - S - R`` mod ``bs`` slots) — never evicted while there.

``max = S + evictable_blocks·bs + R``. **When**: nothing happens while ``n < max + bs`` (OpenVINO's
``get_max_cache_size_after_eviction() = max + bs - 1``: a whole block must overflow); then
``d = nb - evictable_blocks`` blocks go (floor counts), so the cache stays in ``[max, max + bs - 1]``.

**Scores** (per layer ``l``; :mod:`kvlab.cache` keeps them): ``acc_lj`` is the sum over measured
queries of the attention mass on entry ``j``, each query's mass max-pooled over the entry and the
next ``pool_window - 1`` entries (``attention_pool``, OpenVINO's pipeline: 7); the prefill
contributes only its last ``snapkv_window`` queries (``attention_window``: SnapKV, default 8).
``count_j`` is the entry's lifetime in measured queries (a prefill of L tokens registers
``min(L - j, window)``; each decode step adds 1). Block score:

* ``score="sum"``:      ``B_b = Σ_{j∈b} acc_lj``
* ``score="norm_sum"``: ``B_b = Σ_{j∈b} acc_lj / count_j`` (OpenVINO's default ``NORM_SUM``)

The ``d`` lowest-scoring blocks are evicted (ties: the older block goes first).

**KVCrush** (``kvcrush=k > 0``, applied only when ``d ≥ k``): per layer, the indicator of an entry
of the evictable area is 1 for the top half (``⌊E/2⌋``, ``E = nb·bs``) of entries by raw ``acc_lj``;
a block's pattern is its ``bs`` indicators. The anchor (``bs`` bits) is, by ``anchor``:
``"mean"`` — position-wise mean over ALL evictable blocks, ``> 0.5``; ``"alternate"`` — 0, 1, 0, …;
``"zeros"``; ``"ones"``; ``"random"`` — seeded by ``(seed, step)``. Candidates are the ``d`` blocks
the score evicted, sorted by Hamming distance to the anchor (nearest first, ties by block index);
``k`` of them at ranks ``0, s, 2s, …`` (``s = ⌊d/k⌋``) are kept — ON TOP of the budget, so the
cache may hold up to ``max + bs - 1 + k·bs`` entries.

**Layers.** OpenVINO decides per layer, and so does :meth:`BlockEvict.keep`: each layer scores
its own blocks from its own ``acc`` and ``count`` and evicts its own lowest-scoring ones (KVCrush
too: indicators, anchor and picks per layer) — :meth:`BlockEvict.layer_evicted` is one layer's
decision, returned together as ``Keep.layers``. Every layer evicts the same NUMBER of blocks (it
depends on the length only), so the layers keep equal lengths but different entries.

**Re-rotation** (``rerotate=True``, seed 003 ``apply_rotation``): after an eviction every survivor
of every layer moves to consecutive positions from the first survivor's (slot 0 — the start area —
keeps its position; the layers keep equal numbers of entries, so they end at the same position),
and the next query is renumbered to follow the last survivor
(:meth:`kvlab.cache.KVCache.evict`). OpenVINO re-bases the block rotation deltas from 0 in the same
way but keeps the new tokens' positions absolute, so there the next query stands ``evicted``
positions after the last cached key; in kvlab it stands right after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.decode.protocols import Kept
from kvlab.eviction.base import EvictView, Keep, keep_all, layer_rows, nonneg_int, per_layer, positive_int
from kvlab.core.registry import register_eviction

SCORES = ("sum", "norm_sum")
ANCHORS = ("mean", "alternate", "random", "zeros", "ones")


@register_eviction("block", order=5, knob="blocks", knob_max=512)
@dataclass(frozen=True)
class BlockEvict:
    block_size: int = 16
    start_blocks: int = 2          # 32 tokens (seed 003 default start_size)
    evictable_blocks: int = 32     # 512 tokens
    recent_blocks: int = 8         # 128 tokens
    score: str = "norm_sum"
    snapkv_window: int | None = 8  # prompt queries that score the prompt (None: all)
    pool_window: int = 7           # max-pooling of each query's mass over neighbouring entries
    rerotate: bool = False
    kvcrush: int = 0               # representative blocks kept on top of the budget
    anchor: str = "mean"
    seed: int = 0                  # for anchor="random"
    ema_decay: float = 0.9         # unused by the block scores; the cache's EMA needs a β

    def __post_init__(self):
        positive_int("block_size", self.block_size)
        positive_int("start_blocks", self.start_blocks)
        positive_int("evictable_blocks", self.evictable_blocks)
        positive_int("recent_blocks", self.recent_blocks)
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r} must be one of {SCORES}")
        if self.snapkv_window is not None:
            positive_int("snapkv_window", self.snapkv_window)
        positive_int("pool_window", self.pool_window)
        if not isinstance(self.rerotate, bool):
            raise ValueError(f"rerotate={self.rerotate!r} must be True or False")
        nonneg_int("kvcrush", self.kvcrush)
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor={self.anchor!r} must be one of {ANCHORS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @classmethod
    def from_sizes(cls, start_size: int, recent_size: int, max_cache_size: int, block_size: int = 16, **kw):
        """OpenVINO-style sizes in tokens; each must be a multiple of ``block_size``."""
        positive_int("block_size", block_size)
        for name, v in (("start_size", start_size), ("recent_size", recent_size), ("max_cache_size", max_cache_size)):
            positive_int(name, v)
            if v % block_size:
                raise ValueError(f"{name}={v} is not a multiple of block_size={block_size}; areas are whole blocks "
                                 f"(use {max(v - v % block_size, block_size)} or {v - v % block_size + block_size})")
        evictable = max_cache_size - start_size - recent_size
        if evictable <= 0:
            raise ValueError(f"max_cache_size={max_cache_size} leaves no evictable area after start_size={start_size} "
                             f"+ recent_size={recent_size}")
        return cls(block_size=block_size, start_blocks=start_size // block_size,
                   evictable_blocks=evictable // block_size, recent_blocks=recent_size // block_size, **kw)

    @classmethod
    def from_budget(cls, budget: int | None, *, block_size: int = 4, sinks: int | None = None,
                    recent: int | None = None, blocks: int | None = None, kvcrush: int = 0,
                    rerotate: bool = False) -> "BlockEvict":
        """Blocks of ``block_size``: a start area of ``max(1, sinks // block_size)`` blocks (1 without sinks),
        a recent area of ``max(1, recent // block_size)`` blocks (``recent`` default ``budget // 4``) and
        ``blocks`` evictable blocks — by default as many as keep ``max + block_size - 1 <= budget``
        (OpenVINO's semantics let the cache reach that before a whole block goes). ``blocks`` is the
        matched-memory solver's knob (the registry's ``knob="blocks"``)."""
        kw = {"kvcrush": kvcrush, "rerotate": rerotate} if (kvcrush or rerotate) else {}
        start = 1 if sinks is None else max(1, sinks // block_size)
        rb = max(1, (budget // 4 if recent is None else recent) // block_size)
        if blocks is not None:
            return cls(block_size=block_size, start_blocks=start, evictable_blocks=blocks, recent_blocks=rb, **kw)
        top = block_size * ((budget - block_size + 1) // block_size)
        return cls.from_sizes(start_size=start * block_size, recent_size=rb * block_size, max_cache_size=top,
                              block_size=block_size, **kw)

    @property
    def max_cache_size(self) -> int:
        return (self.start_blocks + self.evictable_blocks + self.recent_blocks) * self.block_size

    @property
    def max_after_eviction(self) -> int:
        """The most entries the cache holds after any step once the prompt is in:
        ``max + bs - 1`` plus the ``kvcrush`` representative blocks kept on top."""
        return self.max_cache_size + self.block_size - 1 + self.kvcrush * self.block_size

    @property
    def needs_attention(self) -> bool:
        return True

    @property
    def attention_window(self) -> int | None:
        return self.snapkv_window

    @property
    def attention_pool(self) -> int:
        return self.pool_window

    def areas(self, n: int) -> tuple[range, list[range], range]:
        """(start slots, complete evictable blocks, recent slots incl. the partial block) for length ``n``."""
        bs, s, nb = self.block_size, self.start_blocks * self.block_size, self.n_blocks(n)
        blocks = [range(s + i * bs, s + (i + 1) * bs) for i in range(nb)]
        return range(0, min(s, n)), blocks, range(min(s + nb * bs, n), n)

    def n_blocks(self, n: int) -> int:
        """``nb``: the complete evictable blocks at length ``n`` (``len(areas(n)[1])``)."""
        bs = self.block_size
        return max(n - self.start_blocks * bs - self.recent_blocks * bs, 0) // bs

    def n_evict(self, n: int) -> int:
        """Blocks the score evicts at length ``n``: 0 below ``max + bs``, else ``nb - evictable_blocks``."""
        if n < self.max_cache_size + self.block_size:
            return 0
        return self.n_blocks(n) - self.evictable_blocks

    # ------------------------------------------------------------------ the per-layer decision

    def block_scores(self, acc: torch.Tensor, count: torch.Tensor, nb: int) -> torch.Tensor:
        """``(..., nb)`` scores of the evictable blocks from ``acc``/``count`` ``(..., T)`` (one layer's, or every
        row's and layer's stacked)."""
        s, bs = self.start_blocks * self.block_size, self.block_size
        a = acc[..., s:s + nb * bs].double()
        if self.score == "norm_sum":
            a = a / count[..., s:s + nb * bs].double().clamp_min(1.0)
        return a.reshape(*a.shape[:-1], nb, bs).sum(-1)

    def anchor_bits(self, indicators: torch.Tensor, step: int) -> torch.Tensor:
        """``(bs,)`` anchor pattern from the ``(nb, bs)`` indicators of all evictable blocks."""
        bs = self.block_size
        if self.anchor == "mean":
            return (indicators.double().mean(0) > 0.5).long()
        if self.anchor == "alternate":
            return torch.arange(bs) % 2
        if self.anchor == "zeros":
            return torch.zeros(bs, dtype=torch.long)
        if self.anchor == "ones":
            return torch.ones(bs, dtype=torch.long)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, 2, (bs,), generator=gen)

    def kvcrush_keep(self, acc: torch.Tensor, evicted: list[int], nb: int, step: int) -> tuple[list[int], dict]:
        """KVCrush's representatives among ``evicted`` blocks (module docstring), and the pieces
        (indicators, anchor, Hamming distances, candidate order) for inspection."""
        s, bs = self.start_blocks * self.block_size, self.block_size
        e = nb * bs
        a = acc[s:s + e].double().cpu()                                         # one copy to the host
        order = torch.sort(-a, stable=True).indices                             # top half by raw score, ties by slot
        ind = torch.zeros(e, dtype=torch.long)
        ind[order[: e // 2]] = 1
        ind = ind.view(nb, bs)                                                  # (nb, bs)
        anchor = self.anchor_bits(ind, step)                                    # (bs,)
        dist = (ind != anchor).sum(1)                                           # (nb,) Hamming distance
        cand = sorted(evicted, key=lambda b: (int(dist[b]), b))                 # nearest first
        k = min(len(cand), self.kvcrush)
        stride = len(cand) // k
        picks = [cand[i * stride] for i in range(k)]
        return picks, {"indicators": ind, "anchor": anchor, "distance": dist, "candidates": cand}

    def layer_evicted(self, acc: torch.Tensor, count: torch.Tensor, n: int, step: int = 0) -> list[int]:
        """One layer's decision: indices (into the evictable blocks, ascending) of the blocks to
        evict at length ``n``, from that layer's ``acc`` and ``count`` ``(T,)``."""
        d = self.n_evict(n)
        if d <= 0:
            return []
        nb = self.n_blocks(n)
        scores = self.block_scores(acc, count, nb)
        # the d lowest blocks, ties by block index: one sort and one copy to the host (no per-block read-back)
        evicted = sorted(torch.sort(scores, stable=True).indices[:d].tolist())
        if self.kvcrush and len(evicted) >= self.kvcrush:
            kept, _ = self.kvcrush_keep(acc, evicted, nb, step)
            evicted = [b for b in evicted if b not in set(kept)]
        return evicted

    def kept_slots(self, evicted: list[int], n: int) -> Kept:
        """Slots ``0 .. n - 1`` without the ``evicted`` blocks' (read as the kept tuple; the cache gets the drops)."""
        s, bs = self.start_blocks * self.block_size, self.block_size
        return Kept(n, [s + b * bs + j for b in sorted(evicted) for j in range(bs)])

    def keep(self, view: EvictView) -> Keep:
        budget = self.max_cache_size
        lengths = [len(p) for p in view.layer_positions]
        if all(self.n_evict(n) <= 0 for n in lengths):
            return keep_all(view, budget=budget, rerotate=False)
        accs, counts = layer_rows(view, "acc"), layer_rows(view, "count")       # per layer (T_l,)
        kept = [self.kept_slots(self.layer_evicted(a.float(), c.float(), n, view.step), n)
                for a, c, n in zip(accs, counts, lengths)]
        evicted = any(len(k) < n for k, n in zip(kept, lengths))
        return per_layer(kept, budget=budget, rerotate=self.rerotate and evicted)

    # ------------------------------------------------------------------ over a resident bank's columns

    column_slots = True         # its areas are slot ranges: a resident bank keeps the slot order (ColumnView.order)

    @property
    def decides_columns(self) -> bool:
        """Block eviction decides over a resident bank's columns (:meth:`column_drop`) without KVCrush's
        representatives and without re-rotation."""
        return not self.kvcrush and not self.rerotate

    def column_capacity(self, num_layers: int) -> int:
        """A resident bank's columns per layer: ``max + bs`` (the most a layer holds after a step's append)."""
        return self.max_cache_size + self.block_size

    def column_drop(self, cols) -> torch.Tensor:
        """What :meth:`keep_rows` drops at this step, over a resident bank's columns (``cols.order``: slot order):
        the ``d`` lowest-scoring evictable blocks of every layer of every row (one stable sort over ``(L, B, nb)``),
        as an ``(L, B, C)`` bool mask. Every layer of every row holds the same number of entries."""
        if not self.decides_columns or cols.order is None:
            raise ValueError("block eviction decides over a resident bank's columns without kvcrush or rerotate, and "
                             "reads them in slot order: Resident(..., slots=True)")
        counts = cols.counts()
        n = int(counts[0, 0])
        if not bool((counts == n).all()):
            raise ValueError("block eviction over columns needs every layer of every row at one length")
        mask = torch.zeros(cols.live.shape, dtype=torch.bool, device=cols.live.device)
        d = self.n_evict(n)
        if d <= 0:
            return mask
        order = cols.order[..., :n]                                                      # (L, B, n) slot -> column
        acc = cols.stats["acc"].gather(2, order)
        count = cols.stats["count"].gather(2, order) if self.score == "norm_sum" else None
        low = torch.sort(self.block_scores(acc, count, self.n_blocks(n)), dim=-1, stable=True).indices[..., :d]
        s, bs = self.start_blocks * self.block_size, self.block_size
        slots = (s + low[..., None] * bs + torch.arange(bs, device=low.device)).flatten(2)  # (L, B, d·bs)
        return mask.scatter_(2, order.gather(2, slots), True)

    def keep_rows(self, views) -> list[Keep]:
        """:meth:`keep` of each of ``views`` (the rows of a batch), the same decisions: when every row and layer
        holds ``n`` entries and blocks go, every layer's block scores of every row are one ``(R, L, nb)`` tensor
        and one stable sort (no per-layer work); KVCrush's representatives and unequal lengths decide row by row."""
        lengths = {len(p) for v in views for p in v.layer_positions}
        n = next(iter(lengths)) if len(lengths) == 1 else None
        d = self.n_evict(n) if n is not None else 0
        if not views or self.kvcrush or d <= 0:
            return [self.keep(v) for v in views]
        stacked = lambda name: torch.stack([torch.stack(layer_rows(v, name)) for v in views]).float()  # noqa: E731
        scores = self.block_scores(stacked("acc"), stacked("count") if self.score == "norm_sum" else None,
                                   self.n_blocks(n))                                        # (R, L, nb)
        low = torch.sort(scores, dim=-1, stable=True).indices[..., :d].sort(-1).values.tolist()   # (R, L, d)
        return [per_layer([self.kept_slots(ev, n) for ev in rows], budget=self.max_cache_size,
                          rerotate=self.rerotate) for rows in low]
