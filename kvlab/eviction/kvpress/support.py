"""Which kvpress presses run in kvlab, and the up-front refusal of the others (a ValueError naming the press
and what kvlab lacks, raised when the policy is built: before any model work).

kvlab runs a press through its ``score`` (kvpress's ``ScorerPress`` protocol): one score per KV head and
cached entry, averaged over heads, and kvlab's budget picks the survivors of each layer
(:mod:`kvlab.eviction.scorer`). Two wrappers map onto kvlab's own protocol through
:func:`kvlab.eviction.kvpress.from_kvpress`: ``DecodingPress`` (decode-time eviction) and
``KeyRerotationPress`` (RoPE re-rotation of the survivors). Everything else edits the cache in ways a kvlab
policy does not (head-wise budgets, merged or rewritten entries, pruned channels, its own forwards) and is
refused with the reason below.
"""
from __future__ import annotations

from kvlab.eviction.kvpress.detect import is_press, press_name

_HEADWISE = ("a different number of entries per KV head (head-wise budgets, kvpress's masked_key_indices through "
             "its patched attention); kvlab's cache keeps one live set per layer")
_OWN_FORWARD = ("it scores entries by running the model again over a repeated context through the HF cache "
                "object; a kvlab policy decides on the cache it is shown and never runs the model")
_CHUNKS = ("it runs its inner press chunk by chunk (a budget per chunk); kvlab ranks each layer's whole cache: "
           "pass the inner press itself (ScorerPolicy(press.press, budget=...))")

# press class -> what kvlab lacks to run it (a subclass inherits its base's entry)
LACKS: dict[str, str] = {
    "AdaKVPress": _HEADWISE + "; pass the inner press itself (ScorerPolicy(press.press, budget=...))",
    "CriticalAdaKVPress": _HEADWISE + "; CriticalKVPress (one set per layer) runs",
    "DuoAttentionPress": _HEADWISE + " (streaming vs retrieval heads, a per-model pattern it downloads)",
    "LUKVPress": _HEADWISE + " (per-head budget curves it downloads)",
    "KVComposePress": _HEADWISE,
    "DMSPress": _HEADWISE + ", at decode time",
    "FastKVzipPress": _HEADWISE + " (and trained gates it downloads)",
    "KVzipPress": _OWN_FORWARD,
    "KVgradPress": _OWN_FORWARD,
    "RestoreKVPress": _OWN_FORWARD + " (and a LoRA adapter it downloads)",
    "ComposedPress": ("it chains presses that each compress the cache in turn; a kvlab run has one eviction "
                      "policy: run each press on its own"),
    "PrefillDecodingPress": ("it holds two presses (prefill and decode); a kvlab run has one eviction policy: "
                             "ScorerPolicy(press.prefilling_press, budget=...) for prompt compression, "
                             "from_kvpress(press.decoding_press) for decode time"),
    "PerLayerCompressionPress": ("per-layer compression ratios; kvlab's budget is the same number of entries on "
                                 "every layer (pass the inner press: ScorerPolicy(press.press, budget=...))"),
    "ChunkPress": _CHUNKS, "ChunkKVPress": _CHUNKS, "BlockPress": _CHUNKS,
    "ThinKPress": "it prunes key channels (the head dimension), not entries; kvlab's cache evicts whole entries",
    "SimLayerKVPress": ("it picks 'lazy' layers and keeps a sliding window on those only (no score); use kvlab's "
                        "sliding-window policy, or a ScorerPress"),
    "FinchPress": ("it needs the prompt split by a delimiter token and re-rotates inside its compress; kvlab "
                   "shows a policy no token ids"),
    "MergingPress": "it merges evicted entries into kept ones (rewrites values); a kvlab policy only evicts",
    "CompressionRatioDecodingPress": ("its decode-time budget is a ratio of the sequence so far; kvlab's budget "
                                      "is a fixed number of entries (use DecodingPress with target_size)"),
    "CAMPress": "it merges evicted values into kept ones at decode time (rewrites values); a kvlab policy only evicts",
}

MAPPED = {"DecodingPress": "from_kvpress: decode-time eviction (every_step=True, budget=target_size, "
                           "interval=compression_interval)",
          "KeyRerotationPress": "from_kvpress: its inner press with kvlab's re-rotation (rerotate=True)"}


def _kvpress_base(name: str):
    import kvpress

    return getattr(kvpress, name)


def is_scorer(press) -> bool:
    """``press`` is a kvpress ``ScorerPress`` (the protocol kvlab runs through ``score``)."""
    return is_press(press) and isinstance(press, _kvpress_base("ScorerPress"))


def _lack(press) -> tuple[str | None, str | None]:
    """``(class name, reason)`` of the first class in the press's MRO with an entry in LACKS / MAPPED."""
    for c in type(press).__mro__:
        if c.__name__ in MAPPED:
            return c.__name__, None
        if c.__name__ in LACKS:
            return c.__name__, LACKS[c.__name__]
    return None, None


# scorers whose score asserts that it sees the prefill (hidden states as long as the cache)
PREFILL_ONLY = ("CompactorPress", "LeverageScorePress", "NonCausalAttnPress")


def check_press(press, via: str = "ScorerPolicy", every_step: bool = False) -> None:
    """Refuse, before anything runs, a press kvlab cannot run as ``via`` builds it: ValueError naming the
    press and what kvlab lacks. ``via="from_kvpress"`` also accepts the mapped wrappers; ``every_step``
    (decode-time eviction) refuses the prefill-only scorers."""
    name = press_name(press)
    if is_scorer(press):
        if every_step and any(c.__name__ in PREFILL_ONLY for c in type(press).__mro__):
            raise ValueError(f"{name} scores the prefill only (its score asserts hidden states as long as the "
                             "cache); kvlab's decode-time eviction shows it the last inputs_window tokens: use "
                             "every_step=False (prompt compression)")
        return
    base, why = _lack(press)
    if why is None and base in MAPPED:
        if via == "from_kvpress":
            return
        raise ValueError(f"{name} is not a ScorerPress: build it with kvlab.from_kvpress(press, budget=...) "
                         f"({MAPPED[base]})")
    why = why or ("it is not a ScorerPress (it overrides compress / forward_hook); kvlab runs a press through "
                  "its score(module, hidden_states, keys, values, attentions, kwargs)")
    raise ValueError(f"kvlab cannot run {name}: {why}")


def installed_presses() -> list[dict]:
    """Every press the installed kvpress exports (``kvpress.__all__``), each as ``{"press": name, "runs":
    "scorer" | "from_kvpress" | "refused", "why": str}`` — for menus (playground, cache inspector).
    ``[]`` when kvpress is not installed."""
    try:
        import kvpress
    except ImportError:
        return []
    base = kvpress.BasePress
    out = []
    for name in sorted(getattr(kvpress, "__all__", ())):
        cls = getattr(kvpress, name, None)
        if not isinstance(cls, type) or not issubclass(cls, base) or cls in (base, kvpress.ScorerPress):
            continue
        if issubclass(cls, kvpress.ScorerPress):
            runs, why = "scorer", "its score(), head-mean, at kvlab's budget"
            if any(c.__name__ in PREFILL_ONLY for c in cls.__mro__):
                why += " (prompt compression only)"
        else:
            hit = next((c.__name__ for c in cls.__mro__ if c.__name__ in MAPPED or c.__name__ in LACKS), None)
            runs = "from_kvpress" if hit in MAPPED else "refused"
            why = MAPPED.get(hit) or LACKS.get(hit) or "not a ScorerPress"
        out.append({"press": name, "runs": runs, "why": why})
    return out
