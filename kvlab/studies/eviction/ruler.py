"""Synthetic RULER-style retrieval tasks (Hsieh et al., 2024, "RULER: What's the real context size of your
long-context language models?"), generated deterministically from a seed, with one scorer per task.

Four tasks, each RULER's template adapted to a raw completion prompt (``chat=False``, as the passkey needle of
:mod:`kvlab.studies.eviction.needle` is: the question ends with the answer's prefix, so the model completes it; RULER's questions shortened to ~20-35 tokens, since the ``streamed``
setting feeds them one decode step per token):

* ``niah_single``   — one needle ``"One of the special magic numbers for {key} is: {value}."`` in RULER's noise
  haystack (the passkey filler, "The grass is green. ..."); asked for the key's number. Score: the first number
  of the completion equals the value (exact, as :func:`kvlab.studies.eviction.needle.is_correct`).
* ``niah_multikey`` — the same, with ``DISTRACTORS`` further needles under other keys (RULER's niah_multikey_1:
  4 keys, one asked). Score: as niah_single (a distractor's number is wrong).
* ``niah_multivalue`` — ``VALUES`` needles with the same key and different numbers (RULER's niah_multivalue:
  4 values). Score: the fraction of the values among the completion's numbers (``partial``); ``correct`` = all.
* ``vt`` — variable tracking: one chain ``VAR A = 12345. VAR B = VAR A. ...`` of ``HOPS`` hops spread over
  the haystack (RULER's vt: 1 chain, 4 hops, 5-letter names). Score: the fraction of the chain's variables
  named in the completion (``partial``); ``correct`` = all.

Needles sit at depths drawn uniformly (seeded) over the filler; ``depth`` of a case is the asked needle's (the
first one's for multi-needle tasks). The prompt is ``context + question``; ``context`` (instruction + haystack)
is what the ``streamed`` setting prefills. Lengths are prompt tokens within one filler sentence of the target.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Sequence

from kvlab.studies.eviction.needle import FILLER, KEY_DIGITS

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
DISTRACTORS = 3            # niah_multikey: needles under other keys beside the asked one
VALUES = 4                 # niah_multivalue: numbers under the asked key
HOPS = 4                   # vt: assignments after the first (5 variables)
ANSWER_TOKENS = {"niah_single": 8, "niah_multikey": 8, "niah_multivalue": 32, "vt": 24}

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.\n")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}. "
NIAH_Q = "\nWhat is the special magic number for {key}? The special magic number for {key} is"
NIAH_QS = "\nWhat are all the special magic numbers for {key}? The special magic numbers for {key} are"
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_Q = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: The {n} "
        "variables assigned the value {value} are:")

_WORDS = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
          "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "urban", "vivid", "wild", "young")
_NOUNS = ("apple", "badger", "canyon", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchid", "pencil", "quarry", "river", "saddle", "tunnel",
          "violin", "wagon", "yacht", "zebra")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class RulerCase:
    """One task prompt: ``context`` (instruction + haystack with needles) then ``question`` (ends in the
    answer's prefix); ``answers``: what the scorer looks for; ``depth``: the asked needle's filler fraction."""

    task: str
    length: int
    rep: int
    seed: int
    context: str
    question: str
    answers: tuple[str, ...]
    depth: float

    @property
    def prompt(self) -> str:
        return self.context + self.question

    @property
    def answer_tokens(self) -> int:
        return ANSWER_TOKENS[self.task]


def _value(rng: random.Random) -> str:
    return str(rng.randint(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS - 1))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_NOUNS)}"


def _distinct(rng: random.Random, make, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _haystack(tokenizer, length: int, fixed_text: str, needles: Sequence[str], depths: Sequence[float]) -> str:
    """Filler sentences with each needle inserted at its depth (fraction of the filler before it); the number
    of filler units makes ``fixed_text`` + haystack about ``length`` tokens."""
    def n_tok(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    unit = n_tok(FILLER)
    fixed = n_tok(fixed_text + "".join(needles))
    units = max(1, round((length - fixed) / unit))
    at = sorted(zip((round(d * units) for d in depths), range(len(needles))))
    parts, done = [], 0
    for pos, i in at:
        parts.append(FILLER * (pos - done) + needles[i])
        done = pos
    return "".join(parts) + FILLER * (units - done)


def make_case(tokenizer, task: str, length: int, rep: int, seed: int = 0) -> RulerCase:
    """Case ``rep`` of ``task`` at about ``length`` prompt tokens: the same (task, length, rep, seed) always gives
    the same text (its random stream is seeded by all four)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} must be one of {TASKS}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 64:
        raise ValueError(f"length={length!r} must be an int >= 64 (prompt tokens)")
    rng = random.Random(f"ruler:{task}:{length}:{rep}:{seed}")
    if task == "vt":
        names = _distinct(rng, lambda r: "".join(r.choice(string.ascii_uppercase) for _ in range(5)), HOPS + 1)
        value = _value(rng)
        needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i + 1]} = VAR {names[i]}. " for i in range(HOPS)]
        depths = sorted(rng.uniform(0, 1) for _ in needles)          # a chain is written in order
        question = VT_Q.format(value=value, n=len(names))
        hay = _haystack(tokenizer, length, VT_INTRO + question, needles, depths)
        return RulerCase(task, length, rep, seed, VT_INTRO + hay, question, tuple(names), depths[0])
    if task == "niah_multivalue":
        key = _key(rng)
        values = _distinct(rng, _value, VALUES)
        needles = [NIAH_NEEDLE.format(key=key, value=v) for v in values]
        question = NIAH_QS.format(key=key)
    else:
        keys = _distinct(rng, _key, 1 + (DISTRACTORS if task == "niah_multikey" else 0))
        values = _distinct(rng, _value, len(keys))
        needles = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        question = NIAH_Q.format(key=keys[0])
        values = values[:1]
    depths = [rng.uniform(0, 1) for _ in needles]
    hay = _haystack(tokenizer, length, NIAH_INTRO + question, needles, depths)
    return RulerCase(task, length, rep, seed, NIAH_INTRO + hay, question, tuple(values), depths[0])


def make_cases(tokenizer, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int = 0) -> list[RulerCase]:
    """``n`` cases of every (task, length), in (task, length, rep) order."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n={n!r} must be a positive int (cases per task and length)")
    return [make_case(tokenizer, t, int(L), r, seed) for t in tasks for L in lengths for r in range(n)]


def numbers(text: str) -> list[str]:
    """The digit runs of a completion, in order."""
    return _DIGITS.findall(text or "")


def score(task: str, text: str, answers: Sequence[str]) -> tuple[float, float]:
    """``(correct, partial)`` of a completion: single-answer tasks (niah_single, niah_multikey): the first number
    equals the answer (both 0/1); niah_multivalue: partial = the fraction of the answers among its numbers;
    vt: partial = the fraction of the variable names it names (whole words, case-sensitive, as RULER writes
    them); correct = 1 only when partial is 1."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} must be one of {TASKS}")
    if not answers:
        raise ValueError("answers must name at least one expected answer")
    if task in ("niah_single", "niah_multikey"):
        got = numbers(text)
        ok = float(bool(got) and got[0] == answers[0])
        return ok, ok
    found = set(numbers(text)) if task == "niah_multivalue" else set(re.findall(r"[A-Za-z]+", text or ""))
    part = sum(a in found for a in answers) / len(answers)
    return float(part == 1.0), part


__all__ = ["TASKS", "ANSWER_TOKENS", "RulerCase", "make_case", "make_cases", "score", "numbers"]
