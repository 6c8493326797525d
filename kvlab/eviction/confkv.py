"""Conf-KV: confidence-aware eviction (seed 002). The paper's symbols were lost; these are the forms chosen.

**Confidence** of step ``t`` from a next-token distribution ``p`` (vocabulary size ``V``; its
entropy, top-1 probability and probability margin). ``confidence_from="raw"`` (default; the paper's
"Let z be the logits and p the next-token distribution"): ``p = softmax(z)``, the model's own
untempered distribution (the step record's statistics); ``"drawn"``: the distribution ``y_t`` was
drawn from, ``softmax(z / T)`` restricted to the top-p nucleus and renormalized
(:func:`kvlab.eviction.base.drawn_stats`; greedy runs use ``T = 1``, no nucleus) — kept as the
measured alternative (a nucleus that holds one token gives ``c = σ(8) = 0.99966`` whatever the
model's own spread, which saturates the schedule):

    H̃ = H(p) / ln V                           normalized entropy ∈ [0, 1]
    m  = min(ln p₁ - ln p₂, 10)                 log-probability margin (nats, clipped)
    c  = σ(w_h·(1 - H̃) + w_m·m + w_p·p₁ + b)    σ = logistic sigmoid

with defaults ``w_h = 3, w_m = 0.5, w_p = 3, b = -3`` (a flat distribution gives c ≈ 0.05, a
peaked one c > 0.99).

**Budget**: ``B_t = tight if c ≥ γ else loose`` (confident steps prune to the tight budget). The
cache is cut to ``B_t`` at every step, so it grows by one entry per uncertain step until it reaches
``loose`` and falls back to ``tight`` on the next confident step: the sawtooth. ``γ = 0`` makes every
step confident: Conf-KV's ranker at the fixed budget ``tight`` (the study's ``confkv_fixed`` control).

**Ranker** over the non-protected candidates ``j`` (all slots but the newest ``protect`` and the
``sinks``) of layer ``l``:

    â_lj = minmax_j(ema_lj)        EMA attention mass, ema ← β·ema + (1-β)·mean_h A[h, i, j] per query i
    r̂_lj = minmax_j(pos_lj)        recency by original position (newer → larger)
    s_lj = λ·â_lj + (1-λ)·r̂_lj      λ = attn_weight (1: attention only, 0: recency only)

The EMA takes one update per query in query order (``ema_prefill="query"``, default): the prefill's
``w`` queries are ``w`` updates, so its last queries (the question) weigh most;
``ema_prefill="sum"`` folds the prefill's summed mass into one update (kvlab's earlier convention:
right after the prefill the EMA is then H2O's accumulated score × (1-β)).
Min–max is over the candidates of each layer (0 where all are equal; ``pos`` are the positions of
that layer's own slots). Every layer ranks by its own ``s_lj``, as seed 002 does ("normalized over
the non-protected candidates in the current layer"): if layer ``l`` holds more than ``B_t``
entries, its sinks and newest ``protect`` are kept and its ``B_t - protect - sinks`` candidates
with the largest ``s_lj`` (ties → newer); otherwise nothing is evicted. The layers keep different
entries, ``B_t`` each (``Keep.layers``; ``Keep.slots`` is layer 0's). ``per_layer=False`` is the
earlier one-live-set ranking, kept to measure the difference: the same slots on every layer, by
``S_j = (1/L) Σ_l s_lj`` (needs a uniform cache; not with ``pyramidal``).

**Sinks** (``sinks=k``, StreamingLLM): the first ``k`` positions are never evicted; they count
against the budget. Default 0 (the paper names none); min–max recency gives position 0 the lowest
recency, so without sinks λ < 1 evicts the attention sink as soon as it is a candidate.

**Pyramidal** (``pyramidal=True``, Conf-KV-L): layer ``l`` of ``L`` keeps its own live set under
its own budget at EQUAL memory (PyramidKV's arithmetic schedule around ``B_t``):

    m_l = (2 - ρ) - 2(1 - ρ)·l/(L-1)       (ρ = pyramid_ratio; m_0 = 2 - ρ, m_{L-1} = ρ, mean 1)
    B_t^l = B_t·m_l rounded so that Σ_l B_t^l = L·B_t exactly (largest remainders)

so the shallowest layer keeps ``(2-ρ)·B_t``, the deepest ``ρ·B_t``, and the cache holds the same
number of entries as a uniform Conf-KV at the same schedule. ``⌊ρ·tight⌋`` must exceed
``protect + sinks`` (every layer keeps ranked slots; ValueError otherwise). The paper's Conf-KV-L
also stores INT8 (set ``int8_window``). The record's ``budget`` signal is ``B_t``; ``cache_len`` is
layer 0's length.

**INT8** (``int8_window=W``): entries older than the newest ``W`` are stored as INT8
(:mod:`kvlab.cache.int8`): with ``int8_group=None`` (default, the paper's) one scale per (head,
channel) over the whole quantized prefix, every step; with ``int8_group=g`` kvlab's grouped
variant, one scale per (group of ≥ g entries, head, channel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kvlab.eviction.base import (EvictView, Keep, Plan, RankedEviction, check_bool, check_sinks, drawn_stats, finite_float,
                                 layer_block, layer_row, minmax, nonneg_int, positive_int, protected_below, unit_float)
from kvlab.cache.mirror import positions_tensor
from kvlab.eviction.ranking import masked_minmax
from kvlab.core.registry import register_eviction

MARGIN_CLIP = 10.0
CONFIDENCE_FROM = ("raw", "drawn")
EMA_PREFILL = ("query", "sum")


def confidence(entropy_bits: float, top1_prob: float, margin: float, vocab_size: int, *, w_entropy: float = 3.0,
               w_margin: float = 0.5, w_top: float = 3.0, bias: float = -3.0) -> float:
    """Conf-KV's confidence score (module docstring) from a step's entropy (bits), top-1 probability
    and probability margin ``p₁ - p₂``."""
    h_norm = min(max(entropy_bits * math.log(2.0) / math.log(vocab_size), 0.0), 1.0)
    p1 = max(float(top1_prob), 1e-30)
    p2 = max(p1 - float(margin), 1e-30)
    m = min(max(math.log(p1) - math.log(p2), 0.0), MARGIN_CLIP)
    z = w_entropy * (1.0 - h_norm) + w_margin * m + w_top * p1 + bias
    return 1.0 / (1.0 + math.exp(-z))


def pyramid_weights(num_layers: int, ratio: float) -> torch.Tensor:
    """``m_l`` (module docstring): linear from ``2 - ρ`` (shallowest layer) to ``ρ`` (deepest), mean 1."""
    if num_layers == 1:
        return torch.ones(1, dtype=torch.float64)
    l = torch.arange(num_layers, dtype=torch.float64)
    return (2.0 - ratio) - 2.0 * (1.0 - ratio) * l / (num_layers - 1)


def pyramid_budgets(budget: int, num_layers: int, ratio: float) -> list[int]:
    """Per-layer budgets ``≈ budget · m_l`` summing to exactly ``num_layers · budget`` (largest
    remainders; module docstring): the pyramid's mean budget is the uniform budget."""
    exact = [budget * float(m) for m in pyramid_weights(num_layers, ratio)]
    out = [math.floor(x) for x in exact]
    short = num_layers * budget - sum(out)
    for l in sorted(range(num_layers), key=lambda l: (-(exact[l] - out[l]), l))[:short]:
        out[l] += 1
    return out


