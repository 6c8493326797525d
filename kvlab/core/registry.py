"""Policy registries: one name -> class table per kind of policy, read by everything that offers policies
by name (the sweep's grid sections, the playground's menus, the matched-memory study, the CLI's ``--policy``,
the run store's rows).

Built-in and user policies register the same way: a class decorated with ``register_eviction("name", ...)``
(or ``register_refresh``) — ``kvlab.eviction.h2o`` does it for H2O as a notebook cell does it for yours.
A :class:`Registry` finds its built-ins by importing, on its FIRST READ, every module of its packages
(``kvlab.eviction``, ``kvlab.refresh.policies``, ``kvlab.uncertainty.mc``) and the modules named in the
``KVLAB_PLUGINS`` environment variable (comma-separated module names on ``sys.path``: your own policy
files outside kvlab); importing this module does nothing. A registration made by a module of the registry's
packages (a policy file decorating its own class) is a built-in (its name is reserved; it cannot be unregistered); any other is the user's. So adding a policy
is one file: ``kvlab/eviction/mine.py`` (or a plugin module) with one decorated class
(docs/custom_policies.md).

It is a read-only mapping ``name -> class`` (built-ins in their declared ``order``, then the user's in
registration order); :meth:`Registry.entry` gives the extras a consumer may need (how a policy is built at a
cache budget under a study's setup, which playground controls feed it). Pure Python: imports nothing from
kvlab at import time, touches no tensors.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
BUDGET_FIELDS = ("budget", "window")      # the field a budget goes into when no from_budget is given
KNOB_MAX = 4096                           # the largest budget (entries) the matched-memory solver tries
PLUGINS_ENV = "KVLAB_PLUGINS"             # comma-separated modules imported on a registry's first read


def setup_for(fn: Callable, setup: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``setup`` that ``fn`` names (all of them when it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(setup)
    return {k: v for k, v in setup.items() if k in params}


@dataclass(frozen=True)
class Entry:
    """One registered policy: its name, class and how consumers build it.

    ``from_budget(budget, **setup) -> policy``: the policy holding at most about ``budget`` cache entries
    (the playground's budget slider, the matched-memory solver's knob, the needle grid, the benchmarks);
    default: the class's own ``from_budget`` classmethod, else the class with its ``budget`` or ``window``
    field set. A *setup* is what a study fixes besides the budget (``sinks``, ``recent``: the protected
    newest entries, ``block_size``, ``seed``, ...): :meth:`at_budget` passes each ``from_budget`` only the
    setup keywords it names, so one setup serves every policy. ``controls``: playground control ->
    keyword (refresh: constructor field, e.g. ``{"kappa": "margin"}``; eviction: ``from_budget`` keyword,
    e.g. ``{"recent": "recent"}``). ``knob``: the ``from_budget`` keyword the matched-memory solver's
    integer knob sets (``"budget"``; block eviction: ``"blocks"``), searched in ``1 .. knob_max``."""

    name: str
    cls: type
    builtin: bool
    from_budget: Callable[..., Any] | None = None
    controls: Mapping[str, str] = field(default_factory=dict)
    label: str = ""
    order: float | None = None
    knob: str = "budget"
    knob_max: int = KNOB_MAX

    def builder(self) -> Callable[..., Any] | None:
        """The registration's ``from_budget``, else the class's ``from_budget`` classmethod, else None."""
        if self.from_budget is not None:
            return self.from_budget
        fn = getattr(self.cls, "from_budget", None)
        return fn if callable(fn) else None

    def at_budget(self, budget: int | None, **setup):
        """The policy at ``budget`` cache entries under ``setup`` (raises the policy's own ValueError for a bad
        budget)."""
        fn = self.builder()
        if fn is not None:
            return fn(budget, **setup_for(fn, setup))
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

    def at_knob(self, k: int, **setup):
        """The policy at solver knob ``k`` (:attr:`knob`) under ``setup``."""
        if self.knob == "budget":
            return self.at_budget(k, **setup)
        return self.at_budget(None, **{**setup, self.knob: k})

    def knob_range(self, hi: int | None = None, **setup) -> tuple[int, int]:
        """``(lo, hi)``: the smallest knob :meth:`at_knob` accepts under ``setup`` (searched from 1) and ``hi``
        (default :attr:`knob_max`)."""
        hi = self.knob_max if hi is None else hi
        for b in range(1, hi + 1):
            try:
                self.at_knob(b, **setup)
            except (ValueError, TypeError):
                continue
            return b, hi
        raise ValueError(f"eviction policy {self.name!r} accepts no {self.knob} in 1..{hi}")

    def solver(self, **setup) -> tuple[Callable[[int], Any], int, int]:
        """``(knob -> policy, knob lo, knob hi)`` under ``setup``: a family of the matched-memory study."""
        return (lambda k: self.at_knob(k, **setup)), *self.knob_range(**setup)


def init_fields(cls) -> dict[str, Any]:
    """Constructor parameters of a policy class: ``name -> default`` (``inspect.Parameter.empty`` = required)."""
    if dataclasses.is_dataclass(cls):
        return {f.name: (f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
                for f in dataclasses.fields(cls) if f.init}
    return {n: p.default for n, p in inspect.signature(cls).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class Registry(Mapping):
    """``name -> policy class`` for one kind of policy: the built-ins (found in ``packages`` on first read) and
    the user's registrations.

    ``packages``: modules or packages whose classes are built-ins (a package: every module in it is imported
    on first read); ``method``: the decision method every class of this kind has (``keep``,
    ``should_refresh``); ``reserved``: names that mean "no policy" in menus (e.g. ``none``)."""

    def __init__(self, kind: str, packages: tuple[str, ...], method: str, reserved: tuple[str, ...] = (),
                 register_fn: str = "register"):
        self.kind, self.method, self.reserved, self.register_fn = kind, method, tuple(reserved), register_fn
        self.packages = tuple(packages)
        self._builtins: dict[str, Entry] = {}
        self._user: dict[str, Entry] = {}
        self._found = False

    # ------------------------------------------------------------------ discovery (first read)

    def _discover(self) -> None:
        if self._found:
            return
        self._found = True                  # before importing: the modules' registrations read the registry
        try:
            for mod in modules_of(self.packages) + plugin_modules():
                try:
                    importlib.import_module(mod)
                except Exception as e:
                    raise ImportError(f"{self.kind} policies: importing {mod} failed ({type(e).__name__}: {e}); "
                                      f"fix that module" + (f" or drop it from {PLUGINS_ENV}" if mod in plugin_modules()
                                                            else "")) from e
        except BaseException:
            self._found = False
            raise

    def _is_builtin(self, mod: str) -> bool:
        return any(mod == p or mod.startswith(p + ".") for p in self.packages)

    def _names(self) -> list[str]:
        self._discover()
        order = sorted(self._builtins.values(), key=lambda e: (e.order is None, e.order or 0))
        return [e.name for e in order] + list(self._user)

    # ------------------------------------------------------------------ the mapping (built-ins first)

    def __getitem__(self, name: str) -> type:
        return self.entry(name).cls

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        self._discover()
        return name in self._builtins or name in self._user

    def __repr__(self) -> str:
        return f"<{self.kind} policies: {', '.join(self)}>"

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` of ``name`` (KeyError naming the known names)."""
        self._discover()
        if name in self._user:
            return self._user[name]
        if name not in self._builtins:
            raise KeyError(f"{name!r} is not a registered {self.kind} policy; known: {', '.join(self)}")
        return self._builtins[name]

    def user(self) -> tuple[str, ...]:
        """The names registered by the user (not built in), in registration order."""
        self._discover()
        return tuple(self._user)

    def builtin(self) -> tuple[str, ...]:
        return tuple(n for n in self._names() if n in self._builtins)

    # ------------------------------------------------------------------ registration

    def register(self, name: str, cls: type | None = None, *, from_budget: Callable[..., Any] | None = None,
                 controls: Mapping[str, str] | None = None, label: str = "", order: float | None = None,
                 knob: str = "budget", knob_max: int = KNOB_MAX):
        """Register ``cls`` as policy ``name``; without ``cls`` a class decorator (the form every policy file
        uses, built-in or not).

        ``from_budget``, ``controls``, ``knob``, ``knob_max``: :class:`Entry`; ``label``: the menu's text
        (default ``name``); ``order``: the built-ins' menu position. Registering a name again replaces it
        (re-running a notebook cell); a user class taking a built-in name, a name that is not
        ``lower_snake_case``, a class without the decision method or with the class name of another
        entry (the run store tells policies apart by class name) raise ``ValueError`` naming the fix."""
        if cls is None:
            def deco(c):
                self._register(name, c, sys._getframe(1).f_globals.get("__name__", ""), from_budget=from_budget,
                               controls=controls, label=label, order=order, knob=knob, knob_max=knob_max)
                return c
            return deco
        return self._register(name, cls, sys._getframe(1).f_globals.get("__name__", ""), from_budget=from_budget,
                              controls=controls, label=label, order=order, knob=knob, knob_max=knob_max)

    def _register(self, name: str, cls, module: str, *, from_budget, controls, label, order, knob, knob_max):
        """:meth:`register` from code in ``module``: a built-in when that module lies in the registry's packages
        (a policy file registering its own class), else the user's."""
        fn = f"{self.register_fn}({name!r})"
        builtin = self._is_builtin(module)
        if not builtin:
            self._discover()                # a user name must not take a built-in's
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{fn}: the name must be lower_snake_case (letters, digits, _; it names a sweep "
                             f"section [{self.kind}.NAME] and table rows), e.g. 'my_policy'")
        if name in self.reserved or (not builtin and name in self._builtins):
            raise ValueError(f"{fn}: {name!r} is a built-in {self.kind} name; pick another name")
        if not isinstance(cls, type):
            raise ValueError(f"{fn} needs a class (got {cls!r}); use it as a decorator on the class")
        if not callable(getattr(cls, self.method, None)):
            raise ValueError(f"{fn}: {cls.__name__} needs a {self.method}(...) method (the {self.kind} protocol)")
        if from_budget is not None and not callable(from_budget):
            raise ValueError(f"{fn}: from_budget={from_budget!r} must be a function budget -> policy")
        entry = Entry(name, cls, builtin, from_budget, dict(controls or {}), label or name, order, knob, knob_max)
        builder = entry.builder()
        params = {**init_fields(cls), **(inspect.signature(builder).parameters if builder is not None else {})}
        for control, fld in entry.controls.items():
            if fld not in params:
                raise ValueError(f"{fn}: controls={{{control!r}: {fld!r}}} names no field of {cls.__name__}; "
                                 f"its fields: {', '.join(params) or '(none)'}")
        for other, e in [*self._builtins.items(), *self._user.items()]:
            if other != name and e.cls.__name__ == cls.__name__:
                raise ValueError(f"{fn}: a {self.kind} policy named {other!r} already has the class name "
                                 f"{cls.__name__!r} (stored runs name policies by class): rename the class"
                                 + (f" or unregister {other!r} first" if other in self._user else ""))
        (self._builtins if builtin else self._user)[name] = entry
        return cls

    def unregister(self, name: str) -> None:
        """Remove a user registration (built-ins cannot be removed)."""
        self._discover()
        if name in self._builtins:
            raise ValueError(f"{name!r} is a built-in {self.kind} policy and cannot be unregistered")
        if name not in self._user:
            raise KeyError(f"{name!r} is not a registered {self.kind} policy; registered by you: "
                           f"{', '.join(self._user) or '(none)'}")
        del self._user[name]


def modules_of(packages: tuple[str, ...]) -> list[str]:
    """Every module to import for ``packages``: a package's own modules (not ``_private`` ones), a module itself."""
    out = []
    for name in packages:
        pkg = importlib.import_module(name)
        out.append(name)
        for m in sorted(pkgutil.iter_modules(getattr(pkg, "__path__", None) or []), key=lambda m: m.name):
            if not m.name.startswith("_"):
                out.append(f"{name}.{m.name}")
    return out


def plugin_modules() -> list[str]:
    """The modules named in ``KVLAB_PLUGINS`` (comma-separated), imported on a registry's first read."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


# --------------------------------------------------------------------------- the two registries

EVICTION_POLICIES = Registry("eviction", ("kvlab.eviction",), method="keep", reserved=("none",),
                             register_fn="register_eviction")
REFRESH_POLICIES = Registry("refresh", ("kvlab.refresh.policies", "kvlab.uncertainty.mc"), method="should_refresh",
                            reserved=("none",), register_fn="register_refresh")
register_eviction = EVICTION_POLICIES.register      # @register_eviction("mine") on a policy class
register_refresh = REFRESH_POLICIES.register


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
