"""``train-study`` (a step of ``python -m kvlab all``): the variants compared, the speed ratio, the curves.
Writes the study's runs into the run store and its tables and figure under ``--out``.
"""
from __future__ import annotations

from pathlib import Path


def train_study(args, T: int = 27) -> list[Path]:
    """Tables ``train_study`` / ``train_speed`` / ``train_curves`` and the ``train_curves`` figure in ``args.out``."""
    import pandas as pd

    from kvlab.harness.args import run_spec as _spec
    from kvlab.harness.experiment import write_table
    from kvlab.harness.figures import render
    from kvlab.studies.training import plots  # noqa: F401  (registers its figures)
    from kvlab.core.models import load_teacher
    from kvlab.train.pair import load_student
    from kvlab.store import RunStore
    from kvlab.train.command import student_choice, train_choice
    from kvlab.studies.training.study import STUDY_NOTES, VARIANTS, curves_frame, decode_speed, study_runs, study_table
    from kvlab.train.weights import trained_dir

    spec = _spec(args)
    variant, shape = student_choice(args)
    if variant is None:
        print("train-study: skipped (--student is a model folder/hub id)", flush=True)
        return []
    progress = not args.no_progress
    teacher = load_teacher(args.device, args.dtype)
    cfg = train_choice(args)
    students = {v: load_student(v, shape, args.device, args.dtype, train_if_missing=True, train=cfg) for v in VARIANTS}
    per_run = study_runs(teacher, students, spec, RunStore(args.runs), T, progress)
    table = study_table(per_run, students, T)
    out = Path(args.out)
    # the long-prompt set's tables carry the suffix _long (python -m kvlab train-study --prompt-set long)
    sfx = "_long" if getattr(args, "prompt_set", "default") == "long" and getattr(args, "prompts_file", None) is None else ""
    paths = write_table(table.round(4), out, f"train_study{sfx}", notes=STUDY_NOTES)
    paths += write_table(per_run.drop(columns=[c for c in ("ttft_s", "tps", "total_s", "e2e_tps") if c in per_run]),
                         out, f"train_study{sfx}_runs", notes=STUDY_NOTES)
    speed = decode_speed(teacher, students["overfill"], spec.prompts[0])
    speed_df = pd.DataFrame([{"shape": shape.label, **{k: round(v, 3) if isinstance(v, float) else v
                                                       for k, v in speed.items()}}])
    paths += write_table(speed_df, out, "train_speed_timing",
                         notes=["Decode ms per cached step (batch 1), teacher and student timed alternately in one "
                                "process after a warm-up; median over repeats. Machine-dependent (untracked)."])
    curves = curves_frame({v: trained_dir(v, shape, cfg) for v in VARIANTS[1:]})
    if len(curves):
        paths += write_table(curves.round(5), out, "train_curves", notes=["Training logs of the cached students."])
        if (p := render("train_curves", out)) is not None:
            paths.append(p)
    print((out / f"train_study{sfx}.md").read_text() + "\n" + (out / "train_speed_timing.md").read_text())
    return paths
