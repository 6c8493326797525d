"""kvpress-style scorers as kvlab eviction policies: :class:`ScorerPolicy` wraps a score function.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.

A scorer is what NVIDIA kvpress's ``ScorerPress`` subclasses implement: an object with a method (or a
plain function)

    score(module, hidden_states, keys, values, attentions, kwargs) -> scores   # (B, H_kv, T)

higher = more important. kvlab calls it once per layer whose live set is over ``budget``, on that
layer's cache, with:

* ``module`` — the layer's attention module of the decoding model (``module.config``, ``head_dim``);
* ``hidden_states`` — ``None`` (a kvpress press gets the captured layer inputs and the kwargs kvpress's
  hooks pass instead: :mod:`kvlab.eviction.kvpress.call`);
* ``keys``, ``values`` — copies of the layer's cached entries, ``(1, H_kv, T, D)``, keys post-RoPE,
  in slot order (``B = 1``: every run, and every row of a batch, is its own batch-1 cache);
* ``attentions`` — ``None`` (as kvpress gets it under SDPA attention);
* ``kwargs`` — ``layer`` (its index), ``positions`` (``(T,)`` long, each entry's absolute position),
  ``step``, ``first`` (the run's first step: the cache holds the prefill), and, when the scorer says
  ``needs_attention``, ``attn``: the cache's attention statistics of this layer, each ``(T,)`` —
  ``acc`` (the mass the measured queries gave each entry, summed over queries, mean over heads),
  ``ema``, ``count`` (see :mod:`kvlab.eviction.base`).

So a scorer that reads keys or values (kvpress's ``KnormPress``) runs unchanged; one that recomputes
attention from ``hidden_states`` (kvpress's ``SnapKVPress``) reads ``kwargs["attn"]`` instead, which
the cache measures for it: a scorer's ``needs_attention`` / ``attention_window`` / ``attention_pool`` /
``ema_decay`` reach the cache through the policy (:mod:`kvlab.eviction.scorers` has both examples).

Decision, per layer ``l`` over ``budget`` entries (the others keep everything): the scores are checked
to be ``(1, H_kv, T_l)`` (``ValueError`` naming the scorer otherwise) and averaged over KV heads — kvpress
keeps a top-k per head, kvlab's cache keeps one live set per layer — then the layer keeps its first
``sinks`` positions (attention sinks), its newest ``protect`` entries and the ``budget - sinks - protect``
others with the highest head-mean score (ties: the newer entry), ``budget`` in all
(:class:`~kvlab.eviction.ranked.RankedEviction`, H2O's per-layer rule). ``every_step=False`` (the
default, kvpress's use) cuts once, on the run's first step, when the cache holds the prefill (prompt
compression); ``every_step=True`` cuts at every step that ends over budget (decode-time eviction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.eviction.base import (EvictView, RankedEviction, check_bool, check_sinks, layer_rows, nonneg_int,
                                 positive_int)

SIGNATURE = "score(module, hidden_states, keys, values, attentions, kwargs) -> (B, H_kv, T)"


def scorer_name(scorer) -> str:
    """How errors name a scorer: its class (or function) name."""
    return getattr(scorer, "__qualname__", None) or type(scorer).__name__


def score_fn(scorer):
    """The scorer's score callable: its ``score`` method, or the scorer itself when it is a function."""
    fn = getattr(scorer, "score", None)
    if callable(fn):
        return fn
    if callable(scorer) and not isinstance(scorer, type):
        return scorer
    raise ValueError(f"scorer={scorer!r} needs a method {SIGNATURE} (kvpress's ScorerPress.score), or is that "
                     "function itself")


