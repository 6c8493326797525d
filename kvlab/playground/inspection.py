"""The playground's cache inspector, in plain Python (no widgets): for the shown run, which prompt and
generated tokens each layer of the decoding cache still holds after step t — the text shaded by the
number of layers that keep each token, a layers × positions survival map, and the attention score that
decided it (:mod:`kvlab.viz.inspector` holds the data and the drawing; this module picks what to
show). Touches no model and no file: the inspector is fed by the run's own decode.

An :class:`Inspection` belongs to one shown configuration and is in one of three states:

* ``"full"`` — the full cache: every token stays on every layer, so there is nothing to inspect;
* ``"stored"`` — the run was answered from the run store, which keeps no per-layer history; the
  playground's ``inspect()`` decodes it again with an inspector attached (same config, same seed);
* ``"ready"`` — an inspector watched every step of the run: :meth:`Inspection.view` gives the state
  after any step ``t`` (:class:`InspectView`), rebuilt from the inspector's history.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.viz.inspector import STAT_LABELS, CacheInspector, score_stat, survival_figure, tokens_html
from kvlab.playground.settings import NO_EVICTION, Settings, eviction_policy

NOTHING = ("nothing to inspect: the full cache keeps every prompt and generated token on every layer "
           "(choose an eviction policy to see which tokens each layer drops)")
STORED = ("this run came from the run store, which keeps no per-layer history: “inspect the cache” decodes it "
          "again ({n} tokens, same config and seed) with the inspector attached")
STATES = ("full", "stored", "ready")


def recorder(s: Settings) -> CacheInspector | None:
    """A fresh inspector for a run of ``s`` (its score: the statistic the eviction policy ranks by), or
    None for the full cache."""
    if s.evict == NO_EVICTION:
        return None
    return CacheInspector(stat=score_stat(eviction_policy(s)))


@dataclass(frozen=True)
class InspectView:
    """What the inspector panel shows for one step (plain values). ``step`` is None when there is
    nothing to show (``message`` says why)."""

    state: str                  # "full" | "stored" | "ready"
    message: str                # one line: what is shown, or why nothing is
    step: int | None = None     # the step whose aftermath is shown
    first: int | None = None    # the steps a slider may pick: first..last
    last: int | None = None
    tokens_html: str = ""       # the prompt + generated text, shaded by the share of layers holding each token
    positions: tuple = ()       # the survival map's columns
    survival: np.ndarray | None = None   # (L, P) bool: layer l holds positions[p] after ``step``
    num_layers: int = 0
    stat: str | None = None     # the attention statistic shown as the score (None: the policy uses none)


class Inspection:
    """The cache inspector of one shown run (module docstring). ``inspector`` watched every step of the
    run (None: not inspected); ``tokenizer`` decodes its tokens; ``note`` is added to every message
    (e.g. a re-decode whose tokens differ from the stored run's)."""

    def __init__(self, settings: Settings, key: str | None, inspector: CacheInspector | None = None,
                 tokenizer=None, note: str = ""):
        self.settings, self.key = settings, key
        self.inspector = inspector if inspector is not None and inspector.steps else None
        self.tokenizer = tokenizer
        self.note = note

    @property
    def state(self) -> str:
        if self.settings.evict == NO_EVICTION:
            return "full"
        return "stored" if self.inspector is None else "ready"

    @property
    def steps(self) -> list[int]:
        """The steps that can be shown (none unless ``ready``)."""
        return list(self.inspector.steps) if self.state == "ready" else []

    def view(self, at: int | None = None) -> InspectView:
        """The state after step ``at`` (default: the last step). ``at`` outside the run raises
        ValueError naming the steps there are."""
        state = self.state
        if state == "full":
            return InspectView(state, NOTHING)
        if state == "stored":
            return InspectView(state, STORED.format(n=self.settings.N) + self._note())
        ins = self.inspector
        frame = ins.token_frame(self.tokenizer, at=at)
        pos, m = ins.survival(at)
        t = ins.steps[-1] if at is None else int(at)
        label = STAT_LABELS.get(ins.stat, ins.stat) if ins.stat else None
        return InspectView(state, self._message(t, frame, m, label) + self._note(), step=t, first=ins.steps[0],
                           last=ins.steps[-1], tokens_html=tokens_html(frame, ins.num_layers, score_name=label or "score"),
                           positions=tuple(pos), survival=m, num_layers=ins.num_layers, stat=ins.stat)

    def _message(self, t: int, frame, m: np.ndarray, label: str | None) -> str:
        L = m.shape[0]
        held = m.sum(axis=1)                                          # (L,) positions each layer holds
        gone = int((frame.layers == 0).sum())
        part = int(((frame.layers > 0) & (frame.layers < L)).sum())
        score = (f"score: {label} (what {self.settings.evict} ranks by)" if label
                 else f"score: none ({self.settings.evict} ranks without attention)")
        return (f"after step {t}: {len(frame)} tokens written; each layer holds {int(held.min())}–{int(held.max())}; "
                f"{gone} evicted from every layer, {part} from some layers only · {score}")

    def _note(self) -> str:
        return f" · {self.note}" if self.note else ""

    def survival_png(self, at: int | None = None, dpi: int = 80) -> bytes | None:
        """:meth:`figure` as PNG bytes (None unless ``ready``)."""
        fig = self.figure(at)
        if fig is None:
            return None
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()

    def figure(self, at: int | None = None):
        """The layers × positions survival map after step ``at`` (matplotlib; None unless ``ready``)."""
        if self.state != "ready":
            return None
        return survival_figure(self.inspector, title=f"{self.settings.evict}@{self.settings.budget}: which layers "
                               f"hold each position after step {self.inspector.steps[-1] if at is None else at}",
                               at=at)


def same_tokens_note(token_ids, stored_ids) -> str:
    """"" when a re-decode chose the stored run's tokens, else a note saying where it left them."""
    a, b = list(token_ids), list(stored_ids)
    if a == b:
        return ""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"the re-decode left the stored run's tokens at step {i + 1} (nondeterministic kernels?); "
            "the inspector shows the re-decode")


__all__ = ["NOTHING", "STATES", "STORED", "InspectView", "Inspection", "recorder", "same_tokens_note"]
