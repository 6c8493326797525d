"""Full cache: never evicts (the reference every eviction policy is compared with).
A policy decides only; this one keeps everything.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.eviction.base import EvictView, Keep, keep_all
from kvlab.core.registry import register_eviction


@register_eviction("full", order=0, from_budget=lambda budget: FullCache())
@dataclass(frozen=True)
class FullCache:
    """Keeps every entry."""

    def keep(self, view: EvictView) -> Keep:
        return keep_all(view)
