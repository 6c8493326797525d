"""The eviction study's design: :class:`EvictStudy` (its sizes, its fixed-budget families as registered
policies under one setup, Conf-KV's ablations and γ sweep) and the job's needle grid. Pure data: builds
policies through the registry (:data:`kvlab.eviction.EVICTION_POLICIES`), runs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

@dataclass(frozen=True)
class EvictStudy:
    """Parameters of the matched-memory study and the sawtooth.

    Sized so that Conf-KV's confidence schedule acts: the cache is cut to the chosen budget at every
    step, so it can grow by at most one entry per uncertain step. With ``loose`` far above ``tight``
    (the earlier 48 / 112) an uncertain streak never carried the cache to ``loose`` and Conf-KV ran
    at ``tight``; here ``loose - tight = 6``, which uncertain streaks of the embedded
    SmolLM2-135M-Instruct reach (raw-distribution confidence at γ = 0.9: 63 % of steps uncertain,
    streaks 2.7 steps on average, 90th percentile 5, longest 16, over 4 prompts × 128 tokens at
    T = 0.7; ``frac_at_loose`` in the table says how often the loose budget binds).

    Every ranker keeps ``sinks`` attention sinks (StreamingLLM) unless its row says otherwise
    (``confkv_nosinks``); sliding keeps the same sinks and block eviction its start block.
    ``block_size = 2``: the matched memory lands on whole blocks, and at a ~35-entry target a block
    of 2 keeps block eviction within the 3 % tolerance (a block of ``bs`` moves the mean by ``bs``
    entries per knob step)."""

    gamma: float = 0.9
    tight: int = 32
    loose: int = 38
    protect: int = 8
    sinks: int = 4
    block_size: int = 2
    pyramid_ratio: float = 0.5
    tol: float = 0.03
    gammas: tuple[float, ...] = (0.7, 0.95)
    run_families: tuple[str, ...] = ("confkv_fixed", "sliding", "h2o", "scissorhands", "random", "snapkv", "pyramidkv",
                                     "block", "block_kvcrush", "block_rerotate")
    # the fixed-budget families solved to the target; None: ``run_families`` and every policy registered with
    # kvlab.register_eviction (built at a budget by its Entry.at_budget)
    only: tuple[str, ...] | None = None
    # NVIDIA kvpress presses (class names) run beside the study's own families, each at prompt compression and at
    # decode time (kvpress_<Class>_prefill / _decode, kvlab.studies.kvpress.presses.families); ``evict --kvpress``
    kvpress: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma!r} must be in [0, 1] (Conf-KV confidence threshold, --gamma)")
        if not 0 < self.protect + self.sinks < self.tight < self.loose:
            raise ValueError(f"need 0 < protect + sinks ({self.protect} + {self.sinks}) < tight ({self.tight}) "
                             f"< loose ({self.loose})")
        if self.only is not None:
            if isinstance(self.only, str) or not all(isinstance(n, str) for n in self.only):
                raise ValueError(f"only={self.only!r} must be a tuple of family names, e.g. ('h2o', 'mine')")
            object.__setattr__(self, "only", tuple(self.only))
        if isinstance(self.kvpress, str) or not all(isinstance(n, str) for n in self.kvpress):
            raise ValueError(f"kvpress={self.kvpress!r} must be a tuple of kvpress press class names, e.g. "
                             "('SnapKVPress', 'TOVAPress') (--kvpress SnapKVPress,TOVAPress)")
        object.__setattr__(self, "kvpress", tuple(self.kvpress))
        if self.block_size <= 0 or not 0 < self.tol < 1:
            raise ValueError(f"block_size={self.block_size!r} must be > 0 and tol={self.tol!r} in (0, 1)")
        unknown = set(self.run_families) - set(FAMILIES)
        if unknown:
            raise ValueError(f"run_families has unknown {sorted(unknown)}; choose from {FAMILIES}")
        if any(not 0.0 <= g <= 1.0 for g in self.gammas):
            raise ValueError(f"gammas={self.gammas!r} must lie in [0, 1] (the γ sweep)")

    def confkv(self, **kw):
        from kvlab.eviction import ConfKV

        kw = {"sinks": self.sinks, "gamma": self.gamma, "pyramid_ratio": self.pyramid_ratio, **kw}
        return ConfKV(tight=self.tight, loose=self.loose, protect=self.protect, **kw)

    def setup(self) -> dict:
        """What the study fixes besides the budget, for every family's ``Entry.at_budget`` (each policy's
        ``from_budget`` takes the keywords it names): ``sinks`` attention sinks, the newest ``recent =
        protect`` entries protected (SnapKV's / PyramidKV's observation window; block eviction's recent
        area), ``block_size``."""
        return {"sinks": self.sinks, "recent": self.protect, "block_size": self.block_size}

    def families(self) -> dict[str, tuple[Callable[[int], object], int, int]]:
        """Fixed-budget families: name -> (knob -> policy, knob lo, knob hi). The knob is the
        budget in entries, except block eviction (evictable blocks). SnapKV and PyramidKV compress
        the prompt only (their knob: prompt entries kept, PyramidKV's per layer on average); when even
        the smallest budget stays above the target, the table shows the mismatch in ``mem_vs_target``.
        Only ``run_families`` run (default: all of them; a smaller set for quick runs). ``confkv_fixed`` is the confidence-off control: Conf-KV's ranker (sinks, protect, λ, EMA) at
        one fixed budget (γ = 0: every step takes ``tight = knob``). Policies registered with
        ``kvlab.register_eviction`` are families too (knob: their budget); ``only`` picks any of them by name."""
        from kvlab.eviction import EVICTION_POLICIES

        setup = self.setup()
        every = {fam: (name, {**setup, **extra}) for fam, (name, extra) in FAMILY_SETUP.items()}
        for name in EVICTION_POLICIES:          # every other registered policy, by its registration
            if name not in every and name not in ("full", "confkv"):
                every[name] = (name, setup)
        if self.only is None:
            chosen = [n for n in every if n in self.run_families or n in EVICTION_POLICIES.user()]
        else:
            unknown = [n for n in self.only if n not in every]
            if unknown:
                raise ValueError(f"EvictStudy(only=...) names {unknown}, not fixed-budget families; known: "
                                 f"{', '.join(every)}")
            chosen = list(self.only)
        out = {n: EVICTION_POLICIES.entry(every[n][0]).solver(**every[n][1]) for n in chosen}
        if self.kvpress:
            from kvlab.studies.kvpress.presses import families as press_families

            out.update(press_families(self.kvpress, sinks=self.sinks, modes=("prefill", "decode")))
        return out

    def ablations(self) -> dict[str, object]:
        """Conf-KV's schedule with other rankers (the paper's isolation study) and its storage variants."""
        from kvlab.eviction import ConfKV

        out = {"confkv": self.confkv()}
        names = set(ConfKV.__dataclass_fields__)
        for name, kw in ABLATIONS.items():
            if set(kw) <= names:
                out[name] = self.confkv(**{k: (self.protect if v is PROTECT else v) for k, v in kw.items()})
        return out

    def sweep(self) -> dict[str, object]:
        """Conf-KV at every γ of the sweep (the paper's quality–memory knob), the study's γ included."""
        return {f"confkv_g{g:g}": self.confkv(gamma=g) for g in sorted(set(self.gammas) | {self.gamma})}


PROTECT = object()    # "the study's protect" in ABLATIONS (the paper's FP16 window = the protected window)
# Conf-KV variants by constructor keyword: its ranker's ablations, the confidence of the drawn (tempered +
# top-p) distribution instead of the model's raw one, sinks off, and the storage variants: INT8 (one scale per head and channel, 16-bit window) and Conf-KV-L (the
# equal-memory pyramid with the same INT8 storage, as the paper's Conf-KV-L).
ABLATIONS = {
    "confkv_pyramidal": {"pyramidal": True},
    "confkv_l": {"pyramidal": True, "int8_window": PROTECT},
    "confkv_int8": {"int8_window": PROTECT},
    "confkv_recency": {"attn_weight": 0.0},
    "confkv_drawn": {"confidence_from": "drawn"},
    "confkv_nosinks": {"sinks": 0},
}
INT8_GROUP = 8        # entries per scale group of the grouped INT8 variant (measured in evict_int8)
KVCRUSH_BLOCKS = 2    # representative blocks KVCrush keeps on top of the budget (seed 003's example budget)
# teacher-forced rows (KL on the full cache's continuation): the main comparison of the study
FORCED_POLICIES = ("confkv", "confkv_fixed", "h2o", "scissorhands", "sliding", "confkv_pyramidal", "confkv_l")
# the study's fixed-budget families: family -> (registered policy, its setup beyond EvictStudy.setup())
FAMILY_SETUP = {
    "confkv_fixed": ("confkv", {"gamma": 0.0, "tight_frac": 1.0}),     # tight = loose = knob: confidence off
    "sliding": ("sliding", {}), "h2o": ("h2o", {}), "random": ("random", {}), "scissorhands": ("scissorhands", {}),
    "snapkv": ("snapkv", {}), "pyramidkv": ("pyramidkv", {}),
    "block": ("block", {}), "block_kvcrush": ("block", {"kvcrush": KVCRUSH_BLOCKS}),
    "block_rerotate": ("block", {"rerotate": True}),
}
FAMILIES = tuple(FAMILY_SETUP)


def policy_names(text: str) -> tuple[str, ...]:
    """``--policy NAME[,NAME...]``: the study's families and registered eviction policies, checked by name
    (``argparse.ArgumentTypeError`` listing the known names)."""
    import argparse

    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    known = known_families()
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--policy {text!r}: unknown {unknown or '(empty)'}; choose from "
                                         f"{', '.join(known)} (a policy file in kvlab/eviction/ or a KVLAB_PLUGINS "
                                         "module registers more)")
    return names


def known_families() -> tuple[str, ...]:
    """Every name :meth:`EvictStudy.families` accepts in ``only``: the study's families, then every other
    registered eviction policy (but ``full`` and ``confkv``, which every study runs anyway)."""
    from kvlab.eviction import EVICTION_POLICIES

    return (*FAMILIES, *(n for n in EVICTION_POLICIES if n not in FAMILY_SETUP and n not in ("full", "confkv")))


@dataclass(frozen=True)
class NeedleGrid:
    """The passkey grid of the job (see :mod:`kvlab.studies.eviction.needle`)."""

    lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    reps: int = 2
    budget: int = 128
    seed: int = 0

    def __post_init__(self):
        from kvlab.studies.eviction.needle import check_grid

        check_grid(self.lengths, self.depths, self.reps, self.budget)
