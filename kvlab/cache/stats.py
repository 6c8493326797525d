"""Per-entry attention statistics of a :class:`~kvlab.cache.KVCache`, for eviction policies.

:class:`AttnStats` keeps, per live entry and layer, the accumulated attention mass (H2O), its EMA
(Conf-KV) and how many measured forwards saw the entry (NORM_SUM). It is edited by the cache in the
same call as the tensors and the live map (append, keep, remap, truncate), so its columns always
follow the live slots. The mass itself is measured by :class:`~kvlab.cache.attention.QueryCapture`.
"""
from __future__ import annotations

from typing import Sequence

import torch


class AttnStats:
    """``data["acc"]`` (L, T), ``data["ema"]`` (L, T), ``data["count"]`` (T,), on one device.

    ``window``: only the last ``window`` queries of a forward are measured (None: all);
    ``pool``: each forward's mass is max-pooled over this many entries (see
    :meth:`kvlab.cache.KVCache.track_attention`)."""

    def __init__(self, ema_decay: float, layers: int, n: int, device, window: int | None = None, pool: int = 1,
                 below: bool = False):
        self.ema_decay = float(ema_decay)
        self.window, self.pool, self.below = window, pool, below
        self.data: dict[str, torch.Tensor] = {
            "acc": torch.zeros(layers, n, device=device), "ema": torch.zeros(layers, n, device=device),
            "count": torch.zeros(n, device=device)}
        if below:                              # Scissorhands: measured queries that gave the entry < 1/T
            self.data["low"] = torch.zeros(layers, n, device=device)

    def check(self, n: int) -> None:
        for name, t in self.data.items():
            if t.shape[-1] != n:
                raise AssertionError(f"attention stat {name!r} has {t.shape[-1]} entries, live map {n}")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    def copy(self) -> "AttnStats":
        new = AttnStats.__new__(AttnStats)
        new.ema_decay, new.window, new.pool, new.below = self.ema_decay, self.window, self.pool, self.below
        new.data = {k: t.clone() for k, t in self.data.items()}
        return new

    def append(self, n: int, layers: int, mass: torch.Tensor | None, low: torch.Tensor | None = None) -> None:
        """``n`` new entries (zeros), then fold in one forward's ``mass`` (L, T) if measured (and,
        when tracked, its ``low`` counts (L, T))."""
        a = self.data
        dev = a["acc"].device
        if a["acc"].shape[0] != layers:        # tracking started on an empty cache
            for k in ("acc", "ema", "low"):
                if k in a:
                    a[k] = torch.zeros(layers, a[k].shape[1], device=dev)
        acc = torch.cat([a["acc"], torch.zeros(layers, n, device=dev)], dim=1)
        ema = torch.cat([a["ema"], torch.zeros(layers, n, device=dev)], dim=1)
        count = torch.cat([a["count"], torch.zeros(n, device=dev)])
        if mass is not None:
            mass = max_pool_next(mass.to(dev), self.pool)                          # (L, T)
            acc = acc + mass
            ema = self.ema_decay * ema + (1.0 - self.ema_decay) * mass
            count = count + lifetime_increment(count.shape[0], n, self.window).to(dev)
        self.data = {"acc": acc, "ema": ema, "count": count}
        if "low" in a:
            lo = torch.cat([a["low"], torch.zeros(layers, n, device=dev)], dim=1)
            self.data["low"] = lo + low.to(dev) if (mass is not None and low is not None) else lo

    def keep(self, keep: Sequence[int] | torch.Tensor) -> None:
        """Keep the columns ``keep`` (slots, in order)."""
        dev = self.data["count"].device
        idx = keep.to(dev) if isinstance(keep, torch.Tensor) else torch.tensor(list(keep), dtype=torch.long, device=dev)
        self.data = {k: t.index_select(t.dim() - 1, idx) for k, t in self.data.items()}

    def remap(self, idx: Sequence[int]) -> None:
        """Stats for a new slot order: ``idx[s]`` = old slot, or -1 for a new entry (zeros)."""
        dev = self.data["count"].device
        src = torch.tensor([max(i, 0) for i in idx], dtype=torch.long, device=dev)
        new = torch.tensor([i < 0 for i in idx], dtype=torch.bool, device=dev)
        self.data = {k: t[..., src].masked_fill(new, 0.0) for k, t in self.data.items()}

    def per_layer(self, layers: int) -> dict[str, tuple[torch.Tensor, ...]]:
        """``{name: (t_0, …, t_{L-1})}``, ``t_l`` (T,) (views)."""
        a = self.data
        if a["acc"].shape[0] != layers:        # tracked on an empty cache, nothing written yet
            return {k: (a["count"],) * layers for k in a}
        out = {"acc": tuple(a["acc"].unbind(0)), "ema": tuple(a["ema"].unbind(0)), "count": (a["count"],) * layers}
        if "low" in a:
            out["low"] = tuple(a["low"].unbind(0))
        return out

    def truncate(self, n: int) -> None:
        self.data = {k: t[..., :n] for k, t in self.data.items()}


def lifetime_increment(t: int, n: int, window: int | None) -> torch.Tensor:
    """``(t,)``: how many of a forward's measured queries see each entry — the last ``n`` of the
    ``t`` entries are the forward's own tokens (causal: new token ``i`` is seen by ``n - i``
    queries), only the last ``window`` queries are measured (``None``: all)."""
    w = n if window is None else min(window, n)
    inc = torch.full((t,), float(w))
    inc[t - n:] = torch.clamp(torch.arange(n, 0, -1, dtype=torch.float32), max=float(w))
    return inc


def max_pool_next(mass: torch.Tensor, pool: int) -> torch.Tensor:
    """``(L, T)`` → ``(L, T)``: ``out_j = max(mass_j … mass_{j+pool-1})`` (the window is cut at the end)."""
    if pool <= 1 or mass.shape[-1] == 0:
        return mass
    padded = torch.nn.functional.pad(mass.unsqueeze(1), (0, pool - 1), value=float("-inf"))  # (L, 1, T+pool-1)
    return torch.nn.functional.max_pool1d(padded, pool, stride=1).squeeze(1)
