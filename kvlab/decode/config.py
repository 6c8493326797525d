"""What a run is asked to do: :class:`DecodeConfig` (mode, length, sampling, policies, teacher forcing) and
:class:`Sampling`. Validated on construction, before any model work; ``to_dict`` is the run key's part."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvlab.decode.keys import policy_dict
from kvlab.decode.protocols import validate_evict, validate_policy, evict_attr

MODES = ("teacher", "student", "overfill")
REFRESH_NEXT = ("rerun", "student", "teacher")


@dataclass(frozen=True)
class Sampling:
    """``temperature == 0`` → greedy; otherwise seeded sampling with nucleus ``top_p``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "overfill"
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    ignore_eos: bool = True       # the blog compares fixed-N runs
    chat: bool = True             # apply the tokenizer's chat template to the prompt
    keep_dists: bool = False      # keep every step's full log-distribution (for KL scoring)
    rebuild_student_cache: bool = False  # overfill with an incompatible pair: student prefills from text
    refresh: Any = None           # a refresh policy (kvlab.refresh.policies) or None; overfill only
    refresh_next: str = "rerun"   # who picks the token after a refresh: "rerun" | "student" | "teacher"
    evict: Any = None             # an eviction policy (kvlab.eviction) or None; every mode
    forced: tuple = ()            # teacher forcing: y_1.. are these token ids (then chosen as usual); every phase runs

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive int (N > 0)")
        if not isinstance(self.sampling, Sampling):
            raise ValueError("sampling must be a kvlab.Sampling(temperature=..., top_p=..., seed=...)")
        if self.refresh_next not in REFRESH_NEXT:
            raise ValueError(f"refresh_next={self.refresh_next!r} must be one of {REFRESH_NEXT}")
        if self.refresh is not None:
            if self.mode != "overfill":
                raise ValueError(f"refresh needs mode='overfill' (got mode={self.mode!r}): only overfill "
                                 "has a student cache for the teacher to correct")
            if self.rebuild_student_cache:
                raise ValueError("refresh splices teacher K/V into the student cache, which needs the same KV "
                                 "geometry; rebuild_student_cache=True means it differs")
            validate_policy(self.refresh)
        if not isinstance(self.forced, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                     for t in self.forced):
            raise ValueError("forced must be a tuple of token ids (ints >= 0), e.g. tuple(trace.tokens)")
        if self.evict is not None:
            validate_evict(self.evict)
            if evict_attr(self.evict, "rerotate") and self.refresh is not None:
                raise ValueError("evict.rerotate=True moves the student's entries to new positions, but a refresh "
                                 "splices teacher entries by absolute position; use rerotate=False with refresh")

    def to_dict(self) -> dict:
        d = asdict(replace(self, refresh=None, evict=None))
        if not self.forced:             # absent when unused: stored-run keys of free-running runs stay valid
            del d["forced"]
        else:
            d["forced"] = list(self.forced)
        d["refresh"] = policy_dict(self.refresh)
        del d["evict"]
        if self.evict is not None:      # absent when None: stored-run keys of runs without eviction stay valid
            d["evict"] = policy_dict(self.evict)
        return d
