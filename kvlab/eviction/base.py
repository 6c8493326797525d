"""What the eviction policies share, in one import: the protocol (``EvictView``, ``Keep``, the optional
attributes; the loop's, in :mod:`kvlab.decode.protocols`), the argument checks (:mod:`kvlab.eviction.checks`),
the ranked base class and its ranking helpers (:mod:`kvlab.eviction.ranked`), all re-exported here, and the
drawn distribution (:func:`drawn_stats`). Decisions and checks only: nothing here edits a cache.

An eviction policy is a frozen dataclass that decides only, with one method::

    keep(view: EvictView) -> Keep

and optional attributes the loop reads generically (no ``isinstance``): each is declared once, with its
default and meaning, in :data:`kvlab.decode.protocols.EVICT_ATTRS` (``needs_attention``, ``ema_decay``,
``rerotate``, the attention-statistics settings, ``needs_kv``, ``needs_inputs``, ``score_stat``, ``batchable``, ...)
and read through :func:`~kvlab.decode.protocols.evict_attr`.

Attention sinks: every ranking policy takes ``sinks=k`` (the first ``k`` positions are never
evicted, StreamingLLM; :func:`sink_counts`); sliding and block eviction keep theirs by default
(``SlidingWindow.sinks``, ``BlockEvict.start_blocks``).

The loop calls ``keep`` once per step, after the token was chosen (and after a refresh), and
removes every slot not kept through ``KVCache.evict`` (the cache module is the only thing that
edits tensors). ``Keep.int8_window`` asks the cache to store entries older than that window in
INT8 (``KVCache.quantize_older``).

Per-layer live sets. Every layer of the cache has its own live list (slot -> ledger row).
``EvictView.layer_positions[l]`` is the absolute position of each live slot of layer ``l``, and the
attention statistics are per layer: ``attn[name][l]`` is a ``(T_l,)`` tensor over layer ``l``'s
slots. A policy keeps slots per layer with ``Keep.layers`` (``layers[l]`` = kept slots of layer
``l``, indices into that layer's own live list); ``Keep.layers = None`` keeps ``Keep.slots`` on
every layer; with ``layers`` set, ``Keep.slots`` is layer 0's kept slots (:func:`per_layer`).
``view.positions`` / ``view.length`` are layer 0's. The attention-ranking policies (H2O,
Scissorhands, SnapKV, PyramidKV, Conf-KV, BlockEvict) decide per layer, each layer by its own
statistic (:func:`layer_rows`). H2O, Scissorhands, SnapKV, PyramidKV, Conf-KV and the kvpress-style
scorers are ranked policies: a ``score(view, layer)`` on :class:`~kvlab.eviction.ranked.RankedEviction`,
which does the budget, sinks, newest window and per-layer top-k, and (in one place) the ``per_layer=False``
variants of H2O, Scissorhands, SnapKV and Conf-KV: one live set for all layers ranked on the layer mean.
"""
from __future__ import annotations

import math

import torch

from kvlab.decode.protocols import (EVICT_ATTRS, EvictView, Keep, evict_attr,  # noqa: F401
                                    keep_all, validate_evict)
from kvlab.eviction.checks import (check_bool, check_observation_window, check_recent_budget,  # noqa: F401
                                   check_sinks, finite_float, nonneg_int, positive_int, protected_below, unit_float)
from kvlab.eviction.ranked import (Plan, RankedEviction, layer_block, layer_mean, layer_row, layer_rows,  # noqa: F401
                                   layer_sinks, layer_stat, minmax, over_budget, per_layer, rank_plans, sink_counts,
                                   top_and_recent_layers, top_slots, top_slots_layers)


# --------------------------------------------------------------------------- the drawn distribution


LN2 = math.log(2.0)


def drawn_stats(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[float, float, float]:
    """``(entropy_bits, top1_prob, margin)`` of the distribution a token is drawn from:
    ``softmax(logits / T)`` restricted to the top-p nucleus (the smallest prefix of the sorted
    probabilities reaching ``top_p``) and renormalized, as :func:`kvlab.decode.choose` samples it.
    Greedy (``T = 0``) draws the argmax of the model's own distribution: ``T = 1``, no nucleus."""
    t = 1.0 if temperature == 0 else float(temperature)
    p = torch.softmax(logits.float().reshape(-1) / t, dim=-1)                 # (V,)
    if temperature != 0 and top_p < 1.0:
        sp, _ = torch.sort(p, descending=True)
        keep = (torch.cumsum(sp, 0) - sp) < top_p
        p = sp[keep] / sp[keep].sum()
    ent = float(torch.special.entr(p).sum()) / LN2
    top = torch.topk(p, min(2, p.numel())).values.tolist() + [0.0]
    return ent, top[0], top[0] - top[1]
