"""The eviction-policy protocol shared by the decode loop and the policies.
Decisions and checks only: nothing here edits a cache.

An eviction policy is a frozen dataclass that decides only, with one method::

    keep(view: EvictView) -> Keep

and optional attributes the loop reads generically (no ``isinstance``), with these defaults:

* ``needs_attention: bool = False`` — the loop measures attention mass on its forwards
  (``KVCache.forward(..., attention=True)``) and the view carries ``attn``;
* ``ema_decay: float = 0.9`` — β of the cache's EMA of attention mass (``KVCache.track_attention``);
* ``rerotate: bool = False`` — survivors are moved to consecutive positions (RoPE re-rotation).
* ``attention_window: int | None = None`` — only the last ``attention_window`` queries of a
  multi-token forward (the prefill) are measured: SnapKV's observation window;
* ``attention_pool: int = 1`` — each forward's mass is max-pooled over the entry and the next
  ``attention_pool - 1`` entries before it is accumulated (OpenVINO GenAI's ``max_pool_window_size``);
* ``attention_below: bool = False`` — the cache also counts, per entry, the measured queries that
  gave it less than the uniform share of their attention (``attn["low"]``, Scissorhands);
* ``ema_prefill: str = "query"`` — the EMA takes a multi-token forward (the prefill) as one update
  per query in query order (``"sum"``: one update with the summed mass);
* ``needs_kv: bool = False`` — the view carries ``kv`` (layer -> read-only copies of that layer's
  cached keys and values) and ``modules`` (the decoder's attention modules, in layer order): score
  functions that read the cache itself (kvpress-style scorers, :mod:`kvlab.eviction.scorer`);
* ``needs_inputs: bool = False`` — the loop captures the attention layers' inputs (hidden states, RoPE,
  positions; :mod:`kvlab.cache.inputs`) at the prefill, and at decode steps too with
  ``needs_decode_inputs`` (the last ``inputs_window`` tokens); the view carries ``inputs`` (kvpress's presses);
* ``prepare(model)`` — called once per run before the first forward (kvpress's ``post_init_from_model``);
* ``score_stat: str | None`` — the statistic the policy ranks by, shown as the score by the cache
  inspector (:func:`kvlab.eviction.inspector.score_stat`; default ``"acc"`` when it ``needs_attention``,
  else None).

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
statistic (:func:`layer_rows`); the ``per_layer=False`` variants of H2O, Scissorhands, SnapKV and
Conf-KV rank one live set for all layers on the layer mean, reading a statistic as an ``(L, T)``
matrix with :func:`layer_stat`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch


@dataclass(frozen=True, eq=False)
class EvictView:
    """What a policy sees at step ``step``: the decoding cache after this step's forward (it holds
    ``x, y_<step``), the step's record (entropy, top-1, margin of the distribution ``y_step`` was
    drawn from), and the cache's attention statistics (read only; ``None`` unless the policy
    ``needs_attention``), per layer: ``attn["acc"][l]`` (T_l,) accumulated mass over layer ``l``'s
    slots, ``attn["ema"][l]`` (T_l,) its EMA, ``attn["count"][l]`` (T_l,) each entry's lifetime in
    measured queries (NORM_SUM's denominator); :func:`layer_stat` stacks one to ``(L, T)``.
    ``logits``, ``temperature`` and ``top_p`` give the distribution ``y_step`` was drawn from
    (:func:`drawn_stats`); ``first`` marks the run's first step (prompt-compression policies).
    ``kv`` / ``modules`` (``None`` unless the policy ``needs_kv``): ``kv(l)`` returns copies of layer
    ``l``'s ``(keys, values)``, each ``(1, H_kv, T_l, D)``, keys post-RoPE, in slot order (INT8
    entries dequantized); ``modules[l]`` is layer ``l``'s attention module (read its config only).

    ``positions`` / ``length`` are layer 0's live set; ``layer_positions[l]`` is layer ``l``'s
    (default: ``positions`` on every layer)."""

    step: int
    length: int
    positions: tuple[int, ...]     # absolute position of each slot of layer 0
    record: Any                    # kvlab.decode.StepRecord of this step
    vocab_size: int
    num_layers: int
    attn: Mapping[str, Sequence[torch.Tensor]] | None = None   # per layer (T_l,); see layer_stat
    logits: torch.Tensor | None = None     # (V,) raw logits y_step was chosen from
    temperature: float = 0.0               # the run's sampling: 0 = greedy
    top_p: float = 1.0
    first: bool = False                    # the run's first step: the cache holds the prefill only
    layer_positions: tuple[tuple[int, ...], ...] = None   # per layer: absolute position of each live slot
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None   # layer -> copies (1, H_kv, T_l, D) x2
    modules: tuple | None = None           # per layer: the decoder's attention module (needs_kv)
    inputs: Callable[[int], dict] | None = None   # layer -> captured layer inputs (needs_inputs; kvlab.cache.inputs)

    def __post_init__(self):
        if self.layer_positions is None:
            object.__setattr__(self, "layer_positions", (tuple(self.positions),) * self.num_layers)
        elif len(self.layer_positions) != self.num_layers:
            raise ValueError(f"layer_positions has {len(self.layer_positions)} layers, num_layers={self.num_layers}")

    @property
    def uniform(self) -> bool:
        """Every layer holds the same live positions (one live set)."""
        first = self.layer_positions[0] if self.layer_positions else ()
        return all(p == first for p in self.layer_positions)


@dataclass(frozen=True)
class Keep:
    """A decision: the slots to keep (sorted), plus what the policy computed on the way.

    ``layers`` (optional): per layer, the kept slots of that layer (indices into its own live
    list); ``None`` keeps ``slots`` on every layer."""

    slots: tuple[int, ...]
    budget: int | None = None          # the budget in force at this step (entries per layer)
    confidence: float | None = None    # Conf-KV's confidence score
    rerotate: bool = False
    int8_window: int | None = None     # store entries older than the newest int8_window in INT8
    int8_group: int | None = 64        # entries per INT8 scale group; None: one scale per (head, channel)
    layers: tuple[tuple[int, ...], ...] | None = None   # per-layer kept slots; None: slots on every layer

    def dropped(self, length: int) -> list[int]:
        keep = set(self.slots)
        return [s for s in range(length) if s not in keep]

    def dropped_layers(self, lengths: Sequence[int]) -> list[list[int]] | None:
        """Per layer, the slots to drop (``lengths[l]`` = layer ``l``'s live length); ``None`` when
        ``layers`` is ``None`` (then :meth:`dropped` applies to every layer)."""
        if self.layers is None:
            return None
        if len(self.layers) != len(lengths):
            raise ValueError(f"Keep.layers has {len(self.layers)} entries for a cache of {len(lengths)} layers")
        out = []
        for kept, n in zip(self.layers, lengths):
            keep = set(kept)
            out.append([s for s in range(n) if s not in keep])
        return out

    def signals(self) -> dict[str, float]:
        out = {}
        if self.budget is not None:
            out["budget"] = float(self.budget)
        if self.confidence is not None:
            out["confidence"] = float(self.confidence)
        return out


def keep_all(view: EvictView, **kw) -> Keep:
    return Keep(tuple(range(view.length)), **kw)


# --------------------------------------------------------------------------- validation


def positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int (entries)")


def nonneg_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}={v!r} must be an int >= 0")


def unit_float(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name}={v!r} must be a number in [0, 1]")


def finite_float(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name}={v!r} must be True or False")


def protected_below(protect_name: str, protect: int, budget_name: str, budget: int) -> None:
    if protect >= budget:
        raise ValueError(f"{protect_name}={protect} must be < {budget_name}={budget}: the protected recent "
                         f"window has to leave room in the budget (lower {protect_name} or raise {budget_name})")


def check_observation_window(budget: int, window: int, kernel: int) -> None:
    """SnapKV-style prompt compression's parameters (SnapKV, PyramidKV): ValueError naming the parameter."""
    positive_int("budget", budget)
    positive_int("window", window)
    protected_below("window", window, "budget", budget)
    positive_int("kernel", kernel)
    if kernel % 2 == 0:
        raise ValueError(f"kernel={kernel} must be odd (a centred pool keeps the length)")


def validate_evict(policy) -> None:
    """The protocol checks the loop relies on (ValueError naming the attribute)."""
    if not callable(getattr(policy, "keep", None)):
        raise ValueError(f"evict={policy!r} needs a keep(view) -> Keep method (see kvlab.eviction)")
    decay = getattr(policy, "ema_decay", 0.9)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(f"evict.ema_decay={decay!r} must be in [0, 1)")


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


# --------------------------------------------------------------------------- ranking helpers


def minmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``(x - min) / (max - min)`` along ``dim``; 0 where max == min."""
    lo = x.amin(dim=dim, keepdim=True)
    span = x.amax(dim=dim, keepdim=True) - lo
    return torch.where(span > 0, (x - lo) / span.clamp_min(1e-30), torch.zeros_like(x))


def top_slots(scores: torch.Tensor, candidates: list[int], k: int) -> list[int]:
    """The ``k`` candidates with the highest ``scores`` (one per candidate); ties go to the later slot."""
    if k <= 0:
        return []
    if k >= len(candidates):
        return list(candidates)
    cand = torch.as_tensor(candidates, dtype=torch.long)
    by_slot = torch.argsort(cand, descending=True)                          # newer slots first ...
    order = torch.argsort(scores.detach().float().cpu()[by_slot], descending=True, stable=True)  # ... among equal scores
    return sorted(cand[by_slot[order[:k]]].tolist())


def top_slots_layers(scores: Sequence[torch.Tensor], k: int) -> list[list[int]]:
    """Per layer, :func:`top_slots` over the contiguous candidates ``0 .. m_l - 1`` of ``scores[l]``
    ``(m_l,)``: the ``k`` highest, ties to the later slot, sorted. One batched sort when every layer
    has the same ``m`` (the usual case: the same number of entries per layer), else layer by layer."""
    ms = {int(s.numel()) for s in scores}
    if len(ms) != 1:
        return [top_slots(s, list(range(int(s.numel()))), k) for s in scores]
    m = ms.pop()
    if k <= 0:
        return [[] for _ in scores]
    if k >= m:
        return [list(range(m)) for _ in scores]
    x = torch.stack([s.detach().float().cpu() for s in scores]).flip(1)    # (L, m), newer slots first ...
    order = torch.argsort(x, dim=1, descending=True, stable=True)[:, :k]   # ... among equal scores
    return (m - 1 - order).sort(dim=1).values.tolist()


def top_and_recent_layers(scores: Sequence[torch.Tensor], lengths: Sequence[int], budget: int,
                          recent: int, sinks: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Per layer ``l`` holding ``lengths[l]`` entries: every slot when within ``budget``, else its
    first ``sinks[l]`` slots (attention sinks, :func:`sink_counts`; none by default), its newest
    ``recent`` slots and the ``budget - recent - sinks[l]`` others with the highest ``scores[l]``
    (ties: newer) — H2O's and Scissorhands' per-layer rule, with the over-budget layers ranked by
    one :func:`top_slots_layers` call (per sink count)."""
    sinks = [0] * len(lengths) if sinks is None else list(sinks)
    over = [l for l, n in enumerate(lengths) if n > budget]
    kept = [tuple(range(n)) for n in lengths]
    for s in sorted({sinks[l] for l in over}):
        ls = [l for l in over if sinks[l] == s]
        tops = top_slots_layers([scores[l][s: lengths[l] - recent] for l in ls], budget - recent - s)
        for l, top in zip(ls, tops):
            kept[l] = tuple(range(s)) + tuple(t + s for t in top) + tuple(range(lengths[l] - recent, lengths[l]))
    return kept


def sink_counts(view: "EvictView", sinks: int) -> list[int]:
    """Per layer, how many of its live slots are attention sinks: slots whose absolute position is
    below ``sinks`` (StreamingLLM: the first ``sinks`` positions are never evicted). Slots are in
    position order, so a layer's sinks are its first ``sink_counts[l]`` slots."""
    if not sinks:
        return [0] * view.num_layers
    return [sum(1 for p in pos[:sinks] if p < sinks) for pos in view.layer_positions]


def check_sinks(sinks, protect_name: str, protect: int, budget_name: str, budget: int) -> None:
    """``sinks`` is an int >= 0 and sinks + the protected window leave a ranked slot in the budget."""
    nonneg_int("sinks", sinks)
    if sinks + protect >= budget:
        raise ValueError(f"sinks={sinks} + {protect_name}={protect} must be < {budget_name}={budget}: sinks and the "
                         f"protected window have to leave room in the budget (lower sinks or raise {budget_name})")


def layer_stat(view: EvictView, name: str) -> torch.Tensor:
    """``view.attn[name]`` as an ``(L, T)`` matrix, for policies that rank one live set for all layers.

    The per-layer sequence (entry ``l`` of shape ``(T_l,)``) is stacked; that needs every layer to
    hold the same live positions (``view.uniform``), else ValueError. A tensor already ``(L, T)``
    passes through, and a ``(T,)`` tensor (one row for all layers) is broadcast to ``(L, T)``."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor):
        return stat if stat.dim() == 2 else stat.view(1, -1).expand(view.num_layers, -1)
    if not view.uniform:
        raise ValueError(f"attn[{name!r}] differs per layer (per-layer live sets); this policy ranks one live set "
                         "for all layers — rank each layer's own slots and return Keep.layers instead")
    return torch.stack(list(stat))                                                # (L, T)


def layer_rows(view: EvictView, name: str) -> list[torch.Tensor]:
    """``view.attn[name]`` as one ``(T_l,)`` tensor per layer, for policies that decide per layer:
    a per-layer sequence as is, an ``(L, T)`` matrix split into its rows, a ``(T,)`` tensor (one row
    for all layers) shared."""
    stat = view.attn[name]
    if isinstance(stat, torch.Tensor):
        return list(stat.unbind(0)) if stat.dim() == 2 else [stat] * view.num_layers
    return list(stat)


def per_layer(kept: Sequence[Sequence[int]], **kw) -> Keep:
    """A per-layer decision (``kept[l]``: layer ``l``'s kept slots) as a :class:`Keep`: ``slots`` are
    layer 0's, ``layers`` all of them."""
    layers = tuple(tuple(k) for k in kept)
    return Keep(layers[0], layers=layers, **kw)


def over_budget(view: EvictView, budget: int, by_layer: bool = True) -> bool:
    """Some layer holds more than ``budget`` entries (``by_layer=False``: layer 0, the one live set)."""
    if not by_layer:
        return view.length > budget
    return any(len(p) > budget for p in view.layer_positions)


def layer_mean(stat: torch.Tensor, cols: list[int], weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers of ``stat`` (L, T) at columns ``cols`` (optionally layer-weighted) -> (len(cols),)."""
    x = stat[:, cols].float()
    if weights is None:
        return x.mean(0)
    w = weights.to(x.device, x.dtype).view(-1, 1)
    return (w * x).sum(0) / w.sum()
