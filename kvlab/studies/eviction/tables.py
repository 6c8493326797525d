"""Eviction experiments on stored runs: the sawtooth trace and the matched-memory table.

**Matched memory.** Conf-KV's memory is not a knob: it is what its confidence schedule does on the
prompts. So Conf-KV runs first and its achieved mean KV bytes (mean over steps of
``StepRecord.cache_bytes``, then over prompts) is the *target*. Every fixed-budget family
(sliding window, H2O, random, block) has one integer budget knob; :func:`solve_budget` finds the
knob whose achieved mean memory is closest to the target:

1. a first guess from the full-cache runs: a hard cap ``b`` turns the full cache's length
   trajectory ``n_t`` into ``min(n_t, b)`` (:func:`capped_mean`), which is inverted exactly;
2. the family runs at that budget (stored runs) and its *measured* mean memory is compared with
   the target; while it is off by more than ``tol`` the solver brackets and bisects on measured
   values (each probe is a stored run set, so a rerun of the table recomputes nothing).

The table reports the target, the achieved mean and its per-prompt spread for every row, so
"matched" can be checked, not assumed. Conf-KV's ranker ablations (recency-only, attention-only,
random victims) keep its confidence schedule, so their memory follows the same schedule; their
achieved memory is reported beside the target too.

**KL to the full cache.** Runs are on the teacher alone (``mode="teacher"``). :func:`kvlab.core.metrics.score`
compares each step's distribution with the teacher's uncached forward over prompt + continuation,
i.e. ``KL(p_full(· | x, y_<t) ‖ p_evicted(· | x, y_<t))`` along the run's own tokens: exactly the KL
of the pruned cache to the full one. Paired statistics (bootstrap over prompts, same seeds) are
computed against the full-cache run and against Conf-KV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from kvlab.decode import DecodeConfig
from kvlab.harness.experiment import RunSpec, paired_bootstrap, scored_run, scored_runs, write_table
from kvlab.store import RunStore

MIB = 2 ** 20


# --------------------------------------------------------------------------- memory of a run


def run_memory(steps: dict) -> dict:
    """Memory numbers of one stored run's step columns (``experiment.records_columns``)."""
    lens = [int(x) for x in steps["cache_len"]]
    nbytes = steps.get("cache_bytes") or [None] * len(lens)
    if any(b is None for b in nbytes):
        raise ValueError("stored run has no cache_bytes per step (made before eviction records existed); "
                         "delete it from the run store or use a fresh --runs folder")
    nbytes = [float(b) for b in nbytes]
    ev = [int(e) for e in steps["evicted"]]
    meta = steps.get("meta_bytes") or [float("nan")] * len(lens)
    fwd = steps.get("forward_bytes") or [float("nan")] * len(lens)
    b16 = steps.get("cache_bytes16") or [float("nan")] * len(lens)
    return {"mean_len": float(np.mean(lens)), "peak_len": max(lens), "min_len": min(lens),
            "mean_mb": float(np.mean(nbytes)) / MIB, "mean_mb16": float(np.mean(b16)) / MIB,
            "peak_mb": max(nbytes) / MIB, "evicted": sum(ev), "evict_events": sum(e > 0 for e in ev),
            "meta_mb": float(np.mean(meta)) / MIB, "peak_fwd_mb": float(np.max(fwd)) / MIB}


def budget_fractions(steps: dict, loose: int) -> dict:
    """Share of decode steps whose chosen budget (the policy's ``budget`` signal) is the loose one, and
    share of steps whose cache (layer 0, after the evict phase) stood at ``loose`` — the loose budget
    binding. NaN for policies without a confidence schedule (no ``confidence`` signal)."""
    sigs = steps.get("signals") or []
    b = [sig.get("budget") for sig in sigs]
    if not b or any(x is None for x in b) or any(sig.get("confidence") is None for sig in sigs):
        return {"frac_loose": float("nan"), "frac_at_loose": float("nan")}
    lens = [int(x) for x in steps["cache_len"]]
    return {"frac_loose": float(np.mean([x == loose for x in b])),
            "frac_at_loose": float(np.mean([n >= loose and x == loose for n, x in zip(lens, b)]))}


def capped_mean(trajectories: Sequence[Sequence[float]], cap: float) -> float:
    """Mean over runs of ``mean_t min(n_t, cap)``: what a hard cap of ``cap`` entries would leave of
    the full cache's per-step lengths ``n_t`` (the solver's first guess)."""
    return float(np.mean([np.minimum(np.asarray(t, dtype=float), cap).mean() for t in trajectories]))