class ScoredEviction(RankedEviction):
    """The decision shared by :class:`ScorerPolicy` and the named scorer policies of
    :mod:`kvlab.eviction.scorers`; a subclass (a frozen dataclass) has ``scorer``, ``budget``,
    ``sinks``, ``protect`` and ``every_step``. A ranked policy
    (:class:`~kvlab.eviction.ranked.RankedEviction`) whose :meth:`score` is the scorer's head mean."""

    needs_kv = True
    newest_field = "protect"

    inputs_window = 128             # decode-time: the layer inputs a kvpress press sees (kvlab.cache.inputs)

    def check(self) -> None:
        if self.needs_inputs:       # a kvpress press: refuse a non-scorer before anything runs
            from kvlab.eviction.kvpress import check_press
            check_press(self.scorer, every_step=self.every_step)
        score_fn(self.scorer)
        positive_int("budget", self.budget)
        nonneg_int("protect", self.protect)
        check_sinks(self.sinks, "protect", self.protect, "budget", self.budget)
        check_bool("every_step", self.every_step)

    @property
    def needs_attention(self) -> bool:
        return bool(getattr(self.scorer, "needs_attention", False))

    @property
    def attention_window(self) -> int | None:
        return getattr(self.scorer, "attention_window", None)

    @property
    def attention_pool(self) -> int:
        return getattr(self.scorer, "attention_pool", 1)

    @property
    def ema_decay(self) -> float:
        return getattr(self.scorer, "ema_decay", 0.9)

    @property
    def needs_inputs(self) -> bool:
        """A kvpress press: the loop captures the attention layers' inputs for it (kvlab.eviction.kvpress)."""
        from kvlab.eviction.kvpress.detect import is_press
        return is_press(self.scorer)

    @property
    def needs_decode_inputs(self) -> bool:
        return self.needs_inputs and self.every_step

    def prepare(self, model) -> None:
        """Before the run's first forward: a kvpress press's ``post_init_from_model(model)``."""
        if self.needs_inputs:
            from kvlab.eviction.kvpress.call import prepare
            prepare(self.scorer, model)

    def layer_scores(self, view: EvictView, layer: int) -> torch.Tensor:
        """Layer ``layer``'s head-mean scores ``(T_l,)`` from the scorer (shape checked)."""
        if view.kv is None:
            raise ValueError(f"{type(self).__name__} needs the cache's keys and values, but the view has none: "
                             "build the EvictView with kv= (the decode loop does, since the policy needs_kv)")
        keys, values = view.kv(layer)                                             # (1, H_kv, T, D) each
        kwargs = {"layer": layer, "positions": torch.as_tensor(view.layer_positions[layer], dtype=torch.long),
                  "step": view.step, "first": view.first}
        if view.attn is not None:
            kwargs["attn"] = {name: layer_rows(view, name)[layer] for name in view.attn}
        module = view.modules[layer] if view.modules is not None else None
        hidden = attentions = None
        press = self.needs_inputs   # a kvpress press: what kvpress's own hooks would give it, inside a forward
        if press:
            from kvlab.eviction.kvpress.call import press_inputs
            module, hidden, attentions, kwargs = press_inputs(self.scorer, view, layer, module, keys, kwargs)
        with torch.inference_mode(press):
            scores = score_fn(self.scorer)(module, hidden, keys, values, attentions, kwargs)
        want = tuple(keys.shape[:3])
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"scorer {scorer_name(self.scorer)} returned {got} for layer {layer}; a scorer returns "
                             f"(B, H_kv, T) = {want}, one score per KV head and cached entry ({SIGNATURE})")
        return scores.detach().double().mean(dim=(0, 1))           # (T,) head mean; exact for a head-constant score

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        return self.layer_scores(view, layer)

    def due(self, view: EvictView) -> bool:
        """``every_step=False``: only the first step (prompt compression)."""
        return self.every_step or view.first


@dataclass(frozen=True)
class ScorerPolicy(ScoredEviction):
    """``scorer`` (kvpress-style, module docstring) as an eviction policy holding ``budget`` entries per
    layer: ``sinks`` first positions and the newest ``protect`` are never evicted; ``every_step=False``
    compresses the prompt once, ``True`` evicts at every step over budget. The run store's key names the
    scorer's class, its fields and, for a scorer defined outside kvlab, its code
    (:func:`kvlab.refresh.base.policy_dict`)."""

    scorer: Any
    budget: int
    sinks: int = 0
    protect: int = 0
    every_step: bool = False

    def __post_init__(self):
        self.check()
