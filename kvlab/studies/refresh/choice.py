"""One refresh policy chosen by name and parameters (``python -m kvlab refresh --policy ...``).
Builds a policy from flags before any model loads; it touches nothing.

:func:`policy_choice` validates the name, which parameters belong to it and their values before
any model loads (``ValueError`` naming the flag and the fix); :func:`single_policy_tables` runs
the chosen policy and the no-refresh reference on the same prompts (stored, paired seeds) and
times them side by side (:func:`kvlab.studies.refresh.tables.paired_timing`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pandas as pd

from kvlab.decode import REFRESH_NEXT, DecodeConfig
from kvlab.harness.experiment import RunSpec, run_policies
from kvlab.refresh.policies import EntropyGate, MCGate, Periodic, ProbeKL, Speculative
from kvlab.studies.refresh.tables import (TIMING_PROMPTS, TIMING_REPEATS, calibrate, overhead_table, paired_timing, summary,
                     with_forced)
from kvlab.store import RunStore

# policy -> {parameter: CLI flag}; required: tuples of alternatives (one of them must be given)
PARAMS = {
    "periodic": {"T": "--T", "W": "--W"},
    "entropy": {"tau": "--tau", "tau_percentile": "--tau-percentile", "min_gap": "--min-gap", "W": "--W"},
    "probe-kl": {"M": "--M", "kappa": "--kappa", "kappa_percentile": "--kappa-percentile", "W": "--W"},
    "speculative": {"k": "--k"},
    "mc": {"threshold": "--threshold", "percentile": "--percentile", "signal": "--signal",
           "probe_every": "--probe-every", "refractory": "--refractory", "passes": "--passes", "dropout": "--dropout"},
}
REQUIRED = {
    "periodic": [("T",)],
    "entropy": [("tau", "tau_percentile")],
    "probe-kl": [("M",), ("kappa", "kappa_percentile")],
    "speculative": [("k",)],
    "mc": [("threshold", "percentile")],
}
FLAGS = {k: v for d in PARAMS.values() for k, v in d.items()}
POLICIES = tuple(PARAMS)


@dataclass(frozen=True)
class PolicyChoice:
    """A validated policy name, its parameters (only those given) and ``refresh_next``."""

    policy: str
    params: dict = field(default_factory=dict)
    refresh_next: str = "rerun"

    @property
    def label(self) -> str:
        """A file-name-safe name, e.g. ``entropy_tau6.5`` or ``periodic_T32_W16_next-teacher``."""
        parts = [self.policy.replace("-", "_")] + [f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}"
                                                   for k, v in self.params.items()]
        if self.refresh_next != "rerun":
            parts.append(f"next-{self.refresh_next}")
        return "_".join(parts)


def _percentile(flag, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0 < v < 100:
        raise ValueError(f"{flag}={v!r} must lie in (0, 100), e.g. 95")


def policy_choice(policy: str | None, refresh_next: str | None = None, **params) -> PolicyChoice | None:
    """Validate a policy choice. ``params`` are every policy flag's value (None = not given).

    ``policy=None`` with no parameters means "the full table run" (returns None); a parameter
    without ``--policy``, one that belongs to another policy, a missing required one or a bad
    value raises ``ValueError`` naming the flag."""
    given = {k: v for k, v in params.items() if v is not None}
    unknown = set(given) - set(FLAGS)
    if unknown:
        raise ValueError(f"unknown policy parameter(s) {sorted(unknown)}")
    if policy is None:
        if given or refresh_next is not None:
            flags = [FLAGS[k] for k in given] + (["--refresh-next"] if refresh_next is not None else [])
            raise ValueError(f"{', '.join(flags)} need(s) --policy (one of {', '.join(POLICIES)}); without "
                             "--policy the full table of every policy runs")
        return None
    if policy not in PARAMS:
        raise ValueError(f"--policy {policy!r} must be one of {', '.join(POLICIES)}")
    foreign = [k for k in given if k not in PARAMS[policy]]
    if foreign:
        raise ValueError(f"{', '.join(FLAGS[k] for k in foreign)} do(es) not apply to --policy {policy}; "
                         f"its parameters: {', '.join(PARAMS[policy].values())}")
    for alts in REQUIRED[policy]:
        have = [a for a in alts if a in given]
        if not have:
            raise ValueError(f"--policy {policy} needs {' or '.join(FLAGS[a] for a in alts)}")
        if len(have) > 1:
            raise ValueError(f"--policy {policy}: give only one of {', '.join(FLAGS[a] for a in have)}")
    nxt = "rerun" if refresh_next is None else refresh_next
    if nxt not in REFRESH_NEXT:
        raise ValueError(f"--refresh-next {nxt!r} must be one of {', '.join(REFRESH_NEXT)}")
    for k in ("tau_percentile", "kappa_percentile", "percentile"):
        if k in given:
            _percentile(FLAGS[k], given[k])
    choice = PolicyChoice(policy, given, nxt)
    try:   # construct with placeholder thresholds: every value is checked before any model loads
        _build(choice, tau=0.0, kappa=0.0, threshold=0.0)
    except ValueError as e:
        raise ValueError(f"--policy {policy}: {_flagged(str(e))}") from None
    return choice


def _flagged(msg: str) -> str:
    """Name the CLI flag in a policy's ValueError (``T=0 must be ...`` -> ``--T (T=0) must be ...``)."""
    names = {"T": "T", "W": "W", "tau_bits": "tau", "min_gap": "min_gap", "M": "M", "kappa": "kappa", "k": "k",
             "signal": "signal", "threshold": "threshold", "probe_every": "probe_every", "refractory": "refractory",
             "n_passes": "passes", "p": "dropout"}
    head = msg.split("=", 1)[0]
    return f"{FLAGS[names[head]]} ({msg.split(' must', 1)[0]}){msg[msg.find(' must'):]}" if head in names \
        and " must" in msg else msg


