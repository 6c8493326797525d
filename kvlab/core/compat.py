"""KV compatibility of two models: can one's cache be handed to the other?
Reads the two models' configs only; touches no weights, caches or files.

Seed 000: passing KV across models is dimensionally valid only if attention geometry and
positional encoding match (tokenizer, heads, head size, layers, RoPE parameters).
"""
from __future__ import annotations

import functools
import inspect

from dataclasses import dataclass


@dataclass(frozen=True)
class Mismatch:
    field: str
    teacher: object
    student: object

    def __str__(self) -> str:
        return f"{self.field}: teacher={self.teacher!r} student={self.student!r}"


@dataclass(frozen=True)
class Compat:
    mismatches: tuple[Mismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def fields(self) -> list[str]:
        return [m.field for m in self.mismatches]

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return "KV-compatible" if self.ok else "KV-incompatible: " + "; ".join(map(str, self.mismatches))


class IncompatiblePairError(ValueError):
    """Teacher and student caches cannot be exchanged; ``.compat`` lists the fields."""

    def __init__(self, compat: Compat):
        self.compat = compat
        super().__init__(f"{compat}. Use a student with the teacher's KV geometry, or pass "
                         "rebuild_student_cache=True (DecodeConfig; on the command line: --rebuild-student-cache) "
                         "to recompute the student's cache from text (no refresh then: it needs one geometry).")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if not params:  # older configs
        params = {"rope_theta": getattr(cfg, "rope_theta", None), **(getattr(cfg, "rope_scaling", None) or {})}
    return {k: v for k, v in sorted(dict(params).items())}


def _config_fields(cfg) -> dict:
    return {
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": _head_dim(cfg),
        "rope_theta": _rope(cfg).get("rope_theta"),
        "rope_scaling": {k: v for k, v in _rope(cfg).items() if k != "rope_theta"},
        "vocab_size": cfg.vocab_size,
    }


def _tokenizer_fingerprint(tok) -> tuple:
    vocab = tok.get_vocab()
    return len(vocab), hash(tuple(sorted(vocab.items())))


def kv_compat(teacher, student) -> Compat:
    """Every field on which the two models' KV caches disagree (empty → compatible).

    Accepts :class:`kvlab.core.models.LM` objects (config + tokenizer) or bare configs.
    """
    tcfg = getattr(teacher, "config", teacher)
    scfg = getattr(student, "config", student)
    tf, sf = _config_fields(tcfg), _config_fields(scfg)
    out = [Mismatch(k, tf[k], sf[k]) for k in tf if tf[k] != sf[k]]
    ttok, stok = getattr(teacher, "tokenizer", None), getattr(student, "tokenizer", None)
    if ttok is not None and stok is not None and ttok is not stok:
        a, b = _tokenizer_fingerprint(ttok), _tokenizer_fingerprint(stok)
        if a != b:
            out.append(Mismatch("tokenizer", f"{a[0]} tokens", f"{b[0]} tokens" + (" (different map)" if a[0] == b[0] else "")))
    return Compat(tuple(out))


def cache_kwarg(model) -> str:
    """The keyword the installed transformers' ``model.forward`` takes the KV cache under: ``"cache"``
    (transformers >= 5.24, where ``past_key_values`` is deprecated and warns on every call) or
    ``"past_key_values"`` (earlier 5.x). Read from the forward's signature, never from a version string."""
    return _cache_kwarg(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The KV cache a forward returned: ``out.cache`` (transformers >= 5.24, where reading
    ``out.past_key_values`` logs a deprecation on first use) or ``out.past_key_values`` (earlier 5.x)."""
    return out.cache if "cache" in getattr(out, "__dataclass_fields__", {}) else out.past_key_values
