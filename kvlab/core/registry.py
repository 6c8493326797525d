"""Policy registries: one name -> class table per kind of policy, read by everything that offers policies
by name (the sweep's grid sections, the playground's menus, the matched-memory table, the run store's rows).

A :class:`Registry` holds the built-in policies of its kind as plain data (the table its package
declares: nothing registers itself on import) plus whatever a user registers with :meth:`Registry.register`,
e.g. ``kvlab.register_eviction("mine")`` on a class defined in a notebook cell. It is a read-only
mapping ``name -> class``; :meth:`Registry.entry` gives the extras a consumer may need (how a policy is
built at a cache budget, which playground controls feed which fields). Pure Python: imports nothing
from kvlab, touches no tensors.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
BUDGET_FIELDS = ("budget", "window")      # the field a budget goes into when no from_budget is given
KNOB_MAX = 4096                           # the largest budget (entries) the matched-memory solver tries


@dataclass(frozen=True)
class Entry:
    """One registered policy: its name, class and how consumers build it.

    ``from_budget(budget) -> policy``: the policy holding at most about ``budget`` cache entries
    (eviction: the playground's budget slider, the matched-memory solver's knob); default: the class
    with its ``budget`` or ``window`` field set. ``controls``: playground control -> constructor field
    (refresh: e.g. ``{"T": "T", "tau_bits": "threshold"}``)."""

    name: str
    cls: type
    builtin: bool
    from_budget: Callable[[int], Any] | None = None
    controls: Mapping[str, str] = field(default_factory=dict)
    label: str = ""

    def at_budget(self, budget: int):
        """The policy at ``budget`` cache entries (raises the policy's own ValueError for a bad budget)."""
        if self.from_budget is not None:
            return self.from_budget(budget)
        params = init_fields(self.cls)
        for name in BUDGET_FIELDS:
            if name in params:
                try:
                    return self.cls(**{name: budget})
                except TypeError as e:     # another field without a default
                    raise ValueError(f"eviction policy {self.name!r}: {self.cls.__name__}({name}={budget}) fails ({e}); "
                                     "give its other fields defaults or register it with from_budget=") from None
        raise ValueError(f"eviction policy {self.name!r} ({self.cls.__name__}) has no budget/window field: register "
                         f"it with from_budget=lambda budget: {self.cls.__name__}(...)")

    def knob_range(self, hi: int = KNOB_MAX) -> tuple[int, int]:
        """``(lo, hi)``: the smallest budget :meth:`at_budget` accepts (searched from 1) and ``hi``."""
        for b in range(1, hi + 1):
            try:
                self.at_budget(b)
            except (ValueError, TypeError):
                continue
            return b, hi
        raise ValueError(f"eviction policy {self.name!r} accepts no budget in 1..{hi}")


def init_fields(cls) -> dict[str, Any]:
    """Constructor parameters of a policy class: ``name -> default`` (``inspect.Parameter.empty`` = required)."""
    if dataclasses.is_dataclass(cls):
        return {f.name: (f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
                for f in dataclasses.fields(cls) if f.init}
    return {n: p.default for n, p in inspect.signature(cls).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class Registry(Mapping):
    """``name -> policy class`` for one kind of policy: the built-ins (``builtins``: name -> class, or a
    zero-argument function returning it, loaded on first use) and the user's registrations.

    ``method``: the decision method every class of this kind has (``keep``, ``should_refresh``);
    ``reserved``: names that mean "no policy" in menus (e.g. ``none``)."""

    def __init__(self, kind: str, builtins: Mapping[str, Any], method: str, reserved: tuple[str, ...] = (),
                 register_fn: str = "register"):
        self.kind, self.method, self.reserved, self.register_fn = kind, method, tuple(reserved), register_fn
        self._builtins = dict(builtins)
        self._loaded: dict[str, type] = {}
        self._user: dict[str, Entry] = {}

    # ------------------------------------------------------------------ the mapping (built-ins first)

    def __getitem__(self, name: str) -> type:
        return self.entry(name).cls

    def __iter__(self):
        return iter([*self._builtins, *self._user])

    def __len__(self) -> int:
        return len(self._builtins) + len(self._user)

    def __contains__(self, name) -> bool:
        return name in self._builtins or name in self._user

    def __repr__(self) -> str:
        return f"<{self.kind} policies: {', '.join(self)}>"

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` of ``name`` (KeyError naming the known names)."""
        if name in self._user:
            return self._user[name]
        if name not in self._builtins:
            raise KeyError(f"{name!r} is not a registered {self.kind} policy; known: {', '.join(self)}")
        cls = self._loaded.get(name)
        if cls is None:
            obj = self._builtins[name]
            if isinstance(obj, str):                # "package.module:Class", imported on first use
                mod, _, attr = obj.partition(":")
                cls = getattr(importlib.import_module(mod), attr)
            else:
                cls = obj if isinstance(obj, type) else obj()
            self._loaded[name] = cls
        return Entry(name, cls, True, label=name)

    def user(self) -> tuple[str, ...]:
        """The names registered by the user (not built in), in registration order."""
        return tuple(self._user)

    def builtin(self) -> tuple[str, ...]:
        return tuple(self._builtins)

    # ------------------------------------------------------------------ registration

    def register(self, name: str, cls: type | None = None, *, from_budget: Callable[[int], Any] | None = None,
                 controls: Mapping[str, str] | None = None, label: str = ""):
        """Register ``cls`` as policy ``name``; without ``cls`` a class decorator.

        Registering a name again replaces it (re-running a notebook cell); a built-in name, a name that
        is not ``lower_snake_case``, a class without the decision method or with the class name of another
        entry (the run store tells policies apart by class name) raise ``ValueError`` naming the fix."""
        if cls is None:
            def deco(c):
                self.register(name, c, from_budget=from_budget, controls=controls, label=label)
                return c
            return deco
        fn = f"{self.register_fn}({name!r})"
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{fn}: the name must be lower_snake_case (letters, digits, _; it names a sweep "
                             f"section [{self.kind}.NAME] and table rows), e.g. 'my_policy'")
        if name in self._builtins or name in self.reserved:
            raise ValueError(f"{fn}: {name!r} is a built-in {self.kind} name; pick another name")
        if not isinstance(cls, type):
            raise ValueError(f"{fn} needs a class (got {cls!r}); use it as a decorator on the class")
        if not callable(getattr(cls, self.method, None)):
            raise ValueError(f"{fn}: {cls.__name__} needs a {self.method}(...) method (the {self.kind} protocol)")
        if from_budget is not None and not callable(from_budget):
            raise ValueError(f"{fn}: from_budget={from_budget!r} must be a function budget -> policy")
        params = init_fields(cls)
        controls = dict(controls or {})
        for control, fld in controls.items():
            if fld not in params:
                raise ValueError(f"{fn}: controls={{{control!r}: {fld!r}}} names no field of {cls.__name__}; "
                                 f"its fields: {', '.join(params) or '(none)'}")
        for other in self:
            if other != name and self._cls_name(other) == cls.__name__:
                raise ValueError(f"{fn}: a {self.kind} policy named {other!r} already has the class name "
                                 f"{cls.__name__!r} (stored runs name policies by class): rename the class"
                                 + (f" or unregister {other!r} first" if other in self._user else ""))
        self._user[name] = Entry(name, cls, False, from_budget, controls, label or name)
        return cls

    def unregister(self, name: str) -> None:
        """Remove a user registration (built-ins cannot be removed)."""
        if name in self._builtins:
            raise ValueError(f"{name!r} is a built-in {self.kind} policy and cannot be unregistered")
        if name not in self._user:
            raise KeyError(f"{name!r} is not a registered {self.kind} policy; registered by you: "
                           f"{', '.join(self._user) or '(none)'}")
        del self._user[name]

    def _cls_name(self, name: str) -> str:
        obj = self._user[name].cls if name in self._user else self._loaded.get(name, self._builtins[name])
        return obj.__name__ if isinstance(obj, type) else self.entry(name).cls.__name__


# --------------------------------------------------------------------------- the two registries

# The built-ins are named by "module:Class" and imported on first use, so this module (and the run store, which
# labels stored runs by family) needs nothing above the core.
EVICTION_POLICIES = Registry("eviction", {
    "full": "kvlab.eviction.full:FullCache",
    "sliding": "kvlab.eviction.sliding:SlidingWindow",
    "h2o": "kvlab.eviction.h2o:H2O",
    "random": "kvlab.eviction.random_evict:RandomEvict",
    "confkv": "kvlab.eviction.confkv:ConfKV",
    "block": "kvlab.eviction.block:BlockEvict",
    "snapkv": "kvlab.eviction.snapkv:SnapKV",
    "scissorhands": "kvlab.eviction.scissorhands:Scissorhands",
    "pyramidkv": "kvlab.eviction.pyramidkv:PyramidKV",
    "knorm": "kvlab.eviction.scorers:Knorm",
    "snapkv_scorer": "kvlab.eviction.scorers:SnapKVScorer",
}, method="keep", reserved=("none",), register_fn="register_eviction")

REFRESH_POLICIES = Registry("refresh", {
    "periodic": "kvlab.refresh.policies.periodic:Periodic",
    "entropy": "kvlab.refresh.policies.entropy:EntropyGate",
    "probe_kl": "kvlab.refresh.policies.probe_kl:ProbeKL",
    "speculative": "kvlab.refresh.policies.speculative:Speculative",
    "mc": "kvlab.uncertainty.mc:MCGate",
}, method="should_refresh", reserved=("none",), register_fn="register_refresh")


@dataclass(frozen=True)
class Section:
    """A kind of policy a run config holds: the sweep spec's table name (``[refresh.<family>]``), the
    :class:`~kvlab.decode.DecodeConfig` field its policies go into, its registry and the modes it applies to."""

    name: str                        # the spec's table name, e.g. "refresh"
    field: str                       # DecodeConfig field the policy goes into
    registry: Callable[[], dict]     # family name -> policy class
    modes: tuple[str, ...] | None    # decode modes the policies apply to (None = every mode)


def refresh_registry() -> dict[str, type]:
    """Refresh policies by family name (:data:`REFRESH_POLICIES`: built-ins and the user's ``register_refresh``)."""
    return dict(REFRESH_POLICIES)


def evict_registry() -> dict[str, type]:
    """Eviction policies by family name (:data:`EVICTION_POLICIES`: built-ins and the user's ``register_eviction``)."""
    return dict(EVICTION_POLICIES)


SECTIONS: dict[str, Section] = {
    "refresh": Section("refresh", "refresh", refresh_registry, ("overfill",)),
    "evict": Section("evict", "evict", evict_registry, None),
}
