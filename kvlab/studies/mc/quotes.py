"""What README.md and docs/*.md quote from the MC-dropout study (``kvlab.viz.docs`` renders it): the real
student's correlations, the simulation's phase summary, and the key result (MC signals vs the entropy).
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.quotes import View, quote


VIEWS = {
    "mc_real": View("mc_real_correlations", [
        ("dropout p", "p"), ("passes", "n_passes"), ("prompts", "prompts"), ("probed steps", "steps"),
        ("r(U, H)", ("r_u", "r_u_lo", "r_u_hi")), ("r(MI, H)", ("r_mi", "r_mi_lo", "r_mi_hi")),
        ("r(flip, H)", ("r_flip", "r_flip_lo", "r_flip_hi")), ("mean MI (nats)", "mean_mi"), ("mean flip", "mean_flip")],
        digits=2, note="Pearson r with the student's entropy H over the pooled steps, [bootstrap 95 % interval over "
                       "prompts]"),
    "mc_sim": View("mc_phase_summary", [
        ("phase", "phase"), ("steps", "steps"), ("mean entropy (nats)", "mean_entropy"),
        ("entropy fires", "frac_entropy_fire"), ("MC-variance fires", "frac_mcvar_fire")]),
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key result: how MC dropout's signals (p = 0.1) correlate with the student's entropy, with their
    bootstrap intervals over prompts."""
    c = "mc_real_correlations"
    n = quote(figures, c, "p=0.1", "prompts", 0)
    return [(f"MC dropout (p = 0.1): correlation with the student's entropy ({n} prompts, 95 % interval)",
             "U " + quote(figures, c, "p=0.1", ("r_u", "r_u_lo", "r_u_hi"), 2) + ", MI "
             + quote(figures, c, "p=0.1", ("r_mi", "r_mi_lo", "r_mi_hi"), 2) + ", flip "
             + quote(figures, c, "p=0.1", ("r_flip", "r_flip_lo", "r_flip_hi"), 2), c)]


__all__ = ["VIEWS", "key_results"]
