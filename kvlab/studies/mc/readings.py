""""How to read this" texts of the MC-dropout study (notebook 03): the simulation's phase summary, the gate
firings replayed on stored traces and one prompt's trace. Computed from the tables, so a reading stays true
when the numbers change.
"""
from __future__ import annotations

import pandas as pd

from kvlab.harness.prose import HOW
from kvlab.harness.tableview import fmt, plural

def read_phase_summary(ps: pd.DataFrame) -> str:
    """``mcsim``'s phase summary (index = phase; ``mean_entropy``, ``mean_mcvar``, ``frac_*_fire``)."""
    hi_var = ps.mean_mcvar.idxmax()
    hi_ent = ps.mean_entropy.nlargest(2).index.tolist()
    ratio = float(ps.mean_mcvar.max() / max(ps.mean_mcvar.drop(hi_var).max(), 1e-12))
    return (HOW + "One row per phase of the simulation: mean entropy (bits) and mean MC variance U(t) over its "
            "steps, and the share of its steps where each gate fired. A good refresh signal is high in the "
            f"epistemic drift only. Entropy is highest in {hi_ent[0]} and {hi_ent[1]} "
            f"({fmt(ps.mean_entropy[hi_ent[0]], 2)} vs {fmt(ps.mean_entropy[hi_ent[1]], 2)} bits): it cannot tell them "
            f"apart. MC variance is highest in {hi_var}, {fmt(ratio, 0)}× any other phase — in the blog's "
            "simulation it separates drift from ambiguity by construction; the real student below is the test.")


def read_firings(firings: pd.DataFrame) -> str:
    """Replayed MC-gate fires per prompt and signal, with the extra student passes they cost."""
    g = firings.groupby("signal", sort=False)
    fires = g["fires"].apply(lambda s: sum(len(f) for f in s))
    extra = g["extra_student_passes"].sum()
    decode = g["decode_passes"].sum()
    per = "; ".join(f"{sig}: {plural(int(fires[sig]), 'fire')}, {int(extra[sig])} extra student passes "
                    f"({fmt(100 * extra[sig] / max(1, decode[sig]), 0)} % on top of {int(decode[sig])} decode passes)"
                    for sig in fires.index)
    return (HOW + f"Where each gate would refresh on the stored traces ({plural(firings.prompt.nunique(), 'prompt')}), "
            f"and what its probes cost: {per}. Fewer fires at the same cost is not better by itself — a fire is "
            "useful only where refreshing lowers the KL to the teacher afterwards (notebook 02 measures that).")


def read_mc_trace(trace: pd.DataFrame, fires: dict) -> str:
    """One prompt's MC trace (``step``, ``entropy``) and each gate's fire steps: do fires sit where the
    student is unsure (entropy above its median on this prompt)?"""
    med = float(trace.entropy.median())
    ent = dict(zip(trace.step, trace.entropy))
    parts = []
    for sig, steps in fires.items():
        hi = sum(1 for t in steps if ent.get(t, -1) > med)
        parts.append(f"{sig}: {plural(len(steps), 'fire')}" + (f", {hi} at above-median entropy" if steps else ""))
    return (HOW + f"Each panel is one signal over the decode steps of this prompt (higher = more uncertain); dashed "
            f"lines mark where its gate would fire. The median entropy here is {fmt(med, 2)} nats. "
            + "; ".join(parts) + ". A signal that fires only where entropy is high adds nothing over the entropy gate; "
            "one that fires elsewhere is either seeing epistemic drift or noise — the correlation table above says which.")


__all__ = ["read_phase_summary", "read_firings", "read_mc_trace"]
