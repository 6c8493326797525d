"""The protocols the decode loop owns: what an eviction policy and a refresh policy are to the loop, every
optional attribute it reads (declared once here, with its default and meaning), the view an eviction policy
decides on (:class:`EvictView`) and its answer (:class:`Keep`), and the checks the loop relies on.

An **eviction policy** has ``keep(view: EvictView) -> Keep``; a **refresh policy** has
``should_refresh(record: StepRecord) -> bool``. Both are frozen dataclasses that decide and never mutate; the
loop and the cache act on their answers. The optional attributes below are read through :func:`evict_attr` /
:func:`refresh_attr` only (never by type), so a policy that lacks one gets the declared default.
"""
from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from kvlab.decode.probes import PROBES


class Attr(NamedTuple):
    default: Any
    meaning: str


EVICT_ATTRS: dict[str, Attr] = {
    "needs_attention": Attr(False, "the loop measures attention mass on its forwards (prefill included) and the view "
                                   "carries ``attn``"),
    "attention_steps": Attr("all", "with needs_attention: 'all' measures at every step; 'first' only at the prefill "
                                   "and the run's first step, the one step the policy reads attention at (SnapKV, "
                                   "PyramidKV: one cut); later steps append unmeasured (zeros)"),
    "ema_decay": Attr(0.9, "beta of the cache's EMA of attention mass (KVCache.track_attention), in [0, 1)"),
    "rerotate": Attr(False, "survivors are moved to consecutive positions (RoPE re-rotation); refused with refresh"),
    "attention_window": Attr(None, "only the last N queries of a multi-token forward are measured (SnapKV's "
                                   "observation window); None: every query"),
    "attention_pool": Attr(1, "each forward's mass is max-pooled over the entry and the next N-1 before it is "
                              "accumulated (OpenVINO GenAI's max_pool_window_size)"),
    "attention_below": Attr(False, "the cache also counts, per entry, the measured queries that gave it less than "
                                   "the uniform share (attn['low'], Scissorhands)"),
    "ema_prefill": Attr("query", "a multi-token forward enters the EMA one update per query ('query') or as one "
                                 "update with the summed mass ('sum')"),
    "needs_kv": Attr(False, "the view carries ``kv`` (read-only copies of each layer's keys and values) and "
                            "``modules`` (the attention modules): scorers that read the cache itself"),
    "needs_inputs": Attr(False, "the loop captures the attention layers' inputs (hidden states, RoPE, positions; "
                                "kvlab.cache.inputs) at the prefill and the view carries ``inputs`` (kvpress's presses)"),
    "needs_decode_inputs": Attr(False, "with needs_inputs: decode steps are captured too (the last inputs_window tokens)"),
    "inputs_window": Attr(128, "with needs_decode_inputs: the most tokens of layer inputs kept per layer"),
    "prepare": Attr(None, "prepare(model): called once per run before the first forward (kvpress's "
                          "post_init_from_model); None: nothing to prepare"),
    "score_stat": Attr(None, "the statistic the policy ranks by, shown by the cache inspector (None: 'acc' when "
                             "it needs_attention)"),
    "batchable": Attr(True, "the policy may run as a row of a batched decode (False: batch 1 only)"),
    "every": Attr(1, "the loop asks the policy only at the run's first step and every N-th step after it (kvpress's "
                     "DecodingPress compression_interval); between, it builds no view and the cache grows by up to "
                     "N - 1 entries past the budget (kvlab.eviction.every.Every gives any policy an N)"),
    "keep_rows": Attr(None, "keep_rows(views) -> [Keep]: the decisions of several rows of a batch at once, the same "
                            "as keep(view) row by row (ranked policies: one ranking for all rows); None: keep per row"),
    "decides_columns": Attr(False, "at a budget and asked at every step, the policy decides over a resident bank's "
                                   "columns (column_drop; kvlab.cache.resident) as keep would over the same entries"),
    "column_capacity": Attr(None, "with decides_columns: column_capacity(num_layers) -> int, the columns a resident "
                                  "bank holds per layer: the most entries a layer holds after a step's append (None: "
                                  "its length when checked in + 1)"),
    "column_slots": Attr(False, "with decides_columns: column_drop reads the entries in slot order (ColumnView.order; "
                                "a resident bank keeps it: block eviction's areas)"),
    "column_drop": Attr(None, "column_drop(cols) -> (L, B) long or (L, B, C) bool: with decides_columns, the column "
                              "each layer of each row drops, or a mask of the columns (kvlab.cache.resident.ColumnView): "
                              "the entries keep would drop"),
}

REFRESH_ATTRS: dict[str, Attr] = {
    "window": Attr(None, "W, the most entries one refresh rewrites (None = unbounded)"),
    "probe": Attr(None, "the name of a signal source in kvlab.decode.probes.PROBES, run before the decision"),
    "probe_every": Attr(1, "probe at steps t with t % probe_every == 0"),
    "batchable": Attr(True, "the policy may run as a row of a batched decode (False: batch 1 only)"),
}