def invert_capped(trajectories: Sequence[Sequence[float]], target: float, lo: int, hi: int) -> int:
    """The integer cap in ``[lo, hi]`` whose :func:`capped_mean` is closest to ``target``."""
    best, best_err = lo, math.inf
    a, b = lo, hi
    while a <= b:                                   # capped_mean is non-decreasing in cap
        mid = (a + b) // 2
        m = capped_mean(trajectories, mid)
        if abs(m - target) < best_err:
            best, best_err = mid, abs(m - target)
        if m < target:
            a = mid + 1
        else:
            b = mid - 1
    for c in (a - 1, a, a + 1):
        if lo <= c <= hi and abs(capped_mean(trajectories, c) - target) < best_err:
            best, best_err = c, abs(capped_mean(trajectories, c) - target)
    return best


@dataclass
class Solved:
    """Result of :func:`solve_budget`: the knob, its measured value, the target, every probe."""

    knob: int
    achieved: float
    target: float
    probes: dict = field(default_factory=dict)

    @property
    def rel_err(self) -> float:
        return abs(self.achieved - self.target) / self.target if self.target else float("nan")


def solve_budget(measure: Callable[[int], float], target: float, lo: int, hi: int, guess: int | None = None,
                 tol: float = 0.02, max_probes: int = 8) -> Solved:
    """The integer knob ``k`` in ``[lo, hi]`` whose ``measure(k)`` (non-decreasing in ``k``) is closest
    to ``target``: start at ``guess``, stop once within ``tol`` (relative), else bracket and refine.
    Until the target is bracketed the knob doubles (or halves) from the guess; then secant steps.
    At most ``max_probes`` calls of ``measure``; every probe is kept in ``probes``."""
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi or lo < 1:
        raise ValueError(f"lo={lo!r}, hi={hi!r} must be ints with 1 <= lo <= hi")
    if not target > 0:
        raise ValueError(f"target={target!r} must be > 0")
    probes: dict[int, float] = {}

    def m(k: int) -> float:
        if k not in probes:
            probes[k] = float(measure(k))
        return probes[k]

    def done() -> Solved:
        k = min(probes, key=lambda k: (abs(probes[k] - target), k))
        return Solved(k, probes[k], target, dict(sorted(probes.items())))

    k = min(max(guess if guess is not None else (lo + hi) // 2, lo), hi)
    a, b = lo, hi                       # invariant: the answer lies in [a, b]
    while len(probes) < max_probes:
        v = m(k)
        if abs(v - target) <= tol * target:
            break
        if v < target:
            a = k + 1
        else:
            b = k - 1
        if a > b:
            break
        # secant step from the two probes nearest the target when they bracket it, else bisect
        below = [(kk, vv) for kk, vv in probes.items() if vv < target]
        above = [(kk, vv) for kk, vv in probes.items() if vv > target]
        if below and above:
            (k0, v0), (k1, v1) = max(below), min(above)
            nxt = round(k0 + (target - v0) * (k1 - k0) / (v1 - v0)) if v1 != v0 else (a + b) // 2
        elif below:                      # not bracketed yet: expand away from the guess
            nxt = 2 * k
        else:
            nxt = k // 2
        k = min(max(nxt, a), b)
        if k in probes:
            k = (a + b) // 2
            if k in probes:
                break
    return done()


# --------------------------------------------------------------------------- policies of the study


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

    def families(self) -> dict[str, tuple[Callable[[int], object], int, int]]:
        """Fixed-budget families: name -> (knob -> policy, knob lo, knob hi). The knob is the
        budget in entries, except block eviction (evictable blocks). SnapKV and PyramidKV compress
        the prompt only (their knob: prompt entries kept, PyramidKV's per layer on average); when even
        the smallest budget stays above the target, the table shows the mismatch in ``mem_vs_target``.
        Only ``run_families`` run (default: all of them; a smaller set for quick runs). ``confkv_fixed`` is the confidence-off control: Conf-KV's ranker (sinks, protect, λ, EMA) at
        one fixed budget (γ = 0: every step takes ``tight = knob``). Policies registered with
        ``kvlab.register_eviction`` are families too (knob: their budget); ``only`` picks any of them by name."""
        from kvlab.eviction import EVICTION_POLICIES, H2O, BlockEvict, ConfKV, PyramidKV, RandomEvict, Scissorhands, SlidingWindow, SnapKV

        bs, rec, k = self.block_size, self.protect, self.sinks
        lo = rec + k + 1

        def block(e, **kw):
            return BlockEvict(block_size=bs, start_blocks=max(1, k // bs), evictable_blocks=e,
                              recent_blocks=max(1, rec // bs), **kw)

        every = {
            "confkv_fixed": (lambda b: ConfKV(gamma=0.0, tight=b, loose=b, protect=rec, sinks=k), lo, 4096),
            "sliding": (lambda b: SlidingWindow(window=b, sinks=k), k + 1, 4096),
            "h2o": (lambda b: H2O(budget=b, recent=rec, sinks=k), lo, 4096),
            "random": (lambda b: RandomEvict(budget=b, recent=rec, seed=0, sinks=k), lo, 4096),
            "scissorhands": (lambda b: Scissorhands(budget=b, recent=rec, sinks=k), lo, 4096),
            "snapkv": (lambda b: SnapKV(budget=b, window=rec), rec + 1, 4096),
            "pyramidkv": (lambda b: PyramidKV(budget=b, window=rec), rec + 1, 4096),
            "block": (lambda e: block(e), 1, 512),
            "block_kvcrush": (lambda e: block(e, kvcrush=KVCRUSH_BLOCKS), 1, 512),
            "block_rerotate": (lambda e: block(e, rerotate=True), 1, 512),
        }
        for name in EVICTION_POLICIES.user():           # the user's own policies, by their registration
            entry = EVICTION_POLICIES.entry(name)
            every[name] = (entry.at_budget, *entry.knob_range())
        if self.only is None:
            return {name: fam for name, fam in every.items()
                    if name in self.run_families or name in EVICTION_POLICIES.user()}
        unknown = [n for n in self.only if n not in every]
        if unknown:
            raise ValueError(f"EvictStudy(only=...) names {unknown}, not fixed-budget families; known: {', '.join(every)}")
        return {n: every[n] for n in self.only}

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
FAMILIES = ("confkv_fixed", "sliding", "h2o", "random", "scissorhands", "snapkv", "pyramidkv", "block", "block_kvcrush",
            "block_rerotate")


def _cfg(spec: RunSpec, i: int, evict) -> DecodeConfig:
    return DecodeConfig(mode="teacher", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i), evict=evict)


def runs_of(teacher, spec: RunSpec, evict, store: RunStore) -> list[dict]:
    """One stored, scored run per prompt of ``spec`` under ``evict`` (None = full cache)."""
    return scored_runs(teacher, None, [(p, _cfg(spec, i, evict)) for i, p in enumerate(spec.prompts)], store,
                       batch=spec.batch)


def eviction_rate(steps_list: Sequence[dict], budget: int) -> float:
    """Conf-KV's per-step eviction probability where it *could* evict to ``budget``: events over steps
    whose cache exceeded ``budget`` before the evict phase (``cache_len + evicted > budget``)."""
    eligible = events = 0
    for st in steps_list:
        for n, e in zip(st["cache_len"], st["evicted"]):
            if n + e > budget:
                eligible += 1
                events += e > 0
    return events / eligible if eligible else 0.0


def _mean_mb(results) -> float:
    return float(np.mean([run_memory(r["steps"])["mean_mb"] for r in results]))


def matched_runs(teacher, spec: RunSpec, store: RunStore, study: EvictStudy = EvictStudy(),
                 progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Run the study; returns (per-run rows, per-policy info incl. the solver's probes, name -> policy)."""
    from tqdm.auto import tqdm

    runs: dict[str, list[dict]] = {}
    pols: dict[str, object] = {"full": None}
    info: list[dict] = []
    bar = tqdm(total=0, disable=not progress, desc="evict", unit="policy")
    runs["full"] = runs_of(teacher, spec, None, store)
    info.append({"policy": "full", "family": "full", "params": "", "matched_by": "reference"})
    for name, pol in study.ablations().items():
        pols[name] = pol
        runs[name] = runs_of(teacher, spec, pol, store)
        info.append({"policy": name, "family": "confkv", "params": _params(pol),
                     "matched_by": "target" if name == "confkv" else "Conf-KV schedule"})
        bar.update()
    target = _mean_mb(runs["confkv"])
    rate = eviction_rate([r["steps"] for r in runs["confkv"]], study.tight)
    from kvlab.eviction import RandomEvict

    rnd = RandomEvict(budget=study.tight, recent=study.protect, seed=0, rate=round(max(rate, 1e-3), 4),
                      sinks=study.sinks)
    runs["random_rate"] = runs_of(teacher, spec, rnd, store)
    pols["random_rate"] = rnd
    info.append({"policy": "random_rate", "family": "random_rate", "params": _params(rnd),
                 "matched_by": f"Conf-KV eviction rate {rate:.3f}"})
    full_traj = [r["steps"]["cache_len"] for r in runs["full"]]
    mb_per_entry = _mean_mb(runs["full"]) / float(np.mean([np.mean(t) for t in full_traj]))
    for fam, (make, lo, hi) in study.families().items():
        if fam.startswith("block"):
            cap = invert_capped(full_traj, target / mb_per_entry, 1, 4096)
            # the cache sits in [max, max + bs - 1] once a whole block overflows: mean ≈ max + bs/2
            # (KVCrush keeps its representative blocks on top)
            crush = KVCRUSH_BLOCKS if fam == "block_kvcrush" else 0
            guess = max(lo, round((cap - study.block_size / 2) / study.block_size) - crush
                        - max(1, study.sinks // study.block_size) - max(1, study.protect // study.block_size))
        elif fam in ("snapkv", "pyramidkv"):   # the prompt is cut to b (layer mean) once, then every step appends:
            # mean ≈ b + (N+1)/2
            guess = max(lo, round(target / mb_per_entry - (spec.tokens + 1) / 2))
        else:
            guess = invert_capped(full_traj, target / mb_per_entry, lo, hi)
        cache: dict[int, list[dict]] = {}

        def measure(k, make=make, cache=cache):
            cache[k] = runs_of(teacher, spec, make(k), store)
            return _mean_mb(cache[k])

        sol = solve_budget(measure, target, lo, hi, guess=guess, tol=study.tol)
        runs[fam] = cache[sol.knob]
        pols[fam] = make(sol.knob)
        info.append({"policy": fam, "family": fam, "params": _params(make(sol.knob)), "matched_by": "solved budget",
                     "knob": sol.knob, "probes": ";".join(f"{k}:{v:.4f}" for k, v in sol.probes.items())})
        bar.update()
    for name, pol in study.sweep().items():
        pols[name] = pol
        runs[name] = runs_of(teacher, spec, pol, store)
        info.append({"policy": name, "family": "confkv_sweep", "params": _params(pol), "matched_by": "γ sweep"})
        bar.update()
    forced = {}
    refs = [tuple(int(t) for t in r["steps"]["token_id"]) for r in runs["full"]]   # the full cache's continuations
    for name in FORCED_POLICIES:           # teacher-forced on the full cache's own continuation
        if name in pols:
            forced[name] = scored_runs(teacher, None, [(p, replace(_cfg(spec, i, pols[name]), forced=refs[i]))
                                                       for i, p in enumerate(spec.prompts)], store, batch=spec.batch)
            bar.update()
    bar.close()
    rows = []
    for name, results in runs.items():
        for i, r in enumerate(results):
            tf = forced.get(name, [None] * len(results))[i]
            rows.append({"policy": name, "prompt_idx": i, "teacher_ppl": r["teacher_ppl"], "kl": r["kl"],
                         "kl_forced": tf["kl"] if tf is not None else float("nan"),
                         "repeat3": r["repeat3"], "tps": r["tps"], "total_s": r["total_s"], "tokens": r["tokens"],
                         **run_memory(r["steps"]), **budget_fractions(r["steps"], study.loose)})
    per_run = pd.DataFrame(rows)
    info = pd.DataFrame(info)
    info["target_mb"] = target
    info["entry16_mb"] = entry_bytes_16bit(teacher.model.config) / MIB
    return per_run, info, pols


def _sinks(params: str) -> str:
    """What a row keeps as attention sinks, read from its policy's parameters (the ablations say it)."""
    import re

    if not isinstance(params, str) or not params:
        return "all (no eviction)"
    if params.startswith("BlockEvict"):
        m = re.search(r"start_blocks=(\d+)", params)
        b = re.search(r"block_size=(\d+)", params)
        return f"start area {int(m.group(1)) * int(b.group(1))}" if m and b else "start area"
    if params.startswith(("SnapKV", "PyramidKV")):
        return "none (prompt cut by score)"
    m = re.search(r"sinks=(\d+)", params)
    return m.group(1) if m else "0"


def entry_bytes_16bit(config) -> int:
    """Bytes of one cache entry (K and V, every layer) stored at 16 bits (FP16/BF16, the paper's cache)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * d * 2


def _params(policy) -> str:
    from dataclasses import asdict, is_dataclass

    if policy is None:
        return ""
    d = asdict(policy) if is_dataclass(policy) else {}
    return f"{type(policy).__name__}(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"


def paired_ci(per_run: pd.DataFrame, base: str, metrics=("teacher_ppl", "kl"), n_boot: int = 2000,
              seed: int = 0) -> pd.DataFrame:
    """Per policy: mean paired difference to ``base`` on the same prompts and its bootstrap 95 % CI
    (columns ``d_<metric>_vs_<base>[_lo|_hi]``)."""
    return paired_bootstrap(per_run, base, metrics, suffix=f"_vs_{base}", n_boot=n_boot, seed=seed)


MATCHED_COLS = ["policy", "matched_by", "sinks", "target_mb", "mean_mb", "mean_mb_std", "mem_vs_target", "mean_mb16",
                "mem16_vs_target", "mean_mb_16bit", "mem_vs_16bit", "meta_mb", "peak_fwd_mb", "mean_len", "min_len",
                "peak_len", "frac_loose", "frac_at_loose", "peak_mb", "evict_events", "teacher_ppl", "teacher_ppl_std",
                "d_teacher_ppl_vs_full",
                "d_teacher_ppl_vs_full_lo", "d_teacher_ppl_vs_full_hi", "d_teacher_ppl_vs_full_ci", "kl", "kl_std",
                "d_kl_vs_full", "d_kl_vs_full_ci", "d_kl_vs_confkv", "d_kl_vs_confkv_lo", "d_kl_vs_confkv_hi",
                "d_kl_vs_confkv_ci", "kl_forced", "kl_forced_std", "d_kl_forced_vs_confkv", "d_kl_forced_vs_confkv_lo",
                "d_kl_forced_vs_confkv_hi", "d_kl_forced_vs_confkv_ci", "repeat3", "repeat3_std", "tps", "tps_std",
                "n_prompts", "params", "knob", "probes"]


def matched_table(per_run: pd.DataFrame, info: pd.DataFrame) -> pd.DataFrame:
    """One row per policy: achieved memory vs target, quality with per-prompt std and paired CIs."""
    cols = ["mean_mb", "mean_mb16", "mean_len", "peak_len", "peak_mb", "evict_events", "teacher_ppl", "kl",
            "kl_forced", "repeat3", "tps", "meta_mb", "frac_loose", "frac_at_loose"]
    per_run = per_run.assign(**{c: float("nan") for c in cols + ["min_len"] if c not in per_run})   # older run frames
    if per_run["min_len"].isna().all():
        per_run["min_len"] = per_run["mean_len"]
    g = per_run.groupby("policy", sort=False)
    s = g[cols].mean()
    for m in ("mean_mb", "teacher_ppl", "kl", "kl_forced", "repeat3", "tps"):
        s[f"{m}_std"] = g[m].std(ddof=1).fillna(0.0)
    s["peak_len"] = g["peak_len"].max()
    s["min_len"] = g["min_len"].min()
    s["peak_mb"] = g["peak_mb"].max()
    s["peak_fwd_mb"] = g["peak_fwd_mb"].max()
    s["n_prompts"] = g.size()
    s = s.reset_index()
    s = s.merge(paired_ci(per_run, "full"), on="policy").merge(paired_ci(per_run, "confkv"), on="policy")
    tf = per_run[per_run.kl_forced.notna()]
    if len(tf) and "confkv" in set(tf.policy):
        s = s.merge(paired_ci(tf, "confkv", metrics=("kl_forced",)), on="policy", how="left")
    t = info.merge(s, on="policy")
    t["mem_vs_target"] = t["mean_mb"] / t["target_mb"]
    t16 = float(t.loc[t.policy == "confkv", "mean_mb16"].iloc[0]) if (t.policy == "confkv").any() else float("nan")
    t["mem16_vs_target"] = t["mean_mb16"] / t16
    t["sinks"] = [_sinks(p) for p in t.params]
    # the same entries stored at 16 bits (the paper's FP16 cache; this CPU stores FP32): INT8 rows say
    # what INT8 saves against a 16-bit cache, not only against FP32
    t["mean_mb_16bit"] = t["mean_len"] * t["entry16_mb"]
    t["mem_vs_16bit"] = t["mean_mb"] / t["mean_mb_16bit"]
    return t.reindex(columns=MATCHED_COLS)


# --------------------------------------------------------------------------- sawtooth


SAWTOOTH_COLS = ["policy", "step", "cache_len", "cache_mb", "evicted", "refreshed", "confidence", "budget", "gamma"]


def sawtooth_frame(results: dict[str, dict], gamma: float | None = None) -> pd.DataFrame:
    """Long table of per-step cache length / bytes / events for runs of the same prompt:
    ``results`` maps a label to a stored run (``scored_run``'s dict)."""
    rows = []
    for name, r in results.items():
        st = r["steps"]
        nbytes = st.get("cache_bytes") or [None] * len(st["cache_len"])
        for t, (n, b, e, f, sig) in enumerate(zip(st["cache_len"], nbytes, st["evicted"], st["refreshed"],
                                                  st["signals"]), start=1):
            rows.append({"policy": name, "step": t, "cache_len": n,
                         "cache_mb": float("nan") if b is None else b / MIB, "evicted": e, "refreshed": int(bool(f)),
                         "confidence": sig.get("confidence", float("nan")), "budget": sig.get("budget", float("nan")),
                         "gamma": gamma if gamma is not None else float("nan")})
    return pd.DataFrame(rows, columns=SAWTOOTH_COLS)


SAWTOOTH_POLICIES = ("full", "sliding", "h2o", "block", "confkv_fixed", "confkv", "confkv_int8")


def sawtooth_runs(teacher, student, spec: RunSpec, store: RunStore, policies: dict, study: EvictStudy,
                  names: Sequence[str] | None = None, refresh=None) -> dict[str, dict]:
    """Prompt 0 under the named policies of the matched study (``policies``: name -> policy, as
    :func:`matched_runs` returns; stored runs, so free after the table), plus Conf-KV on OverFill
    with a refresh policy (eviction composed with refresh) when ``refresh`` and a student are given.
    ``names`` default: :data:`SAWTOOTH_POLICIES` and every policy registered with ``kvlab.register_eviction``."""
    if names is None:
        from kvlab.eviction import EVICTION_POLICIES

        names = (*SAWTOOTH_POLICIES, *EVICTION_POLICIES.user())
    out = {n: scored_run(teacher, None, spec.prompts[0], _cfg(spec, 0, policies[n]), store)
           for n in names if n in policies}
    if refresh is not None and student is not None:
        cfg = DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(0),
                           evict=study.confkv(), refresh=refresh)
        out["confkv+overfill+refresh"] = scored_run(teacher, student, spec.prompts[0], cfg, store)
    return out


# --------------------------------------------------------------------------- the job


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


def evict_tables(teacher, student, spec: RunSpec, store: RunStore, study: EvictStudy = EvictStudy(),
                 grid: NeedleGrid | None = NeedleGrid(), refresh=None,
                 progress: bool = True) -> dict[str, pd.DataFrame]:
    """Every table of ``python -m kvlab evict`` from stored runs (computed where missing)."""
    from kvlab.studies.eviction import needle

    per_run, info, pols = matched_runs(teacher, spec, store, study, progress)
    matched = matched_table(per_run, info)
    tables = {"evict_matched": matched, "evict_matched_runs": per_run, "evict_gamma": gamma_table(matched)}
    saw = sawtooth_runs(teacher, student, spec, store, pols, study, refresh=refresh)
    tables["evict_sawtooth"] = sawtooth_frame(saw, gamma=study.gamma)
    tables["evict_int8"] = int8_error_table(teacher, spec.prompts[:2], study.protect)
    if grid is not None:
        cases = needle.make_cases(teacher.tokenizer, grid.lengths, grid.depths, grid.reps, grid.seed)
        nruns, used = needle.matched_needle_runs(teacher, cases, grid.budget, store, gamma=study.gamma,
                                                 progress=progress, batch=spec.batch)
        order = list(dict.fromkeys(n for u in used.values() for n in u))
        tables["evict_needle"] = needle.needle_table(nruns, order=order)
        tables["evict_needle_runs"] = nruns
    return tables


GAMMA_COLS = ["policy", "gamma", "mean_len", "mean_mb", "mem_vs_target", "frac_loose", "frac_at_loose", "kl", "kl_std",
              "d_kl_vs_confkv", "d_kl_vs_confkv_ci", "teacher_ppl", "n_prompts"]


def gamma_table(matched: pd.DataFrame) -> pd.DataFrame:
    """The γ sweep rows of the matched table (``confkv_g<γ>``) with their γ, plus the fixed-budget
    control and H2O as reference points (γ NaN): the paper's quality–memory knob."""
    import re

    rows = matched[matched.policy.str.match(r"confkv_g[0-9.]+$") | matched.policy.isin(["confkv_fixed", "h2o"])]
    rows = rows.copy()
    rows["gamma"] = [float(re.match(r"confkv_g([0-9.]+)$", p).group(1)) if p.startswith("confkv_g") else float("nan")
                     for p in rows.policy]
    return rows.reindex(columns=GAMMA_COLS).reset_index(drop=True)


def int8_error_table(lm, prompts: Sequence[str], window: int, group: int = INT8_GROUP) -> pd.DataFrame:
    """Round-trip error of INT8 storage on real K/V: each prompt's prefill K and V per layer, the
    entries older than the ``window`` newest quantized as a cache prefix would be, by both schemes
    (one scale per (head, channel), entries arriving one at a time; and groups of ``group`` entries).
    One row per (scheme, tensor): mean over prompts and layers of ``mean_rel`` (mean |x - x̂| / mean |x|,
    the paper's "mean roundtrip error"), ``rel_fro`` and the largest ``max_abs``; ``bytes16_per_entry``:
    K+V bytes of one quantized entry of one layer with 16-bit scales, amortized over the prefix."""
    from kvlab.cache import KVCache
    from kvlab.cache.int8 import roundtrip_error

    rows = []
    for prompt in prompts:
        ids = lm.encode_prompt(prompt)
        cache, _ = KVCache.prefill(lm.model, ids, writer="teacher")
        for layer in range(cache.num_layers):
            k, v = cache.kv(layer)                                           # (1, H_kv, T, D)
            n = k.shape[2] - window
            if n <= 0:
                continue
            for scheme in ("channel", "group"):
                for name, x in (("K", k[:, :, :n].float()), ("V", v[:, :, :n].float())):
                    e = roundtrip_error(x, scheme, group)
                    groups = 1 if scheme == "channel" else -(-n // group)
                    h, d = x.shape[1], x.shape[3]
                    rows.append({"scheme": "per (head, channel)" if scheme == "channel" else f"per ({group} entries, "
                                 "head, channel)", "tensor": name, "layer": layer, **e,
                                 "bytes16_per_entry": h * d + 2 * h * d * groups / n + (4 * (groups > 1)),
                                 "entries": n})
    df = pd.DataFrame(rows)
    g = df.groupby(["scheme", "tensor"], sort=False)
    out = g.agg(mean_rel=("mean_rel", "mean"), rel_fro=("rel_fro", "mean"), max_abs=("max_abs", "max"),
                bytes16_per_entry=("bytes16_per_entry", "mean"), entries=("entries", "mean"),
                layers=("layer", "nunique")).reset_index()
    return out



def write_evict(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """CSV + Markdown of every table; ``evict_needle.md`` holds the two accuracy pivots."""
    from kvlab.studies.eviction.needle import needle_markdown

    out = Path(out)
    paths = []
    for name, df in tables.items():
        paths += write_table(df.round(5), out, name, notes=TABLE_NOTES.get(name.replace("_runs", ""), []))
    if "evict_needle" in tables:   # the two accuracy pivots instead of the long table
        from kvlab.harness.experiment import provenance_note

        notes = TABLE_NOTES["evict_needle"] + [provenance_note()]
        (out / "evict_needle.md").write_text(needle_markdown(tables["evict_needle"]) + "\n"
                                             + "\n".join(f"- {n}" for n in notes) + "\n")
    return paths


TABLE_NOTES = {
    "evict_matched": [
        "Runs: the teacher alone (mode='teacher'), same prompts and per-prompt seeds for every policy.",
        "`kl`: mean over steps of KL(p_full ‖ p_evicted) in nats — the full-cache teacher's distribution (one "
        "uncached forward over prompt + continuation) vs the distribution the evicted cache gave, on the run's "
        "own tokens: the KL of the pruned cache to the full one (0 for `full`).",
        "Memory: `mean_mb` / `peak_mb` = mean / max over steps of the decoding cache's real K/V bytes after the "
        "evict phase (INT8 entries counted as 1 byte + scales); `target_mb` = Conf-KV's achieved mean; "
        "`mem_vs_target` = mean_mb / target_mb. Fixed-budget families were solved to the target (`knob`: the "
        "budget found; `probes`: every budget the solver ran, as knob:achieved MiB); Conf-KV ablations keep its schedule.",
        "`mean_mb_16bit`: the same mean entry count stored at 16 bits (the paper's FP16 cache; this CPU stores "
        "FP32), `mem_vs_16bit` = mean_mb / mean_mb_16bit (2.0 for an FP32 row; below 1 only where INT8 beats a 16-bit "
        "cache). `meta_mb`: mean bytes of the attention statistics a policy keeps (acc, ema, count per entry; 0 for "
        "policies that need none). `peak_fwd_mb`: the most K/V bytes held during one forward — INT8 entries are "
        "dequantized for every forward, so an INT8 cache's forward peak is its FP size plus the INT8 store.",
        "`frac_loose`: fraction of decode steps on which Conf-KV's schedule chose the loose budget; "
        "`frac_at_loose`: fraction on which the cache also stood at it (the loose budget binding); `min_len` .. "
        "`peak_len`: the cache's range over all steps and prompts (layer 0). `sinks`: the attention sinks the row's "
        "policy never evicts. `confkv_fixed`: Conf-KV's ranker at one fixed budget solved to Conf-KV's mean memory "
        "(the confidence-off control: schedule vs ranker). `mean_mb16`: mean bytes at the 16-bit reference (FP "
        "entries at 2 bytes/element, INT8 entries at 1 byte + 16-bit scales; the paper's accounting), "
        "`mem16_vs_target` against Conf-KV's.",
        "`kl_forced`: teacher-forced quality — mean KL(p_full ‖ p_evicted) along the FULL cache's own continuation "
        "of each prompt (tokens fixed, `DecodeConfig.forced`; the policy, its confidence and budget still act at "
        "every step), beside the free-running `kl` on each policy's own samples; `d_kl_forced_vs_confkv*`: paired "
        "differences to Conf-KV with bootstrap intervals.",
        "`d_*_vs_full`, `d_*_vs_confkv`: paired differences on the same prompts, mean and bootstrap 95 % interval "
        "(`_lo`, `_hi`, printable `_ci`); with fewer than 5 paired prompts no interval is given (\"n too small\"). "
        "`*_std`: per-prompt std. `tps`: decode tokens/s (machine-dependent).",
    ],
    "evict_sawtooth": ["Per-step cache of prompt 0 under each policy (after the evict phase); `confidence`, "
                       "`budget` from Conf-KV's signals; `refreshed` = a refresh fired after that step."],
    "evict_needle": ["Passkey retrieval (kvlab.eviction.needle): raw completion, greedy, 8 answer tokens; `accuracy` = "
                     "exact 5-digit match of the first number. `setting`: `streamed` = haystack prefilled, the question "
                     "teacher-forced through the decode loop (the policy, its confidence and budget act on every "
                     "question token), `prefill` = question prefilled with the haystack, eviction from the first answer "
                     "token on. Memory matched on the MEAN cache length over the decode steps per setting (Conf-KV "
                     "first, each fixed family solved to its mean: `mean_cache_len`). `depth` = fraction of filler "
                     "before the needle (0 = oldest, 1 = next to the question); `from_query` = prompt tokens between "
                     "the needle and the question."],
    "evict_gamma": ["The γ sweep: Conf-KV (same tight/loose/protect/sinks) at each γ, KL to the full cache against "
                    "mean memory; `confkv_fixed` (Conf-KV's ranker at one budget solved to the study's Conf-KV memory) "
                    "and `h2o` as reference points (γ NaN). Same prompts and seeds as evict_matched."],
    "evict_int8": ["Round-trip error of INT8 cache storage on the embedded teacher's real prefill K/V (first two study "
                   "prompts, every layer; the entries older than the protected window quantized as a cache prefix "
                   "would be). `mean_rel` = mean |x - x̂| / mean |x| (the paper reports 0.38 % for per-(head, channel) "
                   "INT8), `rel_fro` = ‖x - x̂‖/‖x‖, `max_abs` = largest element error; `bytes16_per_entry`: bytes of "
                   "one quantized entry of one tensor and layer with 16-bit scales (an FP16 entry is 2·H·D)."],
}


__all__ = ["EvictStudy", "Solved", "solve_budget", "capped_mean", "invert_capped", "run_memory", "matched_runs",
           "budget_fractions", "gamma_table", "int8_error_table",
           "matched_table", "paired_ci", "eviction_rate", "sawtooth_frame", "sawtooth_runs", "write_evict",
           "NeedleGrid", "evict_tables"]
