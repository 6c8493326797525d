"""What a run produces: one frozen :class:`StepRecord` per token (with its :class:`Signals` and costs) and the
finished :class:`Trace`."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

import torch

from kvlab.decode.config import DecodeConfig


class Signals(tuple):
    """Read-only ``(name, value)`` pairs with mapping-style ``get`` (hashable, frozen)."""

    def __new__(cls, items=()):
        if isinstance(items, Mapping):
            items = items.items()
        return super().__new__(cls, tuple(sorted((str(k), float(v)) for k, v in items)))

    def get(self, name: str, default=None):
        for k, v in self:
            if k == name:
                return v
        return default

    def __getitem__(self, key):
        if isinstance(key, str):
            v = self.get(key, _MISSING)
            if v is _MISSING:
                raise KeyError(key)
            return v
        return super().__getitem__(key)

    def to_dict(self) -> dict:
        return dict(self)


_MISSING = object()


@dataclass(frozen=True)
class StepRecord:
    step: int            # 1-based index of the generated token
    token_id: int
    token: str
    position: int        # absolute position of this token in the sequence
    logprob: float       # log p(token) under the distribution it was drawn from (untempered)
    entropy_bits: float  # entropy of that distribution, bits
    top1_prob: float
    margin: float        # p(top1) - p(top2)
    cache_len: int       # decoding cache entries after this step (after its evict phase)
    source: str          # which model produced the distribution ("teacher"/"student")
    refreshed: bool      # a refresh happened after this step
    evicted: int         # cache entries evicted at this step
    wall_s: float        # compute time of this step (excludes time the consumer held the generator)
    elapsed_s: float     # cumulative compute time since the start of prefill
    since_refresh: int = 0       # t - (step of the last refresh, 0 if none): steps the student ran alone
    signals: Signals = Signals()  # probe signals of this step (name, value) pairs; .get(name)
    probed: bool = False         # a probe ran at this step
    spliced: int = 0             # student-cache entries rewritten with the teacher's at this step
    teacher_tokens: int = 0      # teacher tokens processed at this step (probe + refresh delta)
    probe_tokens: int = 0        # of which for the probe
    teacher_s: float = 0.0       # teacher compute time at this step
    probe_cost: tuple = ()       # the probe's cost counters, (name, value) pairs
    cache_bytes: int = 0         # real bytes of the decoding cache's K/V after this step (INT8 counted as such)
    meta_bytes: int = 0          # bytes of the cache's attention statistics after this step (eviction policies)
    forward_bytes: int = 0       # K/V bytes held during this step's forward (INT8 prefix dequantized for it)
    cache_bytes16: int = 0       # cache_bytes at the 16-bit reference (FP entries at 2 bytes/element; INT8 as is)


@dataclass
class Trace:
    """A finished generation: its records plus what scoring needs."""

    records: list[StepRecord]
    prompt: str
    prompt_ids: list[int]
    config: DecodeConfig
    ttft_s: float
    total_s: float
    text: str
    model_logprobs: torch.Tensor | None = None
    """``(N, V)``: row ``t`` is ``log_softmax`` of the logits step ``t`` chose from — the model's own
    next-token distribution ``q_t``, *untempered and not top-p truncated* (sampling applies
    temperature and the nucleus on top of it). ``None`` unless run with ``keep_dists=True``."""
    live: dict | None = None   # the decoding cache at the end: {"positions": [...], "writers": [...]} per slot

    @property
    def dists(self) -> torch.Tensor | None:
        """Deprecated alias of :attr:`model_logprobs` (they are not the sampling distributions)."""
        import warnings

        warnings.warn("Trace.dists is deprecated: use Trace.model_logprobs (untempered model log-probs)",
                      DeprecationWarning, stacklevel=2)
        return self.model_logprobs

    @property
    def tokens(self) -> list[int]:
        return [r.token_id for r in self.records]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.records])
