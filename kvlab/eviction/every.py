"""Any eviction policy, asked every N-th step instead of every step: kvpress's ``DecodingPress``, which compresses
the cache every ``compression_interval`` decode steps down to its target size.

``Every(H2O(budget=1024), every=16)`` decides as H2O does, but the decode loop asks it only at the run's first step
and every 16th step after it (the protocol attribute ``every``, :data:`kvlab.decode.protocols.EVICT_ATTRS`); in
between the loop builds no view, decides nothing and edits nothing, so the cache grows by up to 15 entries past the
budget and the next cut takes them all out at once (the policy ranks as always; a cut of 16 costs about what a cut of
one does). What a step saves is the per-row decision and cache edit; the attention statistics a policy ranks by are
still measured at every step. The mean live length rises by about ``(every - 1) / 2`` entries: compare at matched
mean memory. Every other attribute the loop reads (``needs_attention``, ``ema_decay``, ``budget``, ...) is the
wrapped policy's. Decides only: nothing here edits a cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvlab.decode.protocols import EvictView, Keep, keep_rows as _keep_rows


@dataclass(frozen=True)
class Every:
    """``inner`` (a policy) asked at the run's first step and every ``every``-th step after it (module docstring)."""

    inner: Any                  # the policy asked (named ``inner``: a run key's ``policy`` names this class)
    every: int = 16

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every={self.every!r} must be an int >= 1 (the policy decides every N-th step)")
        if not callable(getattr(self.inner, "keep", None)):
            raise ValueError(f"inner={self.inner!r} needs a keep(view) -> Keep method (an eviction policy)")
        if isinstance(self.inner, Every):
            raise ValueError("inner is already an Every: give one Every its interval (every=) instead of nesting")

    decides_columns = False     # asked every N-th step: not the one drop per step a resident bank takes

    def __getattr__(self, name: str):
        if name in ("inner", "every") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)           # the protocol's optional attributes: the wrapped policy's

    def keep(self, view: EvictView) -> Keep:
        return self.inner.keep(view)

    def keep_rows(self, views: Sequence[EvictView]) -> list[Keep]:
        """The wrapped policy's decisions for a batch's rows (its own batched ranking when it has one)."""
        return _keep_rows(self.inner, views)
