"""The training study: every student variant side by side on the evaluation prompts.
Its runs go through the run store; the tables are returned, not written.

Runs (all through :func:`kvlab.harness.experiment.run_policies`, so they are stored and reused):
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
from kvlab.harness.experiment import RunSpec, paired_bootstrap, run_policies, write_table
from kvlab.refresh.policies import Periodic
from kvlab.core.compat import cache_kwarg, output_cache

VARIANTS = ("pruned", "standalone", "overfill", "refresh-aware")


def _ci(df: pd.DataFrame, name: str, m: str) -> tuple[float, float, float]:
    r = df.set_index("policy").loc[name]
    return r[f"d_{m}"], r[f"d_{m}_lo"], r[f"d_{m}_hi"]


def study_runs(teacher, students: dict, spec: RunSpec, store, T: int, progress: bool = True,
               forced: bool = True) -> pd.DataFrame:
    """Per-run rows, ``policy`` = ``<variant>:overfill`` / ``<variant>:refresh`` / ``<variant>:student`` (every
    variant's decoder alone on its own prefill: the blog's Student baseline; for ``standalone`` it is also the
    paper's equal-budget baseline). With ``forced``, each run also gets ``kl_forced`` / ``nll_forced`` /
    ``distinct2`` (kvlab.harness.forced: teacher-forced on the teacher's stored reference continuation)."""
    from kvlab.harness.forced import forced_columns

    frames = []
    for v, lm in students.items():
        pol = {f"{v}:overfill": DecodeConfig(mode="overfill"),
               f"{v}:refresh": DecodeConfig(mode="overfill", refresh=Periodic(T)),
               f"{v}:student": DecodeConfig(mode="student")}
        runs = run_policies(teacher, lm, spec, pol, store, progress)
        if forced:
            runs = runs.merge(forced_columns(teacher, lm, spec, pol, store), on=["policy", "prompt_idx"], how="left")
        frames.append(runs)
    return pd.concat(frames, ignore_index=True)


def _paired(sub: pd.DataFrame, base: str, name: str, m: str) -> tuple[float, float, float, float]:
    """(Δ, lo, hi, MDE) of ``name`` − ``base`` for metric ``m`` over the prompts both ran."""
    from kvlab.core.metrics import add_mde

    pb = add_mde(paired_bootstrap(sub, base, metrics=(m,)), sub, base, (m,)).set_index("policy").loc[name]
    return pb[f"d_{m}"], pb[f"d_{m}_lo"], pb[f"d_{m}_hi"], pb[f"d_{m}_mde"]


def study_table(per_run: pd.DataFrame, students: dict, T: int) -> pd.DataFrame:
    """One row per variant: OverFill vs the student alone (``pruned`` for the untrained pair, ``standalone``
    for the trained ones: the paper's baseline) and, with ``kl_forced``, vs the same decoder alone (the blog's),
    and the refresh effect; paired differences with bootstrap 95 % intervals (and MDE for ``kl_forced``)."""
    rows = []
    forced = "kl_forced" in per_run
    for v in students:
        alone = "pruned:student" if v == "pruned" else "standalone:student"
        if alone not in set(per_run.policy):
            alone = f"{v}:student"
        own = f"{v}:student"
        sub = per_run[per_run.policy.isin([alone, own, f"{v}:overfill", f"{v}:refresh"])]
        metrics = ("teacher_ppl", "kl") + (("kl_forced",) if forced else ())
        of = paired_bootstrap(sub, alone, metrics=metrics)
        rf = paired_bootstrap(sub, f"{v}:overfill", metrics=metrics)
        mean = sub.groupby("policy")[list(metrics)].mean()
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
        if forced:
            row.update({"klf_S": mean.loc[alone, "kl_forced"], "klf_own": mean.loc[own, "kl_forced"],
                        "klf_OF": mean.loc[f"{v}:overfill", "kl_forced"],
                        "klf_OF_refresh": mean.loc[f"{v}:refresh", "kl_forced"]})
            for tag, base, name in (("OF_vs_S", alone, f"{v}:overfill"), ("OF_vs_own", own, f"{v}:overfill"),
                                    ("refresh", f"{v}:overfill", f"{v}:refresh")):
                d, lo, hi, mde_ = _paired(sub, base, name, "kl_forced")
                row.update({f"dklf_{tag}": d, f"dklf_{tag}_lo": lo, f"dklf_{tag}_hi": hi, f"dklf_{tag}_mde": mde_})
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
            pkv, nxt = output_cache(out), out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = lm.model(input_ids=nxt, **{cache_kwarg(lm.model): pkv}, use_cache=True)
                pkv, nxt = output_cache(out), out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / steps * 1000

    one(teacher), one(student)   # warm-up
    tt, ss = [], []
    for r in range(repeats):
        for lm, acc in ((teacher, tt), (student, ss)) if r % 2 == 0 else ((student, ss), (teacher, tt)):
            acc.append(one(lm))
    t, s = statistics.median(tt), statistics.median(ss)
    return {"teacher_ms_step": t, "student_ms_step": s, "speedup": t / s, "steps": steps, "repeats": repeats}


def curves_frame(paths: dict) -> pd.DataFrame:
    from kvlab.train.weights import read_log

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

    from kvlab.core.tiny import make_tiny_lm
    from kvlab.train.tiny import tiny_examples
    from kvlab.train.config import TRAINED_VARIANTS, TrainConfig
    from kvlab.train.trainer import train

    bad = [v for v in variants if v not in TRAINED_VARIANTS]
    if bad:
        raise ValueError(f"variants={bad}: only trained variants have curves ({', '.join(TRAINED_VARIANTS)})")
    cfg = TrainConfig(steps=steps, batch=3, lr=3e-3, warmup=1, train_prompts=14, heldout=2, eval_every=3,
                      topk=16, lora_rank=0, seed=seed, refresh_gap=(2, 5), refresh_none=0.25,
                      history=0.0)     # tiny models: short examples only (no multi-turn history set)
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
               "the generated text.",
               "`klf_*`: `kl_forced` (teacher-forced KL on the teacher's stored reference continuation; loops can't fool "
               "it): `klf_S` the student alone of `student_alone`, `klf_own` this variant's decoder alone on its own "
               "prefill (the blog's Student), `klf_OF` / `klf_OF_refresh` OverFill without / with refresh. "
               "`dklf_OF_vs_S`, `dklf_OF_vs_own`, `dklf_refresh`: paired differences (< 0 = OverFill / refresh better) "
               "with bootstrap 95 % CI and `_mde` = 2.8 × SD / √n, the smallest difference detectable at this n "
               "(80 % power, α = 0.05)."]