def evict_attr(policy, name: str):
    """An eviction policy's optional attribute ``name`` (declared in :data:`EVICT_ATTRS`), or its default."""
    return getattr(policy, name, EVICT_ATTRS[name].default)


def measures_at(policy, step: int, first_step: int = 1) -> bool:
    """Whether the loop measures attention on ``policy``'s forward at ``step`` (a run whose first step is
    ``first_step``): ``needs_attention``, at every step or, with ``attention_steps == 'first'``, at the first."""
    if policy is None or not evict_attr(policy, "needs_attention"):
        return False
    return evict_attr(policy, "attention_steps") == "all" or step == first_step


def evict_due(policy, step: int, first_step: int = 1) -> bool:
    """Whether the loop asks ``policy`` at ``step`` (a run whose first step is ``first_step``): at the first step,
    then every ``every``-th (:data:`EVICT_ATTRS`)."""
    every = evict_attr(policy, "every")
    return every == 1 or (step - first_step) % every == 0


def keep_rows(policy, views: Sequence["EvictView"]) -> list["Keep"]:
    """``policy``'s decisions for ``views`` (rows of a batch): its ``keep_rows`` when it has one of its own, else
    ``keep`` row by row (also for a wrapper that hands attribute reads to another policy: its own ``keep`` is
    what it decides by)."""
    batched = evict_attr(policy, "keep_rows")
    if callable(batched) and getattr(batched, "__self__", policy) is policy:
        return list(batched(views))
    return [policy.keep(v) for v in views]


def refresh_attr(policy, name: str):
    """A refresh policy's optional attribute ``name`` (declared in :data:`REFRESH_ATTRS`), or its default."""
    return getattr(policy, name, REFRESH_ATTRS[name].default)


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


class Kept(abc.Sequence):
    """A layer's kept slots ``0 .. n - 1`` minus the few ``drops`` (sorted), without building the tuple: a ranked
    policy that drops one entry of a thousand per step says which one. Reads as the tuple of kept slots
    (``len``, iteration, indexing, ``==`` with a tuple or list); :meth:`dropped` hands the cache the drops."""

    __slots__ = ("n", "drops", "_kept")

    def __init__(self, n: int, drops: Sequence[int]):
        self.n, self.drops, self._kept = int(n), tuple(drops), None

    def _tuple(self) -> tuple[int, ...]:
        if self._kept is None:
            gone = set(self.drops)
            self._kept = tuple(s for s in range(self.n) if s not in gone)
        return self._kept

    def __len__(self) -> int:
        return self.n - len(self.drops)

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other) -> bool:
        if isinstance(other, Kept) and other.n == self.n:
            return other.drops == self.drops
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, Kept)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())

    def dropped(self, length: int) -> list[int]:
        """The slots of ``length`` not kept (the drops when ``length`` is this layer's ``n``)."""
        return list(self.drops) if length == self.n else sorted(set(range(length)).difference(self))


def _dropped(kept, length: int) -> list[int]:
    fast = getattr(kept, "dropped", None)
    if fast is not None:
        return fast(length)
    if len(kept) == length and (not length or (kept[0] == 0 and kept[-1] == length - 1)):
        return []                           # sorted distinct slots 0 .. length - 1: everything kept (no set built)
    return sorted(set(range(length)).difference(kept))


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
        return _dropped(self.slots, length)

    def dropped_layers(self, lengths: Sequence[int]) -> list[list[int]] | None:
        """Per layer, the slots to drop (``lengths[l]`` = layer ``l``'s live length); ``None`` when
        ``layers`` is ``None`` (then :meth:`dropped` applies to every layer)."""
        if self.layers is None:
            return None
        if len(self.layers) != len(lengths):
            raise ValueError(f"Keep.layers has {len(self.layers)} entries for a cache of {len(lengths)} layers")
        out = []
        for kept, n in zip(self.layers, lengths):
            out.append(_dropped(kept, n))
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


def validate_evict(policy) -> None:
    """The protocol checks the loop relies on (ValueError naming the attribute)."""
    if not callable(getattr(policy, "keep", None)):
        raise ValueError(f"evict={policy!r} needs a keep(view) -> Keep method (see kvlab.eviction)")
    every = evict_attr(policy, "every")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"evict.every={every!r} must be an int >= 1 (the policy decides every N-th step)")
    decay = evict_attr(policy, "ema_decay")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(f"evict.ema_decay={decay!r} must be in [0, 1)")


def validate_policy(policy) -> None:
    """The protocol checks the loop relies on (ValueError naming the attribute)."""
    if not callable(getattr(policy, "should_refresh", None)):
        raise ValueError(f"refresh={policy!r} needs a should_refresh(record) -> bool method")
    w = refresh_attr(policy, "window")
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
        raise ValueError(f"refresh.window={w!r} must be a positive int or None (= no window)")
    probe = refresh_attr(policy, "probe")
    if probe is not None:
        if probe not in PROBES:
            raise ValueError(f"refresh.probe={probe!r} is not a registered probe; known: {sorted(PROBES)} "
                             "(import the module that registers it)")
        every = refresh_attr(policy, "probe_every")
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"refresh.probe_every={every!r} must be a positive int")
