"""The training Pareto (issue 27): held-out KL to the teacher against decode speed, for prune shapes × training
recipes. Reads trained students from the model cache (or rebuilds them from the shipped adapters); trains only
when asked (``train=True``); writes ``train_pareto.{csv,md,png}`` under ``out`` (:func:`write_pareto`).

A point is ``SHAPE[:key=value,...]``: a prune shape and overrides of the Pareto's *base* recipe
(:data:`kvlab.train.config.BASE_TRAIN`: 80 steps and short prompts only, the recipe the shapes are compared
under; fields of :class:`kvlab.train.config.TrainConfig`), e.g. ``h0.20,i0.50``, ``i0.30``, ``h0.20,i0.50:steps=160``,
``h0.20,i0.50:lora_rank=0,lr=0.001``, ``h0.20,i0.50:history=0.5``. Per present point: parameters; the held-out KL
(short, from the training log); the held-out KL on the long held-out examples (:mod:`kvlab.train.history`), from
the log when the point was trained with history examples, else measured here (the row says which); decode ms per
step of teacher and student timed alternately in one process (:func:`kvlab.studies.training.study.decode_speed`) and the
speed-up; and whether the point is on the Pareto front (lower KL, higher speed-up).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

from kvlab.train.config import BASE_TRAIN     # the recipe every point's overrides apply to (80 steps, history 0)

DEFAULT_POINTS = ("h0.20,i0.50", "i0.30", "i0.50", "h0.20,i0.30", "h0.45,i0.45", "h0.20,i0.50:steps=160",
                  "h0.20,i0.50:lora_rank=0,lr=0.001", "h0.20,i0.50:history=0.5", "h0.20,i0.50:steps=160,history=0.5")


@dataclass(frozen=True)
class Point:
    spec: str            # as given
    shape: object        # PruneShape
    cfg: object          # TrainConfig: BASE_TRAIN with the point's overrides

    @property
    def recipe(self) -> str:
        return self.spec.split(":", 1)[1] if ":" in self.spec else "base"


def parse_point(spec: str) -> Point:
    """``SHAPE[:key=value,...]`` → :class:`Point` (ValueError naming ``--points`` and the fix)."""
    from kvlab.core.prune import PruneShape

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--points: {spec!r} must look like 'h0.20,i0.50' or 'h0.20,i0.50:steps=160,history=0.5'")
    shape_s, _, over_s = spec.strip().partition(":")
    try:
        shape = PruneShape.parse(shape_s)
    except ValueError as e:
        raise ValueError(f"--points {spec!r}: {e}") from None
    types = {f.name: type(getattr(BASE_TRAIN, f.name)) for f in fields(BASE_TRAIN)}
    over = {}
    for item in filter(None, (s.strip() for s in over_s.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip().replace("-", "_")
        if not eq or k not in types:
            raise ValueError(f"--points {spec!r}: {item!r} must be key=value with key one of {', '.join(types)}")
        try:
            t = types[k]
            over[k] = tuple(int(x) for x in v.split("-")) if t is tuple else t(v.strip())
        except ValueError:
            raise ValueError(f"--points {spec!r}: {k}={v!r} is not a {types[k].__name__}") from None
    try:
        cfg = BASE_TRAIN.replace(**over)
    except ValueError as e:
        raise ValueError(f"--points {spec!r}: {e}") from None
    return Point(spec.strip(), shape, cfg)


def pareto_front(kl, speed) -> list[bool]:
    """True where no other point has KL ≤ and speed-up ≥ with one of them strict (NaN: never on the front)."""
    pts = list(zip(kl, speed))
    ok = [a == a and b == b and a is not None and b is not None for a, b in pts]
    return [ok[i] and not any(ok[j] and j != i and pts[j][0] <= pts[i][0] and pts[j][1] >= pts[i][1]
                              and (pts[j][0] < pts[i][0] or pts[j][1] > pts[i][1]) for j in range(len(pts)))
            for i in range(len(pts))]


def status(point: Point, variant: str) -> str:
    """``cached`` (model cache), ``shipped`` (rebuilt from kvlab/train/shipped) or ``missing``; loads nothing."""
    from kvlab.train.names import trained_dir
    from kvlab.train.shipped import shipped_entry

    if (trained_dir(variant, point.shape, point.cfg) / "config.json").is_file():
        return "cached"
    return "shipped" if shipped_entry(variant, point.shape, point.cfg) is not None else "missing"


def heldout_label(cfg) -> str:
    """The short held-out prompts of ``cfg``: their count and a hash of their ids (no model loads)."""
    from kvlab.train.data import load_train_prompts

    ids = [r["id"] for r in load_train_prompts(cfg.train_prompts)[cfg.train_prompts - cfg.heldout:]]
    return f"{len(ids)} ({hashlib.sha256(' '.join(ids).encode()).hexdigest()[:6]})"


def point_row(teacher, student, log: list, held_long, variant: str, prompt: str, *, steps: int = 32,
              repeats: int = 3) -> dict:
    """One present point's measures: params, held-out KL (short: last logged; long: logged, else measured on
    ``held_long`` if given), teacher / student ms per decode step timed alternately, speed-up."""
    from kvlab.studies.training.study import decode_speed
    from kvlab.train.trainer import heldout_kl

    evals = [r for r in log if "heldout_kl" in r]
    kl = evals[-1]["heldout_kl"] if evals else None
    long_logged = [r for r in log if "heldout_kl_long" in r]
    if long_logged:
        kl_long, src = long_logged[-1]["heldout_kl_long"], "log"
    elif held_long:
        kl_long, src = heldout_kl(student, teacher, held_long, variant)["heldout_kl"], "measured"
    else:
        kl_long, src = None, "n/a (no cached training data)"
    sp = decode_speed(teacher, student, prompt, steps=steps, repeats=repeats)
    return {"params_M": round(sum(p.numel() for p in student.model.parameters()) / 1e6, 2),
            "heldout_kl": None if kl is None else round(float(kl), 4),
            "heldout_kl_long": None if kl_long is None else round(float(kl_long), 4), "kl_long_from": src,
            "teacher_ms_step": round(sp["teacher_ms_step"], 3), "student_ms_step": round(sp["student_ms_step"], 3),
            "speedup": round(sp["speedup"], 3)}


def with_fronts(rows: list[dict]):
    """``rows`` as a DataFrame with ``front`` (short KL × speed-up) and ``front_long`` (long KL × speed-up)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    for col, kl in (("front", "heldout_kl"), ("front_long", "heldout_kl_long")):
        df[col] = pareto_front(list(df.get(kl, [None] * len(df))), list(df.get("speedup", [None] * len(df))))
    return df