@register_eviction("confkv", order=4, controls={"gamma": "gamma"})
@dataclass(frozen=True)
class ConfKV(RankedEviction):
    """Confidence-aware KV eviction; formulas in the module docstring. A ranked policy: :meth:`score`
    is ``s_lj``, :meth:`keep` picks the step's budget, :class:`~kvlab.eviction.ranked.RankedEviction` selects."""

    gamma: float = 0.7
    tight: int = 128
    loose: int = 256
    protect: int = 32
    w_entropy: float = 3.0
    w_margin: float = 0.5
    w_top: float = 3.0
    bias: float = -3.0
    attn_weight: float = 0.5
    ema_decay: float = 0.9
    pyramidal: bool = False
    pyramid_ratio: float = 0.5
    int8_window: int | None = None
    int8_group: int | None = None
    confidence_from: str = "raw"
    per_layer: bool = True
    sinks: int = 0
    ema_prefill: str = "query"

    newest_field = "protect"

    def __post_init__(self):
        unit_float("gamma", self.gamma)
        positive_int("tight", self.tight)
        positive_int("loose", self.loose)
        if self.loose < self.tight:
            raise ValueError(f"loose={self.loose} must be >= tight={self.tight} (uncertain steps keep more)")
        nonneg_int("protect", self.protect)
        protected_below("protect", self.protect, "tight", self.tight)
        check_sinks(self.sinks, "protect", self.protect, "tight", self.tight)
        for name in ("w_entropy", "w_margin", "w_top", "bias"):
            finite_float(name, getattr(self, name))
        unit_float("attn_weight", self.attn_weight)
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) or not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay={self.ema_decay!r} must be in [0, 1)")
        check_bool("pyramidal", self.pyramidal)
        check_bool("per_layer", self.per_layer)
        if self.pyramidal and not self.per_layer:
            raise ValueError("per_layer=False ranks one live set for all layers, but pyramidal=True gives every layer "
                             "its own budget: use per_layer=True with pyramidal=True")
        if isinstance(self.pyramid_ratio, bool) or not isinstance(self.pyramid_ratio, (int, float)) \
                or not 0 < self.pyramid_ratio <= 1:
            raise ValueError(f"pyramid_ratio={self.pyramid_ratio!r} must be in (0, 1] (deepest layer's share of B_t)")
        if self.pyramidal and math.floor(self.tight * self.pyramid_ratio) <= self.protect + self.sinks:
            raise ValueError(f"pyramid_ratio={self.pyramid_ratio} leaves the deepest layer ⌊{self.tight}·"
                             f"{self.pyramid_ratio}⌋ = {math.floor(self.tight * self.pyramid_ratio)} entries at the "
                             f"tight budget, not more than protect + sinks = {self.protect + self.sinks}: raise "
                             "pyramid_ratio or tight, or lower protect")
        if self.int8_window is not None:
            positive_int("int8_window", self.int8_window)
        if self.int8_group is not None:
            positive_int("int8_group", self.int8_group)
        if self.confidence_from not in CONFIDENCE_FROM:
            raise ValueError(f"confidence_from={self.confidence_from!r} must be one of {CONFIDENCE_FROM}")
        if self.ema_prefill not in EMA_PREFILL:
            raise ValueError(f"ema_prefill={self.ema_prefill!r} must be one of {EMA_PREFILL}")

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0, gamma: float | None = None,
                    tight_frac: float = 0.5, int8_window: int | None = None) -> "ConfKV":
        """``loose = budget`` (uncertain steps), ``tight = ⌊tight_frac·budget⌋`` (confident steps, at least 1),
        ``protect = recent`` (default ``min(32, budget // 8)``), ``sinks``, threshold ``gamma`` (default the
        field's)."""
        kw = {} if gamma is None else {"gamma": float(gamma)}
        if int8_window is not None:
            kw["int8_window"] = int8_window
        protect = max(0, min(32, budget // 8)) if recent is None else recent
        return cls(tight=max(1, int(budget * tight_frac)), loose=budget, protect=protect, sinks=sinks, **kw)

    @property
    def score_stat(self) -> str:
        """The statistic its ranker reads (the cache inspector's score)."""
        return "ema"

    @property
    def needs_attention(self) -> bool:
        return self.attn_weight > 0

    def confidence(self, record, vocab_size: int) -> float:
        return confidence(record.entropy_bits, record.top1_prob, record.margin, vocab_size, w_entropy=self.w_entropy,
                          w_margin=self.w_margin, w_top=self.w_top, bias=self.bias)

    def step_confidence(self, view: EvictView) -> float:
        """Confidence of ``view``'s step, from the distribution chosen by ``confidence_from``."""
        if self.confidence_from == "drawn" and view.logits is not None:
            ent, p1, margin = drawn_stats(view.logits, view.temperature, view.top_p)
            return confidence(ent, p1, margin, view.vocab_size, w_entropy=self.w_entropy, w_margin=self.w_margin,
                              w_top=self.w_top, bias=self.bias)
        return self.confidence(view.record, view.vocab_size)

    def plan(self, view: EvictView) -> Keep | Plan:
        """The step's budget ``B_t`` from its confidence (per layer: the pyramid or ``B_t`` everywhere); the
        base ranks each layer by :meth:`score` (``per_layer=False``: one live set on the layer mean) — for a
        batch's rows together (:meth:`~kvlab.eviction.ranked.RankedEviction.keep_rows`)."""
        c = self.step_confidence(view)
        budget = self.tight if c >= self.gamma else self.loose
        return self.plan_select(view, self._budgets(budget, view.num_layers), budget=budget, confidence=c, int8_window=self.int8_window,
                                int8_group=self.int8_group)

    # ------------------------------------------------------------------ over a resident bank's columns

    @property
    def decides_columns(self) -> bool:
        """Conf-KV decides over a resident bank's columns (:meth:`column_drop`) when it ranks per layer, stores full
        precision and reads its confidence from the step's own distribution (``confidence_from="raw"``)."""
        return bool(self.per_layer) and self.int8_window is None and self.confidence_from == "raw"

    def column_capacity(self, num_layers: int) -> int:
        """A resident bank's columns per layer: the largest budget (``loose``; the pyramid's shallowest layer) + 1."""
        return max(self._budgets(self.loose, num_layers)) + 1

    def _budgets(self, budget: int, num_layers: int) -> list[int]:
        """Per layer, the entries kept at step budget ``budget``: the pyramid around it, or ``budget`` everywhere."""
        return pyramid_budgets(budget, num_layers, self.pyramid_ratio) if self.pyramidal else [budget] * num_layers

    def column_drop(self, cols) -> torch.Tensor:
        """What :meth:`keep` drops at this step, over a resident bank's columns: each row's budget ``B_t`` from its
        step record's confidence (``cols.records``), each layer over it ranked by ``s = λ·minmax(ema) +
        (1-λ)·minmax(pos)`` over its candidates (masked min–max: the same numbers), ties to the older slot."""
        if not self.decides_columns:
            raise ValueError("this Conf-KV does not decide over a resident bank's columns (per_layer=False, INT8 or "
                             "confidence_from='drawn'): run it through keep / keep_rows")
        if cols.records is None or cols.vocab_size is None:
            raise ValueError("Conf-KV's column_drop reads each row's confidence: Resident.view(step, records=..., "
                             "vocab_size=...)")
        L = cols.key.shape[0]
        per = [self._budgets(self.tight if self.confidence(r, cols.vocab_size) >= self.gamma else self.loose, L)
               for r in cols.records]
        budgets = torch.tensor(per, dtype=torch.long, device=cols.key.device).T                 # (L, B)
        protected = self.column_protected(cols)
        cand = ~protected
        s = masked_minmax(cols.positions.to(torch.float32), cand)                               # recency
        if self.attn_weight > 0:
            a = masked_minmax(cols.stats["ema"].float(), cand)
            s = self.attn_weight * a + (1.0 - self.attn_weight) * s
        return self.column_select(cols, s, budgets, protected)

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        """``s_lj = λ·minmax(ema_l) + (1-λ)·minmax(pos_l)`` over the layer's candidates (0 elsewhere)."""
        pos = view.layer_positions[layer]
        lo, hi = self.candidates(view, layer)
        s = minmax(torch.tensor(pos[lo:hi], dtype=torch.float32))                            # (C,) recency
        if self.attn_weight > 0:
            a = minmax(layer_row(view, "ema", layer)[lo:hi].float())                         # (C,)
            s = self.attn_weight * a + (1.0 - self.attn_weight) * s.to(a.device)
        return F.pad(s, (lo, len(pos) - hi))                                                  # (T_l,)

    def scores_for(self, view: EvictView, layers: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`score` of every layer in ``layers`` at once: the layers with the same candidates'
        span are min–max normalized as one ``(G, C)`` matrix (the same values, element by element)."""
        out: list = [None] * len(layers)
        groups: dict[tuple, list[int]] = {}
        for i, l in enumerate(layers):
            lo, hi = self.candidates(view, l)
            groups.setdefault((lo, hi, len(view.layer_positions[l])), []).append(i)
        for (lo, hi, n), idx in groups.items():
            ls = [layers[i] for i in idx]
            if hi <= lo:
                for i, l in zip(idx, ls):
                    out[i] = self.score(view, l)
                continue
            seqs, first = [], {}
            for l in ls:                                  # uniform caches share one positions sequence
                p = view.layer_positions[l]
                first.setdefault(id(p), len(first))
                if first[id(p)] == len(seqs):
                    seqs.append(p)
            pos = positions_tensor(seqs, lo, hi).to(torch.float32)                          # (distinct, C)
            if len(seqs) < len(ls):
                pos = pos[torch.tensor([first[id(view.layer_positions[l])] for l in ls], dtype=torch.long)]
            s = minmax(pos)                                                                  # (G, C) recency
            if self.attn_weight > 0:
                ema = layer_block(view, "ema", ls)                                             # (G, T) or rows
                a = minmax((ema if isinstance(ema, torch.Tensor) else torch.stack(ema))[:, lo:hi].float())  # (G, C)
                s = self.attn_weight * a + (1.0 - self.attn_weight) * s.to(a.device)
            s = F.pad(s, (lo, n - hi))                                                        # (G, T)
            if len(groups) == 1 and idx == list(range(len(layers))):
                return s                                  # every layer in one group: the (G, T) matrix itself
            for i, row in zip(idx, s.unbind(0)):
                out[i] = row
        return out
