"""Installed kvpress presses as menu entries (the playground's eviction menu, the cache inspector): each press
that runs here as a scorer and needs no download, named ``kvpress:<Class>``, and the policy an entry builds at a
budget. Nothing imports kvpress until a menu is listed or an entry is built.

    from kvlab.eviction.kvpress.menu import menu_entries, menu_policy
    menu_entries()                                   # ["kvpress:CURPress", ..., "kvpress:TOVAPress"] ([] without kvpress)
    menu_policy("kvpress:SnapKVPress", budget=64)    # ScorerPolicy(SnapKVPress(window_size=16), budget=64, sinks=4)
"""
from __future__ import annotations

PREFIX = "kvpress:"
# post_init_from_model downloads per-model data (offline here: its run stops with a ValueError naming the press)
DOWNLOADS = ("QFilterPress", "KVzapPress", "ExpectedAttentionStatsPress")
# settings other than kvpress's defaults: a 16-token observation window (kvpress's 64 swallows a short prompt),
# StreamingLLM's 4 sinks, a seeded RandomPress (a rerun keeps the same entries), CriticalKV around Knorm
OVERRIDES = {"SnapKVPress": {"window_size": 16}, "PyramidKVPress": {"window_size": 16},
             "StreamingLLMPress": {"n_sink": 4}, "RandomPress": {"seed": 0}}


def menu_entries() -> list[str]:
    """``kvpress:<Class>`` for every installed press that runs as a scorer and needs no download (sorted);
    ``[]`` when kvpress is not installed."""
    from kvlab.eviction.kvpress.support import installed_presses

    return [PREFIX + r["press"] for r in installed_presses() if r["runs"] == "scorer" and r["press"] not in DOWNLOADS]


def is_entry(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def make_press(name: str):
    """A fresh press for menu entry (or class name) ``name``, with :data:`OVERRIDES` on kvpress's defaults."""
    import kvpress

    cls_name = name[len(PREFIX):] if is_entry(name) else name
    cls = getattr(kvpress, cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"evict={name!r}: kvpress has no press {cls_name!r}; installed: {', '.join(menu_entries())}")
    if cls_name == "CriticalKVPress":
        return cls(kvpress.KnormPress())
    return cls(**OVERRIDES.get(cls_name, {}))


def menu_policy(name: str, budget: int, sinks: int = 4, every_step: bool = False):
    """Menu entry ``name`` as a kvlab eviction policy: ``ScorerPolicy(press, budget, sinks, every_step)``
    (``every_step=False``: prompt compression, kvpress's use; True: decode-time eviction)."""
    from kvlab.eviction.scorer import ScorerPolicy

    return ScorerPolicy(make_press(name), budget=budget, sinks=sinks, every_step=every_step)


__all__ = ["DOWNLOADS", "OVERRIDES", "PREFIX", "is_entry", "make_press", "menu_entries", "menu_policy"]
