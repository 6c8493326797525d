"""Policy families a grid can sweep, from registries (never an if-chain over names).

A *section* of the grid spec (``[refresh.<family>]``, ``[evict.<family>]``) names a registry of
policy classes and the :class:`~kvlab.decode.DecodeConfig` field its policies go into. Adding a
policy to a registry (``kvlab.register_refresh`` / ``kvlab.register_eviction``) makes it sweepable; adding a section here makes a new kind of policy sweepable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable


def refresh_registry() -> dict[str, type]:
    """Refresh policies by family name (``kvlab.refresh.policies.REFRESH_POLICIES``: built-ins and
    the user's ``register_refresh``)."""
    from kvlab.refresh.policies import REFRESH_POLICIES

    return dict(REFRESH_POLICIES)


def evict_registry() -> dict[str, type]:
    """Eviction policies by family name (``kvlab.eviction.EVICTION_POLICIES``: built-ins and the user's
    ``register_eviction``)."""
    from kvlab.eviction import EVICTION_POLICIES

    return dict(EVICTION_POLICIES)


@dataclass(frozen=True)
class Section:
    name: str                        # the spec's table name, e.g. "refresh"
    field: str                       # DecodeConfig field the policy goes into
    registry: Callable[[], dict]     # family name -> policy class
    modes: tuple[str, ...] | None    # decode modes the policies apply to (None = every mode)


SECTIONS: dict[str, Section] = {
    "refresh": Section("refresh", "refresh", refresh_registry, ("overfill",)),
    "evict": Section("evict", "evict", evict_registry, None),
}


def parameters(cls) -> dict[str, dataclasses.Field]:
    """The constructor parameters of a policy class (dataclass init fields)."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f for f in dataclasses.fields(cls) if f.init}
    import inspect

    sig = inspect.signature(cls)
    return {n: p for n, p in sig.parameters.items() if n != "self"}


def required(cls) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    import inspect

    return [n for n, p in inspect.signature(cls).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
