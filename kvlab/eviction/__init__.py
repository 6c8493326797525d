"""Cache-eviction policies: frozen dataclasses that decide only, one file each.

The protocol (``keep(view) -> Keep`` and the optional ``needs_attention`` / ``ema_decay`` /
``rerotate`` / ``needs_kv`` attributes) is in :mod:`kvlab.eviction.base`; a ranked policy is a
``score(view, layer)`` on :class:`~kvlab.eviction.ranked.RankedEviction` (budget, sinks, newest window and
per-layer top-k are the base's: H2O, Scissorhands, SnapKV, PyramidKV, Conf-KV, the scorers); kvpress-style score
functions become policies through :class:`~kvlab.eviction.scorer.ScorerPolicy`; the decode loop applies decisions
through :meth:`kvlab.cache.KVCache.evict` (``DecodeConfig(evict=...)``).

:data:`EVICTION_POLICIES` is the one registry of eviction policies by name (sweeps, the playground, the
matched-memory table and the run store's rows read it): the built-ins below, plus a user's own class
registered with :func:`register_eviction` (docs/custom_policies.md).
"""
from kvlab.core.registry import EVICTION_POLICIES
from kvlab.eviction.base import EvictView, Keep, drawn_stats, validate_evict
from kvlab.eviction.block import BlockEvict
from kvlab.eviction.confkv import ConfKV, confidence, pyramid_weights
from kvlab.eviction.every import Every
from kvlab.eviction.full import FullCache
from kvlab.eviction.h2o import H2O
from kvlab.eviction.pyramidkv import PyramidKV
from kvlab.eviction.random_evict import RandomEvict
from kvlab.eviction.ranked import RankedEviction
from kvlab.eviction.scissorhands import Scissorhands
from kvlab.eviction.scorer import ScorerPolicy
from kvlab.eviction.scorers import KeyNorm, Knorm, SnapKVScorer, SnapKVWindow
from kvlab.eviction.sliding import SlidingWindow
from kvlab.eviction.streaming import StreamingLLM
from kvlab.eviction.snapkv import SnapKV

register_eviction = EVICTION_POLICIES.register        # @register_eviction("mine") on your class
unregister_eviction = EVICTION_POLICIES.unregister

__all__ = ["EVICTION_POLICIES", "register_eviction", "unregister_eviction", "BlockEvict", "ConfKV", "EvictView", "Every", "FullCache", "H2O", "Keep", "PyramidKV",
           "RandomEvict", "RankedEviction", "Scissorhands", "SlidingWindow", "SnapKV", "StreamingLLM", "confidence", "drawn_stats", "pyramid_weights",
           "validate_evict", "ScorerPolicy", "KeyNorm", "Knorm", "SnapKVScorer", "SnapKVWindow"]
