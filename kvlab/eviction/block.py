"""Block-wise eviction (seed 003, OpenVINO GenAI ``CacheEvictionConfig``), with RoPE re-rotation and KVCrush.

The cache is cut, by slot, into three areas of whole blocks of ``block_size`` entries:

* start area: slots ``[0, S)``, ``S = start_blocks·bs`` — never evicted;
* recent area: the newest ``R = recent_blocks·bs`` slots — never evicted;
* evictable area: the slots between, ``E = n - S - R`` entries, cut into blocks from ``S`` on;
  only complete blocks may go (the partial block next to the recent area stays).

Nothing happens while ``n ≤ S + evictable_blocks·bs + R`` (the maximum after eviction). Beyond it,
``d = ⌈(E - evictable_blocks·bs) / bs⌉`` blocks are evicted. Block scores (H2O-style
accumulated attention, averaged over layers, ``a_j = mean_l acc_lj``):

* ``score="sum"``:      ``B_b = Σ_{j∈b} a_j``
* ``score="norm_sum"``: ``B_b = Σ_{j∈b} a_j / max(count_j, 1)`` (each entry's mass divided by how
  many measured steps it has been attended in, so old entries are not favoured by age alone).

The ``nb - d`` best blocks stay, or with ``kvcrush=k`` the ``nb - d - k`` best plus ``k``
representatives of the rest (KVCrush, anchor MEAN): each entry gets a binary indicator per layer
(``acc_lj >`` that layer's median over the evictable entries), a block's pattern is its
``(bs × L)`` indicators, the anchor is the mean pattern of the non-kept blocks rounded to {0, 1}, and
the ``k`` representatives are the non-kept blocks at evenly spaced ranks of Hamming distance to
the anchor (spanning near to far: context diversity).

``rerotate=True`` asks the cache to move survivors to consecutive positions after each eviction
by rotating their keys (seed 003 ``apply_rotation``; :meth:`kvlab.cache.KVCache.evict`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictView, Keep, keep_all, nonneg_int, positive_int

SCORES = ("sum", "norm_sum")


@dataclass(frozen=True)
class BlockEvict:
    block_size: int = 16
    start_blocks: int = 2
    evictable_blocks: int = 16
    recent_blocks: int = 4
    score: str = "sum"
    rerotate: bool = False
    kvcrush: int = 0
    ema_decay: float = 0.9        # unused by the block scores; the cache's EMA needs a β

    def __post_init__(self):
        positive_int("block_size", self.block_size)
        nonneg_int("start_blocks", self.start_blocks)
        positive_int("evictable_blocks", self.evictable_blocks)
        nonneg_int("recent_blocks", self.recent_blocks)
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r} must be one of {SCORES}")
        if not isinstance(self.rerotate, bool):
            raise ValueError(f"rerotate={self.rerotate!r} must be True or False")
        nonneg_int("kvcrush", self.kvcrush)
        if self.kvcrush >= self.evictable_blocks:
            raise ValueError(f"kvcrush={self.kvcrush} must be < evictable_blocks={self.evictable_blocks} "
                             "(representative blocks come out of the evictable area's budget)")

    @classmethod
    def from_sizes(cls, start_size: int, recent_size: int, max_cache_size: int, block_size: int = 16, **kw):
        """OpenVINO-style sizes in tokens; each must be a multiple of ``block_size``."""
        positive_int("block_size", block_size)
        for name, v in (("start_size", start_size), ("recent_size", recent_size), ("max_cache_size", max_cache_size)):
            nonneg_int(name, v)
            if v % block_size:
                raise ValueError(f"{name}={v} is not a multiple of block_size={block_size}; areas are whole blocks "
                                 f"(use {v - v % block_size} or {v - v % block_size + block_size})")
        evictable = max_cache_size - start_size - recent_size
        if evictable <= 0:
            raise ValueError(f"max_cache_size={max_cache_size} leaves no evictable area after start_size={start_size} "
                             f"+ recent_size={recent_size}")
        return cls(block_size=block_size, start_blocks=start_size // block_size,
                   evictable_blocks=evictable // block_size, recent_blocks=recent_size // block_size, **kw)

    @property
    def max_cache_size(self) -> int:
        return (self.start_blocks + self.evictable_blocks + self.recent_blocks) * self.block_size

    @property
    def needs_attention(self) -> bool:
        return True

    def areas(self, n: int) -> tuple[range, list[range], range]:
        """(start slots, complete evictable blocks, recent slots incl. the partial block) for length ``n``."""
        bs = self.block_size
        s, r = self.start_blocks * bs, self.recent_blocks * bs
        e = max(n - s - r, 0)
        nb = e // bs
        blocks = [range(s + i * bs, s + (i + 1) * bs) for i in range(nb)]
        return range(0, min(s, n)), blocks, range(min(s + nb * bs, n), n)

    def keep(self, view: EvictView) -> Keep:
        n, bs = view.length, self.block_size
        budget = self.max_cache_size
        if n <= budget:
            return keep_all(view, budget=budget, rerotate=False)
        start, blocks, _ = self.areas(n)
        e = n - self.start_blocks * bs - self.recent_blocks * bs
        d = -(-(e - self.evictable_blocks * bs) // bs)
        slots = [j for b in blocks for j in b]
        acc = view.attn["acc"][:, slots].float()                              # (L, E')
        tok = acc.mean(0)
        if self.score == "norm_sum":
            tok = tok / view.attn["count"][slots].float().clamp_min(1.0)
        block_score = tok.view(len(blocks), bs).sum(1)                        # (nb,)
        n_keep = len(blocks) - d
        k = min(self.kvcrush, n_keep)
        order = sorted(range(len(blocks)), key=lambda i: (float(block_score[i]), i), reverse=True)
        kept = order[: n_keep - k]
        if k:
            rest = sorted(order[n_keep - k:])
            bits = (acc > acc.median(dim=1, keepdim=True).values).view(acc.shape[0], len(blocks), bs)  # (L, nb, bs)
            pat = bits.permute(1, 0, 2).reshape(len(blocks), -1).float()      # (nb, L·bs)
            anchor = (pat[rest].mean(0) >= 0.5).float()
            dist = (pat[rest] != anchor).sum(1)
            by_dist = [rest[i] for i in sorted(range(len(rest)), key=lambda i: (int(dist[i]), rest[i]))]
            picks = torch.linspace(0, len(by_dist) - 1, k).round().long().tolist()
            chosen = []
            for p in picks:                                                    # distinct ranks
                while by_dist[p] in chosen:
                    p = (p + 1) % len(by_dist)
                chosen.append(by_dist[p])
            kept = kept + chosen
        keep_slots = set(start) | {j for i in kept for j in blocks[i]}
        keep_slots |= set(range(self.start_blocks * bs + len(blocks) * bs, n))
        return Keep(tuple(sorted(keep_slots)), budget=budget, rerotate=self.rerotate)