def _build(choice: PolicyChoice, *, tau=None, kappa=None, threshold=None):
    p = choice.params
    if choice.policy == "periodic":
        return Periodic(p["T"], p.get("W"))
    if choice.policy == "entropy":
        return EntropyGate(p.get("tau", tau), p.get("min_gap", 1), p.get("W"))
    if choice.policy == "probe-kl":
        return ProbeKL(p["M"], p.get("kappa", kappa), p.get("W"))
    if choice.policy == "speculative":
        return Speculative(p["k"])
    kw = {k2: p[k1] for k1, k2 in (("signal", "signal"), ("probe_every", "probe_every"), ("refractory", "refractory"),
                                   ("passes", "n_passes"), ("dropout", "dropout_p")) if k1 in p}
    return MCGate(threshold=p.get("threshold", threshold), **kw)


def build_policy(choice: PolicyChoice, teacher, student, calib: RunSpec, store: RunStore, progress: bool = False):
    """The policy object, with percentile thresholds calibrated on ``calib`` (no-refresh OverFill
    runs for τ / κ; MC traces for the MC gate); returns ``(policy, info)``."""
    p, info = choice.params, dict(choice.params)
    if choice.policy in ("entropy", "probe-kl") and ("tau_percentile" in p or "kappa_percentile" in p):
        cal = calibrate(teacher, student, calib, store, progress=progress)
        if "tau_percentile" in p:
            info["tau_bits"] = round(cal.tau(p["tau_percentile"]), 4)
            return _build(choice, tau=info["tau_bits"]), info
        info["kappa"] = round(cal.kappa(p["kappa_percentile"]), 5)
        return _build(choice, kappa=info["kappa"]), info
    if choice.policy == "mc" and "percentile" in p:
        draft = _build(choice, threshold=0.0)
        if progress:
            print(f"calibrating the MC gate on {len(calib.prompts)} prompt(s)", flush=True)
        gate = MCGate.calibrated(teacher, student, percentile=p["percentile"], signal=draft.signal,
                                 prompts=calib.prompts, tokens=calib.tokens, probe_every=draft.probe_every,
                                 refractory=draft.refractory, n_passes=draft.n_passes, dropout_p=draft.dropout_p)
        info["threshold"] = round(gate.threshold, 6)
        return gate, info
    return _build(choice), info


def single_policy_tables(teacher, student, spec: RunSpec, store: RunStore, calib: RunSpec, choice: PolicyChoice,
                         progress: bool = True, timing_prompts: int = TIMING_PROMPTS,
                         timing_repeats: int = TIMING_REPEATS) -> dict[str, pd.DataFrame]:
    """The chosen policy vs no refresh: ``refresh_<label>`` (quality, paired Δkl_forced / ΔKL / Δteacher-PPL
    with bootstrap CIs and minimum detectable differences, from stored runs) and ``refresh_<label>_timing`` (overhead from side-by-side
    timing; ``timing_repeats=0`` skips it)."""
    policy, info = build_policy(choice, teacher, student, calib, store, progress)
    base = DecodeConfig(mode="overfill")
    cfgs = {"none": base, choice.label: replace(base, refresh=policy, refresh_next=choice.refresh_next)}
    rows = pd.DataFrame([{"policy": "none", "family": "none", "refresh_next": ""},
                         {"policy": choice.label, "family": choice.policy, "refresh_next": choice.refresh_next,
                          **info}])
    per_run = run_policies(teacher, student, spec, cfgs, store, progress)
    per_run = with_forced(teacher, student, spec, cfgs, store, per_run, progress)
    tables = {f"refresh_{choice.label}": summary(per_run, rows)}
    if timing_repeats:
        timing = paired_timing(teacher, student, spec, cfgs, prompts=timing_prompts, repeats=timing_repeats,
                               progress=progress)
        tables[f"refresh_{choice.label}_timing"] = overhead_table(timing)
    return tables
