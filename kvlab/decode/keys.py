"""A policy as JSON-able config for run keys and tables (:func:`policy_dict`), with a digest of the code of
classes defined outside kvlab (:func:`code_digest`). Stored runs are keyed by these dicts: moving a policy's
module leaves its key unchanged (class name and fields only), renaming its class or a field does not."""
from __future__ import annotations


def policy_dict(policy) -> dict | None:
    """A policy as JSON-able config (class name + fields) for run keys and tables.

    A class defined outside kvlab (your own policy, e.g. in a notebook cell) also gets ``code``: a digest
    of its methods' bytecode (:func:`code_digest`), so editing the class and re-running the cell keys new
    runs instead of answering from runs the old code stored.

    A field holding an object with behaviour of its own (an instance of a class or a function, e.g. the
    scorer of :class:`kvlab.eviction.scorer.ScorerPolicy`) is written as its own ``policy_dict`` (class
    name, fields, ``code`` when defined outside kvlab); a function as ``{"function": qualname, "code": …}``.
    Policies without such fields get the same dict as before."""
    if policy is None:
        return None
    from dataclasses import asdict, fields as dc_fields, is_dataclass

    if is_dataclass(policy):
        out = {"policy": type(policy).__name__, **asdict(policy)}
        for f in dc_fields(policy):
            v = getattr(policy, f.name)
            if getattr(v, "__code__", None) is not None:
                out[f.name] = {"function": getattr(v, "__qualname__", repr(v)), "code": _fn_digest(v.__code__)}
            elif hasattr(v, "__dict__") and not isinstance(v, type):      # an object: a dataclass or a plain class
                out[f.name] = policy_dict(v)
    else:
        out = {"policy": type(policy).__name__, **dict(vars(policy))}
    if not type(policy).__module__.startswith("kvlab."):
        out["code"] = code_digest(type(policy))
    return out


def _code_parts(c) -> list:
    """Bytecode, constants (nested code included) and names of one code object; no file names or lines."""
    def const(k):
        if hasattr(k, "co_code"):
            return _code_parts(k)
        return sorted(map(repr, k)) if isinstance(k, frozenset) else repr(k)   # set order varies with the hash seed

    return [c.co_code.hex(), [const(k) for k in c.co_consts], list(c.co_names)]


def _fn_digest(c) -> str:
    import hashlib

    return hashlib.sha256(repr(_code_parts(c)).encode()).hexdigest()[:12]


def code_digest(cls) -> str:
    """12 hex digits naming what a class's methods do: bytecode, constants and names of every function,
    property and static/class method defined in its body (nested code included; file names and line
    numbers excluded, so re-running an unchanged notebook cell gives the same digest)."""
    import hashlib

    parts = []
    for name, v in sorted(vars(cls).items()):
        for fn in (getattr(v, "__func__", None), getattr(v, "fget", None), v):
            c = getattr(fn, "__code__", None)
            if c is not None:
                parts.append([name, _code_parts(c)])
                break
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
