"""The training study: every student variant side by side on the evaluation prompts.
Its runs go through the run store; the tables are returned, not written.

Runs (all through :func:`kvlab.studies.experiment.run_policies`, so they are stored and reused):
OverFill with each variant's student (no refresh, and with ``Periodic(T)`` refresh), and the
student alone for ``pruned`` and ``standalone``. Tables:

* ``train_study``: per variant, OverFill's paired difference to the student alone (``pruned`` for the
  untrained pair, ``standalone`` for the trained ones): ΔPPL / ΔKL with bootstrap 95 % CIs over prompts,
  and the refresh effect ΔKL / ΔPPL (refresh − none) with its CI;
* ``train_speed``: decode ms/step of teacher and student, timed alternately in this process;
* ``train_curves``: the training logs (loss per step, held-out KL) of the cached trained variants.
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from kvlab.decode import DecodeConfig
from kvlab.studies.experiment import RunSpec, paired_bootstrap, run_policies, write_table
from kvlab.refresh.policies import Periodic

VARIANTS = ("pruned", "standalone", "overfill", "refresh-aware")


def _ci(df: pd.DataFrame, name: str, m: str) -> tuple[float, float, float]:
    r = df.set_index("policy").loc[name]
    return r[f"d_{m}"], r[f"d_{m}_lo"], r[f"d_{m}_hi"]


def study_runs(teacher, students: dict, spec: RunSpec, store, T: int, progress: bool = True) -> pd.DataFrame:
    """Per-run rows, ``policy`` = ``<variant>:overfill`` / ``<variant>:refresh`` / ``<variant>:student``."""
    frames = []
    for v, lm in students.items():
        pol = {f"{v}:overfill": DecodeConfig(mode="overfill"),
               f"{v}:refresh": DecodeConfig(mode="overfill", refresh=Periodic(T))}
        if v in ("pruned", "standalone"):
            pol[f"{v}:student"] = DecodeConfig(mode="student")
        frames.append(run_policies(teacher, lm, spec, pol, store, progress))
    return pd.concat(frames, ignore_index=True)


def study_table(per_run: pd.DataFrame, students: dict, T: int) -> pd.DataFrame:
    rows = []
    for v in students:
        alone = "pruned:student" if v == "pruned" else "standalone:student"
        sub = per_run[per_run.policy.isin([alone, f"{v}:overfill", f"{v}:refresh"])]
        of = paired_bootstrap(sub, alone, metrics=("teacher_ppl", "kl"))
        rf = paired_bootstrap(sub, f"{v}:overfill", metrics=("teacher_ppl", "kl"))
        mean = sub.groupby("policy")[["teacher_ppl", "kl"]].mean()
        row = {"variant": v, "student_alone": alone.split(":")[0],
               "ppl_S": mean.loc[alone, "teacher_ppl"], "ppl_OF": mean.loc[f"{v}:overfill", "teacher_ppl"],
               "ppl_OF_refresh": mean.loc[f"{v}:refresh", "teacher_ppl"],
               "kl_S": mean.loc[alone, "kl"], "kl_OF": mean.loc[f"{v}:overfill", "kl"],
               "kl_OF_refresh": mean.loc[f"{v}:refresh", "kl"]}
        for m, tag in (("teacher_ppl", "ppl"), ("kl", "kl")):
            d, lo, hi = _ci(of, f"{v}:overfill", m)
            row.update({f"d{tag}_OF_vs_S": d, f"d{tag}_OF_vs_S_lo": lo, f"d{tag}_OF_vs_S_hi": hi})
            d, lo, hi = _ci(rf, f"{v}:refresh", m)
            row.update({f"d{tag}_refresh": d, f"d{tag}_refresh_lo": lo, f"d{tag}_refresh_hi": hi})
        row["refresh"] = f"Periodic(T={T})"
        row["n_prompts"] = int(sub.prompt_idx.nunique())
        rows.append(row)
    return pd.DataFrame(rows)


def decode_speed(teacher, student, prompt: str, steps: int = 32, repeats: int = 3) -> dict:
    """Median ms per cached decode step of teacher and student, timed alternately (same process/load)."""
    import statistics

    import torch

    def one(lm) -> float:
        ids = torch.tensor([lm.encode_prompt(prompt)], device=lm.device)
        with torch.inference_mode():
            out = lm.model(input_ids=ids, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = lm.model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / steps * 1000

    one(teacher), one(student)   # warm-up
    tt, ss = [], []
    for r in range(repeats):
        for lm, acc in ((teacher, tt), (student, ss)) if r % 2 == 0 else ((student, ss), (teacher, tt)):
            acc.append(one(lm))
    t, s = statistics.median(tt), statistics.median(ss)
    return {"teacher_ms_step": t, "student_ms_step": s, "speedup": t / s, "steps": steps, "repeats": repeats}


def curves_frame(paths: dict) -> pd.DataFrame:
    from .weights import read_log

    frames = []
    for v, p in paths.items():
        if (Path(p) / "train_log.jsonl").is_file():
            df = pd.DataFrame(read_log(p))
            df.insert(0, "variant", v)
            frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def tiny_training_curves(variants=("standalone", "overfill", "refresh-aware"), steps: int = 12,
                         seed: int = 0) -> pd.DataFrame:
    """Train tiny random students for ``steps`` steps on a tiny teacher's own samples; their logs as
    :func:`curves_frame` returns them (a seconds-long, real run of the trainer for smoke runs and for
    machines whose model cache holds no trained students). Leaves torch's global generator alone."""
    import tempfile

    import torch

    from kvlab.core.tiny import make_tiny_lm, tiny_examples
    from .config import TRAINED_VARIANTS, TrainConfig
    from .trainer import train

    bad = [v for v in variants if v not in TRAINED_VARIANTS]
    if bad:
        raise ValueError(f"variants={bad}: only trained variants have curves ({', '.join(TRAINED_VARIANTS)})")
    cfg = TrainConfig(steps=steps, batch=3, lr=3e-3, warmup=1, train_prompts=14, heldout=2, eval_every=3,
                      topk=16, lora_rank=0, seed=seed, refresh_gap=(2, 5), refresh_none=0.25)
    frames = []
    with torch.random.fork_rng(), tempfile.TemporaryDirectory() as tmp:
        teacher = make_tiny_lm(seed=seed)
        examples = tiny_examples(teacher, 16, seed=seed)
        for v in variants:
            student = make_tiny_lm(seed=seed + 1, intermediate_size=48)
            res = train(student, teacher, examples[:-2], examples[-2:], v, cfg, Path(tmp) / v, progress=False)
            df = pd.DataFrame(res.log)
            df.insert(0, "variant", v)
            frames.append(df)
    return pd.concat(frames, ignore_index=True)


STUDY_NOTES = ["`dppl_OF_vs_S`, `dkl_OF_vs_S`: OverFill with this variant's student minus the student alone "
               "(`student_alone`), paired over prompts (same seeds), bootstrap 95 % CI `[_lo, _hi]`; < 0 = OverFill "
               "better.",
               "`dkl_refresh`, `dppl_refresh`: OverFill + `refresh` minus OverFill without refresh, same student, "
               "paired; < 0 = refresh helps.",
               "`kl`: mean KL(p_T‖q) in nats over the steps whose token the student chose; `ppl`: teacher perplexity of "
               "the generated text."]
