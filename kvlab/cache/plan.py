"""Surgery plans (seed 004, "Step 4"), in pure Python: validating an action list and laying it out.

:func:`plan_actions` checks a whole action list before any tensor is touched and turns it into a
:class:`TickPlan` whose ``layout`` cuts the tensors and the live map alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch


ACTIONS = {  # action -> its keys besides 'action'
    "delete": ("pos",),
    "insert": ("pos", "token_ids"),
    "replace_pair": ("original_pos1", "original_pos2", "new_token_ids"),
    "add": ("token_id",),
}
SPLICE_MODES = ("gather", "per_row")
_REMOVAL_EVENTS = {"deleted": "deleted", "replaced": "replaced", "superseded": "superseded",
                   "evicted": "evicted", "moved": "moved"}
_ORIGIN_EVENTS = ("inserted", "replacement", "added", "rebuilt", "moved_to")


class SurgeryError(RuntimeError):
    """A validated tick failed while running; the cache was rebuilt from its live map (or emptied)."""


@dataclass(frozen=True)
class Block:
    """New tokens placed right before original slot ``anchor`` (kind ``insert``) or in place of ``anchor``
    (kind ``replace``, a replace_pair's ``original_pos1``)."""

    anchor: int
    token_ids: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class TickPlan:
    """A validated action list, as data. ``layout`` cuts tensors and live map alike: a list of
    ``("old", a, b)`` (original slots ``a:b``) and ``("new", j, 0)`` (``blocks[j]``), left to right."""

    length: int                         # cache length before the tick
    actions: tuple[Mapping, ...]
    deleted: dict[int, str]             # original slot -> "deleted" | "replaced"
    blocks: tuple[Block, ...]           # in slot order
    adds: tuple[int, ...]
    layout: tuple[tuple[str, int, int], ...]
    steps: tuple[tuple[str, int, int], ...]  # the seed's sequential ops: ("delete", slot, -1) / ("insert", slot, j)

    def apply_to_list(self, seq: Sequence, new_items: Sequence[Sequence]) -> list:
        """The layout applied to a Python list of length ``length`` (``new_items[j]`` fills block ``j``)."""
        if len(seq) != self.length:
            raise ValueError(f"list has {len(seq)} items, the plan was made for {self.length}")
        out: list = []
        for kind, a, b in self.layout:
            out.extend(seq[a:b] if kind == "old" else new_items[a])
        return out

    @property
    def new_length(self) -> int:
        return self.length - len(self.deleted) + sum(len(b.token_ids) for b in self.blocks) + len(self.adds)


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{what}={value!r} must be an int")
    return int(value.__index__())


def _as_tokens(value, what: str, vocab_size: int, allow_empty: bool = False) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what}={value!r} must be a list of token ids")
    ids = tuple(_as_int(v, f"{what}[{k}]") for k, v in enumerate(value))
    if not ids and not allow_empty:
        raise ValueError(f"{what} is empty; give at least one token id (use 'delete' to only remove)")
    for k, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}[{k}]={t} is outside the vocabulary [0, {vocab_size})")
    return ids


