"""The playground's side of the run store: the config a setting is stored under, the stored run of a
setting, a run answered from the store or decoded now (and stored), and the :class:`~kvlab.playground.shown.Shown`
built from a run and its baseline.

Runs are keyed by their full config, the key :func:`kvlab.harness.experiment.scored_run` stores under, so a run
made by a table, a sweep or the playground is the same row.
"""
from __future__ import annotations

import time
from dataclasses import replace

from kvlab.harness.experiment import run_config, scored_run, scored_runs
from kvlab.store import run_key
from kvlab.playground.settings import Settings, decode_config, refresh_policy
from kvlab.playground.shown import Shown, readouts
from kvlab.playground.students import StudentPool
from kvlab.playground.why import refresh_reasons, same_tokens_note


class RunReader:
    """Stored runs of settings, for one teacher, its :class:`~kvlab.playground.students.StudentPool` and
    a :class:`~kvlab.store.RunStore`. Token texts and prompt lengths are cached per tokenizer."""

    def __init__(self, teacher, students: StudentPool, store):
        self.teacher = teacher
        self.students = students
        self.store = store
        self._prompt_len: dict[tuple, int] = {}
        self._tok_text: dict[tuple, str] = {}

    def config(self, s: Settings, student) -> dict:
        """The run-store config of ``s`` (what :func:`scored_run` keys the run under)."""
        cfg = replace(decode_config(s), keep_dists=True)
        return run_config(self.teacher, None if s.mode == "teacher" else student, s.prompt, cfg)

    def key(self, s: Settings) -> str | None:
        """The run-store key of ``s`` (None while its student is not loaded)."""
        student = self.students.if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        return run_key(self.config(s, student))

    def stored(self, s: Settings) -> dict | None:
        """The stored result of ``s`` or None (also None while its student is not loaded)."""
        student = self.students.if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        return self.store.get(self.config(s, student))

    def scored(self, s: Settings, student, on_step=None) -> dict:
        """The result of ``s``: from the store, or decoded now (``on_step(rec, decoding)`` per step) and stored."""
        return scored_run(self.teacher, None if s.mode == "teacher" else student, s.prompt, decode_config(s),
                          self.store, on_step=on_step)

    def scored_many(self, settings: list[Settings], student, batch: int | None = None, on_step=None) -> list[dict]:
        """The results of ``settings`` (in order): from the store, or decoded now ``batch`` at a time
        (:func:`kvlab.harness.experiment.scored_runs`; ``on_step(rec, decoding)`` per decoded step, e.g.
        to cancel) and stored. Settings of one run (the same key) are decoded once."""
        first: dict = {}
        jobs, students = [], {}
        for s in settings:
            k = run_key(self.config(s, student))
            if k not in first:
                first[k] = len(jobs)
                jobs.append(s)
        out: list = [None] * len(jobs)
        for who in ("teacher", "student"):           # teacher mode keys its runs without a student
            idx = [i for i, s in enumerate(jobs) if (s.mode == "teacher") == (who == "teacher")]
            if not idx:
                continue
            step = None if on_step is None else (lambda j, rec, d: on_step(rec, d))
            res = scored_runs(self.teacher, None if who == "teacher" else student,
                              [(jobs[i].prompt, decode_config(jobs[i])) for i in idx], self.store, batch=batch,
                              on_step=step)
            for i, r in zip(idx, res):
                out[i] = r
        return [out[first[run_key(self.config(s, student))]] for s in settings]

    def tokens(self, s: Settings, ids) -> list[str]:
        """The text of each token id, decoded by the tokenizer of the model that wrote ``s``'s tokens."""
        lm = self.students.if_loaded(s) if s.mode == "student" else self.teacher
        tok = lm.tokenizer
        out = []
        for i in ids:
            k = (id(tok), int(i))
            if k not in self._tok_text:
                self._tok_text[k] = tok.decode([int(i)])
            out.append(self._tok_text[k])
        return out

    def prompt_len(self, s: Settings) -> int:
        """Cache entries of ``s``'s prompt."""
        lm = self.students.if_loaded(s) if s.mode == "student" else self.teacher
        k = (id(lm), s.prompt)
        if k not in self._prompt_len:
            self._prompt_len[k] = len(lm.encode_prompt(s.prompt))
        return self._prompt_len[k]

    def build(self, s: Settings, student, result: dict, base: dict, source: str, t0: float) -> Shown:
        """What the view shows for run ``result`` of ``s`` and its baseline ``base`` (``t0``: the request's
        ``time.perf_counter()``)."""
        b = s.baseline()
        return Shown(settings=s, key=run_key(self.config(s, student)), base_key=run_key(self.config(b, student)),
                     result=result, base=base, readouts=readouts(result, base, s.mode),
                     base_readouts=readouts(base, base, s.mode),
                     tokens=self.tokens(s, result["steps"]["token_id"]),
                     base_tokens=self.tokens(s, base["steps"]["token_id"]),
                     prompt_len=self.prompt_len(s), source=source, seconds=time.perf_counter() - t0,
                     reasons=tuple(refresh_reasons(refresh_policy(s), result["steps"])),
                     note=same_tokens_note(result, base) if s.policy != "none" else None)

    def from_disk(self, s: Settings, t0: float) -> Shown | None:
        """The :class:`Shown` of ``s`` when the run and its baseline are both stored (and its student is
        loaded), else None. Decodes nothing."""
        student = self.students.if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        result = self.store.get(self.config(s, student))
        if result is None:
            return None
        base = self.store.get(self.config(s.baseline(), student))
        if base is None:
            return None
        return self.build(s, student, result, base, "disk", t0)
