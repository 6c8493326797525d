"""Settings validation for one playground: :func:`kvlab.playground.settings.check` with this playground's
model vocabulary, eviction policies, slider ranges and students, plus what only the playground knows
(enough prompts for the spread, a trained student the model cache lacks).
"""
from __future__ import annotations

from kvlab.playground.settings import Settings, check
from kvlab.playground.spread import pairs
from kvlab.playground.students import StudentPool


class SettingsChecker:
    """``{control: message}`` per bad control of a :class:`Settings` (:meth:`check`), and the slider
    positions valid with the other controls (:meth:`grid`, :meth:`check_values`)."""

    def __init__(self, *, vocab_size: int, eviction_names: tuple, ranges: dict, students: StudentPool, prompts):
        self.vocab_size = vocab_size
        self.eviction_names = eviction_names
        self.ranges = ranges
        self.students = students
        self.prompts = prompts

    def check(self, s: Settings) -> dict[str, str]:
        """``{control: message}`` for every bad control of ``s`` (empty when all are good)."""
        err = check(s, vocab_size=self.vocab_size, eviction_names=self.eviction_names, ranges=self.ranges,
                    prune_ratios=self.students.prune_ratios, students=self.students.variants)
        if "n_prompts" not in err and "prompt" not in err and isinstance(s.n_prompts, int):
            try:
                pairs(s, self.prompts)
            except ValueError as e:
                err["n_prompts"] = str(e)
        if "student" not in err:
            problem = self.students.problem(s)       # a trained student the model cache lacks: name train-student
            if problem:
                err["student"] = problem
        return err

    def grid(self, param: str, s: Settings) -> list:
        """The slider positions of ``param`` that are valid with ``s``'s other controls."""
        if param not in self.ranges:
            raise ValueError(f"param={param!r} has no slider; sliders: {sorted(self.ranges)}")
        return [v for v in self.ranges[param].positions() if not self.check(s.replace(**{param: v}))]

    def check_values(self, param: str, values: list, s: Settings) -> None:
        """Raise ValueError naming the ``values`` of ``param`` that are not valid with ``s``'s other controls."""
        bad = [v for v in values if self.check(s.replace(**{param: v}))]
        if bad:
            raise ValueError(f"values {bad} of {param} are not valid with the current controls")
