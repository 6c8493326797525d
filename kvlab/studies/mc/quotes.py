"""What README.md and docs/*.md quote from the MC-dropout study (``kvlab.viz.docs`` renders it): the real
student's correlations, the simulation's phase summary, and the key result (MC signals vs the entropy).
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.quotes import View, quote


VIEWS = {
    "mc_real": View("mc_real_correlations", [
        ("dropout p", "p"), ("passes", "n_passes"), ("probed steps", "steps"), ("r(U, H)", "r_u"),
        ("r(MI, H)", "r_mi"), ("r(flip, H)", "r_flip"), ("mean MI (nats)", "mean_mi"), ("mean flip", "mean_flip")],
        digits=2, note="Pearson r with the student's entropy H"),
    "mc_sim": View("mc_phase_summary", [
        ("phase", "phase"), ("steps", "steps"), ("mean entropy (nats)", "mean_entropy"),
        ("entropy fires", "frac_entropy_fire"), ("MC-variance fires", "frac_mcvar_fire")]),
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key result: how MC dropout's signals (p = 0.1) correlate with the student's entropy."""
    c = "mc_real_correlations"
    return [("MC dropout (p = 0.1): correlation with the student's entropy",
             "U " + quote(figures, c, "p=0.1", "r_u", 2) + ", MI " + quote(figures, c, "p=0.1", "r_mi", 2) + ", flip "
             + quote(figures, c, "p=0.1", "r_flip", 2), c)]


__all__ = ["VIEWS", "key_results"]
