"""What the refresh policies share: the calibration of thresholds (:func:`tau_from_percentile`,
:func:`tau_for_budget`), and, re-exported from the loop that owns them, the protocol (``should_refresh(record) ->
bool`` and its optional attributes ``window``, ``probe``, ``probe_every``, ``batchable``, each declared once with
its default in :data:`kvlab.decode.protocols.REFRESH_ATTRS`), the probes (:mod:`kvlab.decode.probes`: at a due
step the loop runs ``PROBES[policy.probe](ctx)`` and puts its signals on the record before asking the policy)
and run-key dicts (:mod:`kvlab.decode.keys`). Policies decide only; splices are the loop's, through the cache
module.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvlab.decode.keys import code_digest, policy_dict  # noqa: F401  (the loop's: run keys)
from kvlab.decode.probes import PROBES, LN2, ProbeContext, ProbeResult, register_probe, teacher_kl_probe  # noqa: F401
from kvlab.decode.protocols import REFRESH_ATTRS, refresh_attr, validate_policy  # noqa: F401


# --------------------------------------------------------------------------- calibration


def _check_pct(percentile: float) -> None:
    if not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise ValueError(f"percentile={percentile!r} must be in (0, 100)")


def tau_from_percentile(values: Sequence[float], percentile: float = 95.0) -> float:
    """Threshold at a percentile of a signal (student entropy in bits, or probe KL) on calibration runs."""
    _check_pct(percentile)
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise ValueError("values is empty: run calibration prompts first")
    return float(np.percentile(v, percentile))


def tau_for_budget(values: Sequence[float], per_1k: float = 2.5, probe_every: int = 1) -> float:
    """Threshold so that ~``per_1k`` refreshes fire per 1000 tokens on the calibration signal.

    With a probe every ``M`` tokens only ``1000 / M`` values are seen per 1k tokens, so the
    fraction above threshold is ``per_1k * M / 1000``. (Refreshes change later signals, so this
    is the open-loop budget; the measured rate is in the tables.)
    """
    if not isinstance(per_1k, (int, float)) or not per_1k > 0:
        raise ValueError(f"per_1k={per_1k!r} must be > 0 (refreshes per 1000 tokens)")
    frac = per_1k * probe_every / 1000.0
    if frac >= 1:
        raise ValueError(f"per_1k={per_1k} with probe_every={probe_every} asks every probe to fire")
    return tau_from_percentile(values, 100.0 * (1.0 - frac))