def _long_heldout(point: Point, teacher, progress: bool):
    """The point's long held-out examples, built if its short training data is cached (None otherwise)."""
    from kvlab.train.data import _data_dir
    from kvlab.train.names import train_data_key

    if not (_data_dir(train_data_key(point.cfg)) / "examples.pt").is_file():
        return None
    from kvlab.train.history import history_data
    from kvlab.train.weights import training_data

    train_ex, held = training_data(point.cfg, teacher, progress=False)
    return history_data(point.cfg, teacher, train_ex, held, train=False, progress=progress)[1]


def pareto_table(points, variant: str = "overfill", *, train: bool = False, device=None, dtype=None, steps: int = 32,
                 repeats: int = 3, speed_prompt: str = "long", progress: bool = True, log=print):
    """One row per point (a DataFrame; see the module doc). Missing points are rows with ``status`` missing and
    the command that trains them (said through ``log`` too); with ``train`` they are trained first."""
    import torch

    from kvlab.core.data import load_prompts, prompt_set_file
    from kvlab.core.models import load_model, load_teacher
    from kvlab.train.names import train_command
    from kvlab.train.weights import read_log, trained_student_path

    points = [p if isinstance(p, Point) else parse_point(p) for p in points]
    state = {p.spec: status(p, variant) for p in points}
    missing = [p for p in points if state[p.spec] == "missing"]
    for p in missing:
        log(f"train-pareto: {p.spec} is not trained ({variant}); "
            + ("training it now" if train else f"train it with `{train_command(variant, p.shape, p.cfg)}` "
                                               "or rerun with --train"))
    if train:
        for p in missing:
            trained_student_path(variant, p.shape, p.cfg, train_if_missing=True, progress=progress, device=device)
            state[p.spec] = "trained here"
    base = [{"point": p.spec, "shape": p.shape.flag, "recipe": p.recipe, "student": variant, "status": state[p.spec],
             "heldout_set": heldout_label(p.cfg), "train": train_command(variant, p.shape, p.cfg)} for p in points]
    if all(state[p.spec] == "missing" for p in points):
        return with_fronts(base)
    teacher = load_teacher(device, dtype)
    prompt = load_prompts(prompt_set_file(speed_prompt), n=1)[0]["prompt"]
    n_t = sum(x.numel() for x in teacher.model.parameters())
    held_long = {}
    for p, row in zip(points, base):
        row["teacher_params_M"] = round(n_t / 1e6, 2)
        if state[p.spec] == "missing":
            continue
        path = trained_student_path(variant, p.shape, p.cfg)
        student = load_model(path, device=teacher.device, dtype=teacher.dtype, local_files_only=True)
        lg = read_log(path)
        hkey = (p.cfg.train_prompts, p.cfg.heldout, p.cfg.data_seed_used, p.cfg.topk, p.cfg.history_tokens)
        if not any("heldout_kl_long" in r for r in lg) and hkey not in held_long:
            held_long[hkey] = _long_heldout(p, teacher, progress)
        row.update(point_row(teacher, student, lg, held_long.get(hkey), variant, prompt, steps=steps, repeats=repeats))
        row.update({"device": str(teacher.device), "threads": torch.get_num_threads()})
        del student
    return with_fronts(base)


