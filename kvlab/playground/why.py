"""Why a refresh fired, and what a readout can and cannot see: plain strings for the playground's Explore and
Step-through tabs, from live records or a stored run's step columns. Reads runs; writes nothing.

The refresh policy says it itself (``policy.explain(record)``, beside ``should_refresh``); here the
records are rebuilt from a stored run's step columns, so the Explore tab can list the reasons of a
run answered from the store, exactly as the step-through tab shows them for live records.
"""
from __future__ import annotations

from dataclasses import dataclass

PPL_NOTE = ("teacher-PPL and repeat@3 score only the emitted tokens: a change (e.g. of τ) that alters "
            "refreshes but not the tokens leaves them unchanged; KL also reads the student's distributions, "
            "which a refresh changes.")


@dataclass(frozen=True)
class StoredStep:
    """What a refresh policy reads from a record, rebuilt from a stored run's step columns."""

    step: int
    entropy_bits: float
    since_refresh: int
    signals: dict
    source: str


def stored_steps(steps: dict) -> list[StoredStep]:
    """One :class:`StoredStep` per generated token of a stored run (``result["steps"]``).

    ``since_refresh`` follows the decode loop: step t minus the step of the last refresh before t
    (0 if none), a refresh being flagged on the step after which it happened."""
    out, last = [], 0
    sigs = steps.get("signals") or [{}] * len(steps["entropy_bits"])
    for i, (h, ref, src, sig) in enumerate(zip(steps["entropy_bits"], steps["refreshed"], steps["source"], sigs)):
        t = i + 1
        out.append(StoredStep(step=t, entropy_bits=float(h), since_refresh=t - last, signals=dict(sig or {}), source=src))
        if ref:
            last = t
    return out


def reason(policy, record) -> str:
    """The policy's own words for ``record`` (``policy.explain``), or a plain fallback for a policy
    without one."""
    explain = getattr(policy, "explain", None)
    if callable(explain):
        return explain(record)
    return f"{type(policy).__name__} decided to refresh at step {record.step}"


def refresh_reasons(policy, steps: dict) -> list[tuple[int, str]]:
    """``[(step, why), ...]`` for every refresh of a stored run (empty without a policy)."""
    if policy is None:
        return []
    recs = stored_steps(steps)
    return [(r.step, reason(policy, r)) for r, fired in zip(recs, steps["refreshed"]) if fired]


def same_tokens_note(result: dict, other: dict, other_name: str = "the baseline") -> str | None:
    """A sentence when ``result`` emitted exactly ``other``'s tokens but refreshed differently
    (so teacher-PPL is identical by construction), else None."""
    a, b = result["steps"]["token_id"], other["steps"]["token_id"]
    if a != b:
        return None
    ra, rb = int(result.get("refreshes", 0)), int(other.get("refreshes", 0))
    if ra == rb and result["steps"]["refreshed"] == other["steps"]["refreshed"]:
        return None
    return (f"Same {len(a)} tokens as {other_name} ({ra} vs {rb} refreshes), so the same teacher-PPL and repeat@3: "
            f"they depend only on the emitted tokens.")
