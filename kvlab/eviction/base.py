"""The eviction-policy protocol shared by the decode loop and the policies (issue 9).

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
  gave it less than the uniform share of their attention (``attn["low"]``, Scissorhands).

The loop calls ``keep`` once per step, after the token was chosen (and after a refresh), and
removes every slot not in ``Keep.slots`` through ``KVCache.evict`` (the cache module is the only
thing that edits tensors). ``Keep.int8_window`` asks the cache to store entries older than that
window in INT8 (``KVCache.quantize_older``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


@dataclass(frozen=True, eq=False)
class EvictView:
    """What a policy sees at step ``step``: the decoding cache after this step's forward (it holds
    ``x, y_<step``), the step's record (entropy, top-1, margin of the distribution ``y_step`` was
    drawn from), and the cache's attention statistics (read only; ``None`` unless the policy
    ``needs_attention``): ``attn["acc"]`` (L, T) accumulated mass, ``attn["ema"]`` (L, T) its EMA,
    ``attn["count"]`` (T,) each entry's lifetime in measured queries (NORM_SUM's denominator).
    ``logits``, ``temperature`` and ``top_p`` give the distribution ``y_step`` was drawn from
    (:func:`drawn_stats`); ``first`` marks the run's first step (prompt-compression policies)."""

    step: int
    length: int
    positions: tuple[int, ...]     # absolute position of each slot
    record: Any                    # kvlab.decode.StepRecord of this step
    vocab_size: int
    num_layers: int
    attn: Mapping[str, torch.Tensor] | None = None
    logits: torch.Tensor | None = None     # (V,) raw logits y_step was chosen from
    temperature: float = 0.0               # the run's sampling: 0 = greedy
    top_p: float = 1.0
    first: bool = False                    # the run's first step: the cache holds the prefill only


@dataclass(frozen=True)
class Keep:
    """A decision: the slots to keep (sorted), plus what the policy computed on the way."""

    slots: tuple[int, ...]
    budget: int | None = None          # the budget in force at this step (entries)
    confidence: float | None = None    # Conf-KV's confidence score
    rerotate: bool = False
    int8_window: int | None = None     # store entries older than the newest int8_window in INT8
    int8_group: int = 64

    def dropped(self, length: int) -> list[int]:
        keep = set(self.slots)
        return [s for s in range(length) if s not in keep]

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


def protected_below(protect_name: str, protect: int, budget_name: str, budget: int) -> None:
    if protect >= budget:
        raise ValueError(f"{protect_name}={protect} must be < {budget_name}={budget}: the protected recent "
                         f"window has to leave room in the budget (lower {protect_name} or raise {budget_name})")


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


def layer_mean(stat: torch.Tensor, cols: list[int], weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers of ``stat`` (L, T) at columns ``cols`` (optionally layer-weighted) -> (len(cols),)."""
    x = stat[:, cols].float()
    if weights is None:
        return x.mean(0)
    w = weights.to(x.device, x.dtype).view(-1, 1)
    return (w * x).sum(0) / w.sum()
