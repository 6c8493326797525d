"""The sawtooth: per-step cache length and bytes of prompt 0 under the study's policies (stored runs), plus
Conf-KV composed with OverFill and a refresh policy.
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from kvlab.decode import DecodeConfig
from kvlab.harness.experiment import RunSpec, scored_run
from kvlab.store import RunStore
from kvlab.studies.eviction.design import EvictStudy
from kvlab.studies.eviction.matched import _cfg
from kvlab.studies.eviction.solver import MIB

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