NOTES = [
    "`point`: prune shape[:overrides of the base recipe: kvlab.train.config.TrainConfig with 80 steps and short "
    "prompts only (history 0); `recipe` base = no overrides]. `student`: the variant (overfill: trained and scored "
    "on the teacher's prefill); `status`: cached (model cache), shipped (rebuilt from kvlab/train/shipped), trained "
    "here (--train), missing (`train` is the command that trains it).",
    "`params_M`: the student's parameters in millions (the teacher: `teacher_params_M`).",
    "`heldout_kl`: KL(p_T ‖ q) in nats per response token on the point's held-out prompts (the last `heldout` of its "
    "training prompts), teacher-forced on the teacher's responses in the variant's own forward: the training log's "
    "last evaluation (the held-out kl_forced). Lower = closer to the teacher.",
    "`heldout_kl_long`: the same on long held-out examples (multi-turn histories of training turns ending in each "
    "held-out prompt, 300-800 tokens, kvlab.train.history); `kl_long_from`: `log` = the training log's last "
    "evaluation (points trained with history > 0), `measured` = measured here on the saved (merged) student.",
    "`heldout_set`: how many held-out prompts and a hash of their ids: rows with different sets (e.g. another "
    "train_prompts) are not scored on the same prompts.",
    "`teacher_ms_step`, `student_ms_step`: median decode ms per cached step (batch 1) after prefilling the speed "
    "prompt, teacher and student timed alternately in one process; `speedup` = teacher / student (the ratio holds "
    "on a loaded machine where absolute times do not). Machine-dependent.",
    "`front` / `front_long`: on the Pareto front of (lower heldout_kl / heldout_kl_long, higher speedup) among the "
    "present points.",
]


