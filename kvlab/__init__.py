"""kvlab — a research workbench for what happens to the KV cache while an LLM decodes.
Importing it loads no model and touches nothing.

The public names below load on first use (PEP 562), so ``import kvlab`` and ``python -m kvlab --help``
do not import torch or transformers.
"""
from __future__ import annotations

import importlib

# The public API, in one place: public name -> the module that defines it (loaded on first use).
_EXPORTS = {
    # the cache and the loop
    "KVCache": "cache", "Ledger": "cache", "Row": "cache",
    "DecodeConfig": "decode", "Decoding": "decode", "Sampling": "decode", "StepRecord": "decode", "Trace": "decode",
    "run": "decode",
    # models and the embedded pair
    "IncompatiblePairError": "core.compat", "kv_compat": "core.compat",
    "LM": "core.models", "load_model": "core.models", "load_teacher": "core.models",
    "load_pair": "train.pair", "load_student": "train.pair",
    "repeat_at_n": "core.metrics", "score": "core.metrics",
    # refresh policies
    "EntropyGate": "refresh.policies", "Periodic": "refresh.policies", "ProbeKL": "refresh.policies",
    "Speculative": "refresh.policies", "MCGate": "uncertainty.mc",
    # your own policies (docs/custom_policies.md): @kvlab.register_eviction("mine") / @kvlab.register_refresh("mine")
    "register_eviction": "eviction", "unregister_eviction": "eviction",
    "register_refresh": "refresh.policies", "unregister_refresh": "refresh.policies",
    "REFRESH_POLICIES": "refresh.policies",
    # eviction policies
    "BlockEvict": "eviction", "ConfKV": "eviction", "FullCache": "eviction", "H2O": "eviction",
    "PyramidKV": "eviction", "RandomEvict": "eviction", "Scissorhands": "eviction", "SlidingWindow": "eviction", "StreamingLLM": "eviction",
    "SnapKV": "eviction", "Every": "eviction", "EVICTION_POLICIES": "eviction",
    "ScorerPolicy": "eviction", "Knorm": "eviction", "SnapKVScorer": "eviction",
    "from_kvpress": "eviction.press_policy",     # kvpress's presses (optional install; imported only when used)
    # the run store
    "RunStore": "store", "Store": "store",
}
# submodules reachable as attributes: ``from kvlab import results; results.load(...)``
_MODULES = {"results": "store.results"}

__all__ = [*_EXPORTS, *_MODULES]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value          # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
