"""Policy families a grid can sweep, from registries (never an if-chain over names).

A *section* of the grid spec (``[refresh.<family>]``, ``[evict.<family>]``) names a registry of
policy classes and the :class:`~kvlab.decode.DecodeConfig` field its policies go into. Adding a
policy to a registry (``kvlab.register_refresh`` / ``kvlab.register_eviction``) makes it sweepable; adding a section here makes a new kind of policy sweepable.
"""
from __future__ import annotations

import dataclasses


from kvlab.core.registry import SECTIONS, Section, evict_registry, refresh_registry  # noqa: F401,E402


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
