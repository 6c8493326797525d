"""kvlab — a research workbench for what happens to the KV cache while an LLM decodes.

The public names below load on first use (PEP 562), so ``import kvlab`` and ``python -m kvlab --help``
do not import torch or transformers.
"""
from __future__ import annotations

import importlib

# public name -> the submodule that defines it
_EXPORTS = {
    "KVCache": "cache", "Ledger": "cache", "Row": "cache",
    "IncompatiblePairError": "compat", "kv_compat": "compat",
    "DecodeConfig": "decode", "Decoding": "decode", "Sampling": "decode", "StepRecord": "decode", "Trace": "decode",
    "run": "decode",
    "repeat_at_n": "metrics", "score": "metrics",
    "LM": "models", "load_model": "models", "load_pair": "models", "load_student": "models", "load_teacher": "models",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value          # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
