"""What README.md and docs/*.md quote from the MC-dropout study (``kvlab.viz.docs`` renders it): the real
student's correlations, the simulation's phase summary, and the key result (MC signals vs the entropy).
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.quotes import View, quote, read


def _r(sig: str, with_ci: bool):
    """The cell spec of one signal's r: with its interval when the table has one (tables since issue 37)."""
    return (f"r_{sig}", f"r_{sig}_lo", f"r_{sig}_hi") if with_ci else f"r_{sig}"


def _has_ci(figures: Path) -> bool:
    return "r_u_lo" in read(figures, "mc_real_correlations").columns


def mc_real_view(figures: Path) -> str:
    """The correlation table; each r with its bootstrap 95 % interval over prompts when the table has it."""
    ci = _has_ci(figures)
    return View("mc_real_correlations", [
        ("dropout p", "p"), ("passes", "n_passes"), ("prompts", "prompts"), ("probed steps", "steps"),
        ("r(U, H)", _r("u", ci)), ("r(MI, H)", _r("mi", ci)), ("r(flip, H)", _r("flip", ci)),
        ("mean MI (nats)", "mean_mi"), ("mean flip", "mean_flip")], digits=2,
        note="Pearson r with the student's entropy H over the pooled steps"
             + (", [bootstrap 95 % interval over prompts]" if ci else "")).render(figures)


VIEWS = {
    "mc_real": mc_real_view,
    "mc_sim": View("mc_phase_summary", [
        ("phase", "phase"), ("steps", "steps"), ("mean entropy (nats)", "mean_entropy"),
        ("entropy fires", "frac_entropy_fire"), ("MC-variance fires", "frac_mcvar_fire")]),
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key result: how MC dropout's signals (p = 0.1) correlate with the student's entropy, with their
    bootstrap intervals over prompts when the table has them."""
    c, ci = "mc_real_correlations", _has_ci(figures)
    what = "MC dropout (p = 0.1): correlation with the student's entropy"
    if ci:
        what += f" ({quote(figures, c, 'p=0.1', 'prompts', 0)} prompts, 95 % interval)"
    return [(what, ", ".join(f"{name} " + quote(figures, c, "p=0.1", _r(sig, ci), 2)
                             for name, sig in (("U", "u"), ("MI", "mi"), ("flip", "flip"))), c)]


__all__ = ["VIEWS", "key_results", "mc_real_view"]
