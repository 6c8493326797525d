"""Cache-eviction policies: frozen dataclasses that decide only, one file each.

The protocol (``keep(view) -> Keep`` and the optional ``needs_attention`` / ``ema_decay`` /
``rerotate`` attributes) is in :mod:`kvlab.eviction.base`; the decode loop applies decisions
through :meth:`kvlab.cache.KVCache.evict` (``DecodeConfig(evict=...)``).
"""
from .base import EvictView, Keep, drawn_stats, validate_evict
from .block import BlockEvict
from .confkv import ConfKV, confidence, pyramid_weights
from .full import FullCache
from .h2o import H2O
from .pyramidkv import PyramidKV
from .random_evict import RandomEvict
from .scissorhands import Scissorhands
from .sliding import SlidingWindow
from .snapkv import SnapKV

EVICTION_POLICIES: dict[str, type] = {
    "full": FullCache,
    "sliding": SlidingWindow,
    "h2o": H2O,
    "random": RandomEvict,
    "confkv": ConfKV,
    "block": BlockEvict,
    "snapkv": SnapKV,
    "scissorhands": Scissorhands,
    "pyramidkv": PyramidKV,
}

__all__ = ["EVICTION_POLICIES", "BlockEvict", "ConfKV", "EvictView", "FullCache", "H2O", "Keep", "PyramidKV",
           "RandomEvict", "Scissorhands", "SlidingWindow", "SnapKV", "confidence", "drawn_stats", "pyramid_weights",
           "validate_evict"]