def plan_actions(actions: Sequence[Mapping], length: int, vocab_size: int) -> TickPlan:
    """Validate a whole action list against a cache of ``length`` entries and lay it out.

    Raises ``ValueError`` naming the action and the fix. Rules: positions are slots of the
    pre-tick cache; ``delete``/``replace_pair`` slots in ``[0, length)``, ``insert`` in
    ``[0, length]``; ``original_pos1 < original_pos2``; a replace_pair claims every slot of
    ``[pos1, pos2]``, so no other action may touch a slot (or an insert gap) inside it; a slot is
    removed by at most one action and a gap gets at most one insert; token ids within the vocabulary.
    """
    if isinstance(actions, (str, bytes, Mapping)) or not hasattr(actions, "__iter__"):
        raise ValueError("actions must be a list of dicts like {'action': 'add', 'token_id': 5}")
    actions = tuple(actions)
    claimed: dict[int, int] = {}      # slot -> index of the action that removes/spans it
    gaps: dict[int, int] = {}         # insert slot -> action index
    deleted: dict[int, str] = {}
    blocks: dict[tuple[int, int], Block] = {}   # (anchor, 0 for replace / 1 for insert) -> block
    spans: list[tuple[int, int, int]] = []
    adds: list[int] = []

    def claim(slot: int, i: int) -> None:
        if slot in claimed:
            raise ValueError(f"actions[{claimed[slot]}] and actions[{i}] overlap at slot {slot}; "
                             "each slot may be touched by one action per tick")
        claimed[slot] = i

    for i, a in enumerate(actions):
        if not isinstance(a, Mapping):
            raise ValueError(f"actions[{i}]={a!r} must be a dict with an 'action' key")
        kind = a.get("action")
        if kind not in ACTIONS:
            raise ValueError(f"actions[{i}]['action']={kind!r} must be one of {tuple(ACTIONS)}")
        need = ACTIONS[kind]
        missing = [k for k in need if k not in a]
        extra = [k for k in a if k not in need and k != "action"]
        if missing or extra:
            raise ValueError(f"actions[{i}] ({kind}) has keys {sorted(a)}; a {kind} takes exactly "
                             f"{('action',) + need}" + (f" (missing {missing})" if missing else "")
                             + (f" (unknown {extra})" if extra else ""))
        if kind == "add":
            adds.append(_as_tokens([a["token_id"]], f"actions[{i}]['token_id']", vocab_size)[0])
        elif kind == "delete":
            s = _as_int(a["pos"], f"actions[{i}]['pos']")
            if not 0 <= s < length:
                raise ValueError(f"actions[{i}]['pos']={s} is outside the cache slots [0, {length})")
            claim(s, i)
            deleted[s] = "deleted"
        elif kind == "insert":
            s = _as_int(a["pos"], f"actions[{i}]['pos']")
            if not 0 <= s <= length:
                raise ValueError(f"actions[{i}]['pos']={s} must be in [0, {length}] (the slot to insert before; "
                                 f"{length} = at the end)")
            ids = _as_tokens(a["token_ids"], f"actions[{i}]['token_ids']", vocab_size)
            if s in gaps:
                raise ValueError(f"actions[{gaps[s]}] and actions[{i}] both insert before slot {s}; "
                                 "merge them into one insert")
            gaps[s] = i
            blocks[(s, 1)] = Block(s, ids, "insert")
        else:
            p1 = _as_int(a["original_pos1"], f"actions[{i}]['original_pos1']")
            p2 = _as_int(a["original_pos2"], f"actions[{i}]['original_pos2']")
            if not 0 <= p1 < p2 < length:
                raise ValueError(f"actions[{i}]: need 0 <= original_pos1 < original_pos2 < {length}, got "
                                 f"({p1}, {p2})")
            ids = _as_tokens(a["new_token_ids"], f"actions[{i}]['new_token_ids']", vocab_size)
            for s in range(p1, p2 + 1):
                claim(s, i)
            deleted[p1] = deleted[p2] = "replaced"
            spans.append((p1, p2, i))
            blocks[(p1, 0)] = Block(p1, ids, "replace")
    for p1, p2, i in spans:             # an insert inside a pair's span would interleave with it
        for s, k in gaps.items():
            if p1 < s <= p2:
                raise ValueError(f"actions[{k}] inserts before slot {s}, inside actions[{i}]'s pair "
                                 f"({p1}, {p2}); insert before {p1} or after {p2} instead")

    # layout: for each original slot s, the insert anchored before it, then the slot itself
    # (kept, removed, or replaced by its block)
    order = sorted(blocks, key=lambda key: (key[0], -key[1]))  # insert before a replace at one anchor
    index = {key: j for j, key in enumerate(order)}
    layout: list[tuple[str, int, int]] = []
    run = None
    for s in range(length + 1):
        if (s, 1) in blocks:
            if run is not None:
                layout.append(("old", run, s))
                run = None
            layout.append(("new", index[(s, 1)], 0))
        if s == length:
            break
        if s in deleted:
            if run is not None:
                layout.append(("old", run, s))
                run = None
            if (s, 0) in blocks:
                layout.append(("new", index[(s, 0)], 0))
        elif run is None:
            run = s
    if run is not None:
        layout.append(("old", run, length))

    # the seed's sequential order: descending anchor; at one anchor the removal before the insert
    steps: list[tuple[str, int, int]] = []
    ops = [(s, 1, "delete") for s, ev in deleted.items() if ev == "deleted"]
    ops += [(b.anchor, 1, "replace") for b in blocks.values() if b.kind == "replace"]
    ops += [(b.anchor, 0, "insert") for b in blocks.values() if b.kind == "insert"]
    for anchor, _, op in sorted(ops, reverse=True):
        if op == "delete":
            steps.append(("delete", anchor, -1))
        elif op == "insert":
            steps.append(("insert", anchor, index[(anchor, 1)]))
        else:
            p2 = next(q2 for q1, q2, _ in spans if q1 == anchor)
            steps += [("delete", p2, -1), ("delete", anchor, -1), ("insert", anchor, index[(anchor, 0)])]
    return TickPlan(length=length, actions=actions, deleted=deleted, blocks=tuple(blocks[k] for k in order),
                    adds=tuple(adds), layout=tuple(layout), steps=tuple(steps))


@dataclass(frozen=True)
class TickReport:
    """What one tick did and cost. ``splice_bytes``: bytes of K/V tensors written by the splice."""

    tick: int
    actions: int
    deleted: int
    inserted: int
    added: int
    length: int
    next_position: int
    splice: str
    splice_bytes: int
    compute_s: float
    splice_s: float
    add_s: float
    logits: torch.Tensor | None = field(default=None, repr=False)  # (V,) next-token logits after the last add
