"""What a command will train before it runs, said up front: which students, roughly how long, how to skip.

A command that needs trained students (``baselines``, ``refresh``, ``train-study``, ``all``, ...) calls
:func:`announce` before loading anything. Students in the model cache cost nothing; students the repository
ships (:mod:`kvlab.train.shipped`) are rebuilt from their fp16 adapters in seconds; the rest are trained
(teacher data once, then each student), which takes minutes to tens of minutes on a CPU.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

# Rates measured on a 2-core AMD EPYC VM with 2 threads (the run that trained PARETO_TRAIN's students):
# the teacher's responses to 424 prompts × ≤ 128 tokens in 14.5 min; 424 multi-turn history examples
# (300-800 tokens, mean 600) in 24 min; an overfill training step of 4 examples costs about 1.35 s per short
# example and 4.15 s per history example (a least-squares fit over the steps of its log; evaluations add about
# a quarter). Another VM of the same name ran the README's timed `make figures` about 3x faster, so the notice
# says "about".
CPU_DATA_S_PER_TOKEN = 14.5 * 60 / (424 * 128)        # per response-token budget (prompts × tokens)
CPU_HISTORY_S_PER_EXAMPLE = 24.0 * 60 / 424           # building one history example (one teacher forward)
CPU_TRAIN_S_PER_EXAMPLE = 1.35 * 1.25                 # one student, per short example (steps × batch), evals included
CPU_TRAIN_S_PER_HISTORY_EXAMPLE = 4.15 * 1.25         # one student, per history example, evals included
GPU_SPEEDUP = 10.0                # rough, not measured here: a lent GPU was not available to time it


@dataclass(frozen=True)
class TrainPlan:
    shape: object                  # PruneShape
    cfg: object                    # TrainConfig
    cached: tuple = ()             # variants already in the model cache
    shipped: tuple = ()            # variants rebuilt from the repository's adapters (seconds)
    train: tuple = ()              # variants to train
    need_data: bool = False        # the teacher's training responses are not cached yet
    need_history: bool = False     # the multi-turn history examples (cfg.history > 0) are not cached yet
    skip_hint: bool = True         # say how to skip it (not for `train-student`, whose job it is)

    def estimate_s(self, device=None) -> float:
        """Rough seconds for the training part (0 when nothing is trained)."""
        if not self.train:
            return 0.0
        cfg = self.cfg
        s = len(self.train) * self.per_student_s()
        if self.need_data:
            s += cfg.train_prompts * cfg.tokens * CPU_DATA_S_PER_TOKEN
        if self.need_history:
            s += cfg.train_prompts * CPU_HISTORY_S_PER_EXAMPLE
        return s / GPU_SPEEDUP if getattr(device, "type", device) == "cuda" else s

    def per_student_s(self) -> float:
        """Rough CPU seconds to train one student: steps × batch examples, a share ``history`` of them long."""
        h = self.cfg.history
        return self.cfg.steps * self.cfg.batch * ((1 - h) * CPU_TRAIN_S_PER_EXAMPLE + h * CPU_TRAIN_S_PER_HISTORY_EXAMPLE)

    def message(self, device=None) -> str:
        """The up-front notice ('' when nothing needs training or rebuilding)."""
        from kvlab.core.models import cache_dir

        from kvlab.train.names import train_command

        lines = []
        flag = self.shape.flag
        if self.shipped:
            lines.append(f"kvlab: building the {', '.join(self.shipped)} student(s) ({flag}) from the adapters shipped "
                         "in the repository (kvlab/train/shipped; seconds, no training).")
        if self.train:
            est = self.estimate_s(device)
            where = "a GPU (rough: not measured)" if getattr(device, "type", device) == "cuda" else "a 2-core CPU"
            data = (f"the teacher's responses to {self.cfg.train_prompts} training prompts (once, "
                    f"~{self.cfg.train_prompts * self.cfg.tokens * CPU_DATA_S_PER_TOKEN / 60:.0f} min on a 2-core CPU), "
                    "then " if self.need_data else "")
            if self.need_history:   # kvlab.train.history: teacher-forced, no generation
                data += (f"the multi-turn history examples (--history {self.cfg.history:g}: one teacher forward over "
                         f"{self.cfg.history_tokens[0]}-{self.cfg.history_tokens[1]} tokens per training prompt, once, "
                         f"~{self.cfg.train_prompts * CPU_HISTORY_S_PER_EXAMPLE / 60:.0f} min on a 2-core CPU), then ")
            per = self.per_student_s() / 60
            lines += [
                f"kvlab: this command needs trained students that are not in the model cache "
                f"({cache_dir() / 'models'}): {', '.join(self.train)} ({flag}; {self.cfg.steps} steps × "
                f"{self.cfg.batch}, LoRA r{self.cfg.lora_rank}).",
                f"kvlab: it trains them first: {data}~{per:.0f} min per student — about {est / 60:.0f} min in all "
                f"on {where}. They are cached: later commands start at once.",
            ]
            if self.skip_hint:
                lines.append("kvlab: to skip training, pass --student pruned (the untrained pruned student), or train "
                             "them ahead in another terminal: `"
                             + train_command(self.train[0], self.shape, self.cfg).replace(
                                 self.train[0], " ".join(self.train), 1) + "`.")
        return "\n".join(lines)


def plan(variants, shape, cfg=None, *, use_shipped: bool = True) -> TrainPlan:
    """What loading ``variants`` at ``shape`` under ``cfg`` will do (no model loads, nothing trained).
    ``use_shipped=False``: ``train-student``, which trains from scratch even where an adapter is shipped."""
    from kvlab.core.models import cache_dir

    from kvlab.train.config import DEFAULT_TRAIN, TRAINED_VARIANTS
    from kvlab.train.data import _data_dir, data_key, load_train_prompts
    from kvlab.train.shipped import shipped_entry
    from kvlab.train.names import _shape, trained_dir

    cfg = cfg or DEFAULT_TRAIN
    shape = _shape(shape)
    cached, shipped, train = [], [], []
    for v in dict.fromkeys(variants):
        if v not in TRAINED_VARIANTS:
            continue
        if (trained_dir(v, shape, cfg) / "config.json").is_file():
            cached.append(v)
        elif use_shipped and shipped_entry(v, shape, cfg) is not None:
            shipped.append(v)
        else:
            train.append(v)
    need_data = False
    if train:
        from kvlab.core.models import TEACHER_NAME

        key = data_key(load_train_prompts(cfg.train_prompts), TEACHER_NAME, cfg.tokens, cfg.topk, cfg.data_seed_used, 53)
        need_data = not (_data_dir(key) / "examples.pt").is_file()
    # rough: the history examples' key needs the examples themselves; any built set counts as this one's
    need_history = bool(train and cfg.history) and (need_data or not any(
        (cache_dir() / "train").glob("history-*/examples.pt")))
    return TrainPlan(shape, cfg, tuple(cached), tuple(shipped), tuple(train), need_data, need_history,
                     skip_hint=use_shipped)


_SAID: set = set()


def announce(variants, shape, cfg=None, device=None, file=None, *, use_shipped: bool = True) -> TrainPlan:
    """Print :meth:`TrainPlan.message` (stderr) before a command trains or rebuilds anything; each plan
    is said once per process."""
    p = plan(variants, shape, cfg, use_shipped=use_shipped)
    msg = p.message(device)
    if msg and msg not in _SAID:
        _SAID.add(msg)
        print(msg, file=file or sys.stderr, flush=True)
    return p
