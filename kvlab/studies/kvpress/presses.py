"""The presses of the kvpress study and the policies each mode builds from them.

A press runs unchanged as a kvlab policy (:class:`kvlab.eviction.scorer.ScorerPolicy`): ``prefill`` mode is
prompt compression (``every_step=False``: one cut to ``budget`` entries per layer when the cache holds the
prompt, kvpress's own use), ``decode`` mode is decode-time eviction (``every_step=True``: a cut at every step
that ends over budget). Every row keeps ``sinks`` attention sinks (kvlab's rule, beside the press's scores).

The reference row is kvlab's native sliding window at the same budget and sinks: ``SlidingWindow`` in decode
mode; in prefill mode the same keep rule applied once to the prompt, i.e. a :class:`ScorerPolicy` whose score
is the entry's position (:class:`Recency`: the newest ``budget - sinks`` and the sinks survive, as
``SlidingWindow`` keeps them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MODES = ("prefill", "decode")
REFERENCE = "sliding"
FULL = "full"


@dataclass(frozen=True)
class Recency:
    """A score function: each entry's absolute position (newer = more important). Under a
    ``ScorerPolicy`` it keeps what ``SlidingWindow(window=budget, sinks)`` keeps."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        import torch

        pos = kwargs["positions"].to(device=keys.device, dtype=torch.float32)
        return pos.view(1, 1, -1).expand(keys.shape[0], keys.shape[1], -1)


def _press(name: str, **kw) -> Callable[[], object]:
    def make():
        import kvpress

        return getattr(kvpress, name)(**kw)
    return make


def _critical() -> object:
    import kvpress

    return kvpress.CriticalKVPress(kvpress.KnormPress())


# name -> factory of the press as the study runs it: kvpress's defaults, except a 16-token observation window for
# SnapKV / PyramidKV (kvpress's default 64 is a sixth of these prompts), StreamingLLM's 4 sinks, a seeded RandomPress
# (reproducible), and CriticalKV around Knorm (its cheapest inner scorer).
PRESSES: dict[str, Callable[[], object]] = {
    "KnormPress": _press("KnormPress"),
    "SnapKVPress": _press("SnapKVPress", window_size=16),
    "PyramidKVPress": _press("PyramidKVPress", window_size=16),
    "ExpectedAttentionPress": _press("ExpectedAttentionPress"),
    "TOVAPress": _press("TOVAPress"),
    "StreamingLLMPress": _press("StreamingLLMPress", n_sink=4),
    "ObservedAttentionPress": _press("ObservedAttentionPress"),
    "CURPress": _press("CURPress"),
    "LagKVPress": _press("LagKVPress"),
    "KeyDiffPress": _press("KeyDiffPress"),
    "RandomPress": _press("RandomPress", seed=0),
    "CriticalKVPress": _critical,
    "CapPress": _press("CapPress"),
    "LeverageScorePress": _press("LeverageScorePress"),
    "CompactorPress": _press("CompactorPress"),
    "NonCausalAttnPress": _press("NonCausalAttnPress"),
}
# the presses that score per KV head (the head-mean study: kvlab averages their scores over heads)
PER_HEAD = ("SnapKVPress", "ExpectedAttentionPress", "KnormPress", "TOVAPress")


def make_press(name: str):
    """A fresh press of the study (:data:`PRESSES`), or any kvpress class by name with its defaults."""
    if name in PRESSES:
        return PRESSES[name]()
    import kvpress

    cls = getattr(kvpress, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"press={name!r} is not a kvpress class; the study's presses: {', '.join(PRESSES)}")
    return cls()


def check_modes(modes) -> tuple[str, ...]:
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes={modes!r} must be a non-empty subset of {MODES} (prefill = prompt compression, "
                         "decode = decode-time eviction)")
    return modes


def decode_capable(press) -> bool:
    """The press may run at decode time (kvlab refuses the prefill-only scorers for ``every_step``)."""
    from kvlab.eviction.kvpress.support import PREFILL_ONLY

    return not any(c.__name__ in PREFILL_ONLY for c in type(press).__mro__)


def policy(press, mode: str, budget: int, sinks: int):
    """``press`` (a kvpress press, or :data:`REFERENCE` for kvlab's sliding window) as the ``mode``'s policy."""
    from kvlab.eviction import SlidingWindow
    from kvlab.eviction.scorer import ScorerPolicy

    check_modes((mode,))
    if isinstance(press, str):
        if press != REFERENCE:
            raise ValueError(f"press={press!r}: a kvpress press object, or {REFERENCE!r} (kvlab's sliding window)")
        return (ScorerPolicy(Recency(), budget=budget, sinks=sinks) if mode == "prefill"
                else SlidingWindow(window=budget, sinks=sinks))
    return ScorerPolicy(press, budget=budget, sinks=sinks, every_step=mode == "decode")


def study_policies(presses, budget: int, sinks: int, modes=MODES) -> tuple[dict, list[dict]]:
    """``({(name, mode): policy}, skipped)``: the reference at every mode, each press at each mode it supports;
    ``skipped`` lists ``{"press", "mode", "why"}`` for the refused pairs (prefill-only presses at decode)."""
    modes = check_modes(modes)
    pols, skipped = {}, []
    for mode in modes:
        pols[(REFERENCE, mode)] = policy(REFERENCE, mode, budget, sinks)
    for name in presses:
        for mode in modes:
            press = make_press(name)
            if mode == "decode" and not decode_capable(press):
                skipped.append({"press": name, "mode": mode, "why": "scores the prefill only (kvlab refuses it "
                                "for decode-time eviction)"})
                continue
            pols[(name, mode)] = policy(press, mode, budget, sinks)
    return pols, skipped


def families(names, sinks: int, modes=("decode",)) -> dict:
    """The presses as fixed-budget families of the matched-memory study, in its format (``EvictStudy.families``:
    name -> (budget -> policy, lowest budget, highest)): ``kvpress_<Class>_<mode>`` for each press and mode it
    supports (the CLI's ``evict --kvpress NAME[,NAME…]``). Unknown names raise a ValueError naming them."""
    modes = check_modes(modes)
    out = {}
    for name in names:
        press = make_press(name)                      # ValueError naming an unknown press, before any run
        for mode in modes:
            if mode == "decode" and not decode_capable(press):
                continue
            out[f"kvpress_{name}_{mode}"] = (lambda b, name=name, mode=mode: policy(make_press(name), mode, b, sinks),
                                             sinks + 1, 4096)
    return out
