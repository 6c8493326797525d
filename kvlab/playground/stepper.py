"""Step-through decoding: one :class:`~kvlab.decode.Decoding`, stepped a token at a time.
Holds the decoding in memory; it stores nothing.

Each :meth:`Stepper.step` returns a :class:`StepView`: the chosen token, the top-5 candidates of
the distribution it was drawn from, entropy, cache length, whether a refresh fired (and how many
entries it spliced), and the decoding cache's live map (position, writer, token of every slot) —
which turns teacher-coloured where a refresh spliced the teacher's entries. Works for every mode
and refresh policy (whatever the settings build). Uses the playground's models through its
:class:`~kvlab.playground.runner.ModelGate`, so it can step while a background run decodes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from kvlab.decode import Decoding, StepRecord
from kvlab.playground.settings import Settings, decode_config
from kvlab.playground.why import reason


class SettingsError(ValueError):
    """Bad settings: ``errors`` maps each bad control to its message."""

    def __init__(self, errors: dict):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


@dataclass(frozen=True)
class Slot:
    position: int
    writer: str       # "teacher" | "student"
    token: str


@dataclass(frozen=True)
class StepView:
    record: StepRecord
    token: str
    top5: tuple       # ((token text, probability, token id), ...) of the distribution the token was drawn from
    entropy_bits: float
    cache_len: int
    refreshed: bool
    spliced: int
    source: str       # which model's distribution the token came from
    live: tuple       # Slot per cache slot, in slot order
    prompt_len: int
    text: str         # the generated text so far
    done: bool        # the last step of the run
    why: str = ""     # the refresh policy's reason for firing or not at this step ("" without a policy)


class Stepper:
    """Step / run / reset over one decoding of a :class:`~kvlab.playground.Playground`'s settings."""

    def __init__(self, playground, settings: Settings | None = None):
        self.pg = playground
        self.history: list[StepView] = []
        self.decoding: Decoding | None = None
        self._it = None
        self._stop = threading.Event()
        self.settings: Settings | None = None
        self.reset(settings)

    def reset(self, settings: Settings | None = None) -> None:
        """Start over with ``settings`` (default: the playground's current ones). Bad settings raise
        :class:`SettingsError` and leave the current decoding untouched."""
        s = settings or self.pg.settings
        errors = self.pg.check(s)
        if errors:
            raise SettingsError(errors)
        cfg = replace(decode_config(s), keep_dists=True)
        with self.pg.gate.hold():
            student = None if s.mode == "teacher" else self.pg.student_for(s)
            d = Decoding(self.pg.teacher, student, s.prompt, cfg)
        self.stop()
        self.settings, self.decoding, self._it = s, d, iter(d)
        self.history = []

    @property
    def done(self) -> bool:
        return bool(self.history) and self.history[-1].done

    @property
    def total(self) -> int:
        return self.settings.N

    def step(self) -> StepView | None:
        """Decode one token (None when the run is over)."""
        if self.done:
            return None
        d, it = self.decoding, self._it
        with self.pg.gate.hold():
            try:
                rec = next(it)
            except StopIteration:
                return None
        logp = d.dists[-1]                                          # (V,) the distribution y_t was drawn from
        top = torch.topk(logp, 5)
        tok = d.decoder.tokenizer
        top5 = tuple((tok.decode([int(i)]), float(p), int(i)) for p, i in zip(top.values.exp().tolist(), top.indices.tolist()))
        c = d.cache
        live = tuple(Slot(p, w, tok.decode([int(t)])) for p, w, t in zip(c.positions, c.writers, c.token_ids))
        done = rec.step >= d.first_step + d.config.max_new_tokens - 1 or (
            rec.token_id in d.eos_ids and not d.config.ignore_eos)
        policy = d.config.refresh
        why = reason(policy, rec) if policy is not None else ""
        view = StepView(record=rec, token=rec.token, top5=top5, entropy_bits=rec.entropy_bits, cache_len=len(c),
                        refreshed=rec.refreshed, spliced=rec.spliced, source=rec.source, live=live,
                        prompt_len=len(d.prompt_ids), text=tok.decode(d.tokens, skip_special_tokens=True), done=done,
                        why=why)
        if self.decoding is not d:        # reset while this step ran: it belongs to the old decoding
            return None
        self.history.append(view)
        return view

    def run(self, on_step=None, max_steps: int | None = None) -> list[StepView]:
        """Step until the end, :meth:`stop`, or ``max_steps``; ``on_step(view)`` after each step."""
        stop = self._stop = threading.Event()
        out = []
        while not stop.is_set() and (max_steps is None or len(out) < max_steps):
            v = self.step()
            if v is None:
                break
            out.append(v)
            if on_step is not None:
                on_step(v)
        return out

    def stop(self) -> None:
        self._stop.set()