def write_pareto(df, out, command: str, speed_prompt: str = "long") -> list:
    """``train_pareto.csv`` (data), ``train_pareto.md`` (a header saying what each column is and how to reproduce,
    then the table) and ``train_pareto.png`` (the figure, when a point has a speed-up) under ``out``."""
    from pathlib import Path

    from kvlab.harness.experiment import provenance_note, to_markdown
    from kvlab.harness.figures import render
    from kvlab.studies.training import plots  # noqa: F401  (registers its figures)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv, md = out / "train_pareto.csv", out / "train_pareto.md"
    df.to_csv(csv, index=False)
    prompt = "data/long_prompts.jsonl's first prompt" if speed_prompt == "long" else "data/prompts.jsonl's first prompt"
    head = ["# Training Pareto: held-out KL to the teacher vs decode speed-up", "",
            f"Reproduce: `{command}` (a missing point is trained first only with `--train`). Speed prompt: {prompt}.",
            "", *(f"- {n}" for n in NOTES), ""]
    md.write_text("\n".join(head) + "\n" + to_markdown(df.drop(columns=["train"], errors="ignore"))
                  + "\n- " + provenance_note() + "\n")
    paths = [csv, md]
    if "speedup" in df and df["speedup"].notna().any() and (p := render("train_pareto", out)) is not None:
        paths.append(p)
    return paths


def add_pareto_arguments(p) -> None:
    """``python -m kvlab train-pareto``'s flags (torch-free: --help stays fast)."""
    from pathlib import Path

    from kvlab.core.args import positive_int

    p.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS),
                   help="SHAPE[:key=value,...]: a prune shape and overrides of the base training recipe ("
                        "80 steps, history 0: kvlab.train.config.BASE_TRAIN; TrainConfig fields), e.g. h0.20,i0.50:steps=160 or "
                        "h0.20,i0.50:lora_rank=0,lr=0.001 or h0.20,i0.50:history=0.5 (default: %(default)s)")
    p.add_argument("--student", default="overfill", help="the trained variant at every point")
    p.add_argument("--train", action="store_true",
                   help="train the missing points first (minutes to tens of minutes each on a CPU); without it "
                        "they are listed as missing with the command that trains them")
    p.add_argument("--out", type=Path, default=Path("figures"), help="where train_pareto.{csv,md,png} go")
    p.add_argument("--tokens", type=positive_int("--tokens"), default=32, help="decode steps timed per repeat")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=3, help="alternate teacher/student timings")
    p.add_argument("--speed-prompt", choices=["long", "default"], default="long",
                   help="the prompt whose cache the decode steps run on: long = data/long_prompts.jsonl's first "
                        "(OverFill's regime; the default), or data/prompts.jsonl's first")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-progress", action="store_true")


def cmd_train_pareto(args) -> list:
    """Check every flag (no model loads), build the table, write it, print it."""
    import shlex

    from kvlab.core.models import resolve_device
    from kvlab.train.config import TRAINED_VARIANTS

    if args.student not in TRAINED_VARIANTS:
        raise ValueError(f"--student={args.student!r} must be one of {', '.join(TRAINED_VARIANTS)} (trained variants)")
    points = [parse_point(s) for s in args.points]
    if len({(p.shape, p.cfg) for p in points}) != len(points):
        raise ValueError(f"--points {' '.join(args.points)}: a point (shape and recipe) is listed twice")
    resolve_device(args.device)
    df = pareto_table(points, args.student, train=args.train, device=args.device, dtype=args.dtype,
                      steps=args.tokens, repeats=args.repeats, speed_prompt=args.speed_prompt,
                      progress=not args.no_progress)
    cmd = (f"python -m kvlab train-pareto --points {' '.join(shlex.quote(p.spec) for p in points)} --student "
           f"{args.student} --tokens {args.tokens} --repeats {args.repeats} --speed-prompt {args.speed_prompt} "
           f"--out {args.out}")
    paths = write_pareto(df, args.out, cmd, args.speed_prompt)
    print(df.drop(columns=["train"]).to_string(index=False))
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return paths
