"""``python -m kvlab train-seeds``: OverFill against both student baselines with training randomness in the interval
(issue 37, item 5). Trains (or finds cached) one OverFill student and one standalone student per training seed,
runs the baselines' rows on them through the run store, and writes ``train_seeds`` (+ ``_seeds``, ``_runs``;
``train_seeds_refresh_aware`` with ``--student refresh-aware``, ``_long`` with ``--prompt-set long``).

Per training seed ``s`` (0 is the shipped student): the recipe with ``seed=s`` and ``data_seed`` (default 0: every
seed distils from seed 0's teacher responses, so the seeds differ in LoRA init, batch order, history coins and
refresh points only; ``own``: each seed also draws its own data). On the same prompts with the same per-prompt
sampling seeds it runs the baselines' rows (:data:`kvlab.studies.baselines.table.POLICIES`):

* ``overfill``   — the teacher prefills, seed ``s``'s OverFill decoder decodes;
* ``student``    — the same decoder alone on its own prefill (the blog's Student);
* ``standalone`` — seed ``s``'s separately trained student alone (the paper's equal-budget baseline);

and scores each with ``kl_forced`` (teacher-forced on the teacher's stored reference, steps 2..N for every row,
:mod:`kvlab.harness.forced`). The table's two rows, ``overfill − standalone`` and ``overfill − student``, are the mean
paired difference over seeds × prompts with the hierarchical bootstrap of :mod:`kvlab.harness.hierarchical`.
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from kvlab.harness.experiment import paired_bootstrap, run_policies, write_table
from kvlab.harness.hierarchical import hierarchical_bootstrap, paired_matrix, prompt_only

METRIC = "kl_forced"
ROWS = ("overfill", "student", "standalone")
COMPARISONS = (("overfill − standalone", "overfill", "standalone"), ("overfill − student", "overfill", "student"))
COLUMNS = ["comparison", "decoder_variant", "metric", "n_seeds", "n_prompts", "d", "lo", "hi", "se", "mde", "sd_seeds",
           "prompt_only_lo", "prompt_only_hi", "seeds", "data_seed", "recipe", "tokens", "design"]
SEED_COLUMNS = ["train_seed", "comparison", "d", "lo", "hi", "mde", "kl_forced_overfill", "kl_forced_base",
                "n_prompts", "decoder", "base_model"]


def seed_config(recipe, seed: int, data_seed):
    """The recipe of training seed ``seed``: ``data_seed`` an int (the distillation data of that seed, fixed) or
    None (each seed its own data). ``seed == data_seed`` is the one-seed config itself (the shipped student)."""
    return recipe.replace(seed=seed, data_seed=data_seed)


def randomness_text(data_seed) -> str:
    """What the training seeds vary, for the table's notes."""
    if data_seed is None:
        return ("training randomness = the distillation data (each seed's own teacher samples and histories) and "
                "LoRA init, batch order, history coins and refresh points")
    return (f"training randomness = LoRA init, batch order, history coins and refresh points; the distillation "
            f"data fixed (the teacher responses and histories of data seed {data_seed})")


def seed_runs(teacher, decoder, alone, spec, store, progress: bool = True) -> pd.DataFrame:
    """The baselines' ``overfill`` / ``student`` rows with ``decoder`` and the ``standalone`` row with ``alone``, per
    prompt, with the teacher-forced columns (``kl_forced`` over steps 2..N in every row)."""
    from kvlab.harness.forced import forced_columns
    from kvlab.studies.baselines.table import POLICIES

    own = {k: POLICIES[k] for k in ("overfill", "student")}
    solo = {"standalone": POLICIES["standalone"]}
    runs = pd.concat([run_policies(teacher, decoder, spec, own, store, progress),
                      run_policies(teacher, alone, spec, solo, store, progress)], ignore_index=True)
    models = {"overfill": decoder, "student": decoder, "standalone": alone}
    forced = forced_columns(teacher, models, spec, {**own, **solo}, store, progress=False)
    runs = runs.merge(forced, on=["policy", "prompt_idx"], how="left")
    runs["model"] = runs.policy.map({k: m.name for k, m in models.items()})
    return runs


def seed_study(teacher, students_for, spec, store, seeds, progress: bool = True, say=print) -> pd.DataFrame:
    """Per-run rows of every training seed in ``seeds`` (column ``train_seed``). ``students_for(seed)`` returns
    ``(decoder, alone)``: that seed's OverFill decoder and standalone student (loaded, trained if missing)."""
    frames = []
    for k, s in enumerate(seeds):
        t0 = time.perf_counter()
        say(f"[{time.strftime('%H:%M:%S')}] train-seeds: seed {s} ({k + 1}/{len(seeds)}): students", flush=True)
        decoder, alone = students_for(s)
        t1 = time.perf_counter()
        runs = seed_runs(teacher, decoder, alone, spec, store, progress)
        runs.insert(0, "train_seed", s)
        frames.append(runs)
        say(f"[{time.strftime('%H:%M:%S')}] train-seeds: seed {s} done (students {t1 - t0:.0f} s, runs "
            f"{time.perf_counter() - t1:.0f} s)", flush=True)
        del decoder, alone
    return pd.concat(frames, ignore_index=True)


def seeds_table(per_run: pd.DataFrame, metric: str = METRIC, n_boot: int = 2000, boot_seed: int = 0,
                design: str = "crossed") -> pd.DataFrame:
    """The two comparisons (:data:`COMPARISONS`): mean paired difference ``overfill − base`` of ``metric`` over
    seeds × prompts, its hierarchical bootstrap 95 % interval (``lo``, ``hi``), SE, MDE, the SD of the per-seed
    differences, and the prompt-only interval of the same mean (seeds held fixed) beside it."""
    rows = []
    for label, name, base in COMPARISONS:
        seeds, d = paired_matrix(per_run, name, base, metric)
        h = hierarchical_bootstrap(d, n_boot=n_boot, seed=boot_seed, design=design)
        plo, phi = prompt_only(d, n_boot=n_boot, seed=boot_seed)
        rows.append({"comparison": label, "metric": metric, "n_seeds": h.n_seeds, "n_prompts": h.n_prompts,
                     "d": h.d, "lo": h.lo, "hi": h.hi, "se": h.se, "mde": h.mde, "sd_seeds": h.sd_seeds,
                     "prompt_only_lo": plo, "prompt_only_hi": phi, "seeds": " ".join(map(str, seeds)),
                     "design": h.design})
    return pd.DataFrame(rows)


def by_seed_table(per_run: pd.DataFrame, metric: str = METRIC) -> pd.DataFrame:
    """One row per (training seed, comparison): the prompt-bootstrap difference within that seed (``lo``/``hi``
    NaN under 5 prompts, as every paired table), its MDE, both rows' mean ``metric`` and the models' names."""
    from kvlab.core.metrics import add_mde

    rows = []
    for s, g in per_run.groupby("train_seed", sort=True):
        for label, name, base in COMPARISONS:
            sub = g[g.policy.isin([name, base])]
            pb = add_mde(paired_bootstrap(sub, base, metrics=(metric,)), sub, base, (metric,)).set_index("policy")
            r = pb.loc[name]
            mean = sub.groupby("policy")[metric].mean()
            names = sub.groupby("policy").model.first()
            rows.append({"train_seed": s, "comparison": label, "d": r[f"d_{metric}"], "lo": r[f"d_{metric}_lo"],
                         "hi": r[f"d_{metric}_hi"], "mde": r[f"d_{metric}_mde"],
                         f"{metric}_overfill": mean[name], f"{metric}_base": mean[base],
                         "n_prompts": int(sub.prompt_idx.nunique()), "decoder": names[name], "base_model": names[base]})
    return pd.DataFrame(rows)


def recipe_text(recipe) -> str:
    """The recipe in words, saying whether it is the shipped default."""
    from kvlab.train.config import DEFAULT_TRAIN, RECIPES

    base = recipe.replace(seed=0, data_seed=None)
    name = next((k for k, v in RECIPES.items() if v == base), None)
    words = f"{recipe.steps} steps, batch {recipe.batch}, lr {recipe.lr:g}, LoRA r {recipe.lora_rank}, history {recipe.history:g}"
    if base == DEFAULT_TRAIN:
        return f"the default recipe (DEFAULT_TRAIN: {words}), the shipped students' recipe"
    if name is not None:
        return f"the {name} recipe ({words})"
    kind = "a reduced recipe" if recipe.steps < DEFAULT_TRAIN.steps else "a non-default recipe"
    return f"{kind} ({words}; the default DEFAULT_TRAIN has {DEFAULT_TRAIN.steps} steps)"


def table_notes(recipe, data_seed, tokens: int, command: str) -> list[str]:
    from kvlab.harness.forced import FORCED_SCORE_NOTE

    return [
        "`d` = mean over training seeds × prompts of (OverFill − baseline) `kl_forced`, per prompt paired on the same "
        "prompt, sampling seed and reference; **negative = OverFill better** (the opposite sign of the baselines "
        "table's `d_*`, which is baseline − OverFill). `overfill − standalone`: against a separately trained student "
        "of the same seed (the paper's equal-budget baseline); `overfill − student`: against the same decoder alone "
        "on its own prefill (the blog's Student).",
        "`lo`, `hi`: hierarchical bootstrap 95 % interval (kvlab.harness.hierarchical; 2,000 replicates that draw "
        "the training seeds with replacement, then the prompts with replacement, one prompt draw shared by the drawn "
        "seeds because every seed ran the same prompts: `design` crossed); `se`: the replicates' SD; `mde` = 2.8 × "
        "se; `sd_seeds`: SD of the per-seed differences; `prompt_only_lo/hi`: the interval with the seeds held "
        "fixed (prompts resampled only), for comparison. With 3 seeds the seed part of the interval is itself "
        "uncertain (the bootstrap's seed variance is (S − 1)/S of the sample variance): read it as a lower bound "
        "on how much training randomness moves `d`.",
        f"{randomness_text(data_seed)}. Recipe: {recipe_text(recipe)}; {tokens} new tokens per run.",
        FORCED_SCORE_NOTE,
        f"Command: `{command}`.",
    ]


def write_seed_tables(per_run: pd.DataFrame, out: Path, recipe, data_seed, tokens: int, command: str,
                      name: str = "train_seeds", variant: str = "overfill") -> list[Path]:
    """``<name>`` (the two comparisons), ``<name>_seeds`` (per training seed) and ``<name>_runs`` (per run, quality
    columns only: the machine-dependent times are left out, as in the baselines' runs table)."""
    from kvlab.studies.baselines.table import TIME_RUN_COLUMNS

    table = seeds_table(per_run)
    table["decoder_variant"] = variant          # the OverFill decoder's training (overfill or refresh-aware)
    table["data_seed"] = "own" if data_seed is None else data_seed
    table["recipe"] = recipe_text(recipe).split(" (")[0]
    table["tokens"] = tokens
    notes = table_notes(recipe, data_seed, tokens, command)
    paths = write_table(table[COLUMNS], out, name, notes=notes)
    paths += write_table(by_seed_table(per_run), out, f"{name}_seeds",
                         notes=["Per training seed: `d` = OverFill − baseline `kl_forced` over the prompts, prompt "
                                "bootstrap 95 % interval within the seed (no interval under 5 prompts), `mde` = 2.8 × "
                                "SD / √n; `decoder` / `base_model`: the students of that seed (model cache names)."])
    runs = per_run.drop(columns=[c for c in TIME_RUN_COLUMNS if c in per_run])
    paths += write_table(runs, out, f"{name}_runs", notes=["One row per (training seed, row, prompt)."])
    return paths


def cmd_train_seeds(args) -> list[Path]:
    """The command: checks every flag before any model loads, says what it will train, runs, writes."""
    from kvlab.harness.args import run_spec
    from kvlab.store import RunStore

    variant, shape, recipe, seeds = check_seed_args(args)
    spec = run_spec(args)              # validates prompts / sampling / model flags before any model loads
    teacher, students_for = embedded_models(args, variant, shape, recipe, seeds)
    per_run = seed_study(teacher, students_for, spec, RunStore(args.runs), seeds, progress=not args.no_progress)
    from kvlab.harness.cli_common import set_suffix

    name = "train_seeds" + ("" if variant == "overfill" else "_" + variant.replace("-", "_")) + set_suffix(args)
    paths = write_seed_tables(per_run, args.out, recipe, args.data_seed, spec.tokens, seeds_command(args), name=name,
                              variant=variant)
    print((Path(args.out) / f"{name}.md").read_text(), flush=True)
    return paths


def check_seed_args(args):
    """``(variant, shape, recipe, seeds)`` from the flags (ValueError naming the flag), no model loaded."""
    from kvlab.train.command import student_choice, train_choice

    if getattr(args, "teacher", None) is not None:
        raise ValueError("--teacher: train-seeds trains its students on the embedded teacher; leave --teacher out")
    if isinstance(args.seeds, bool) or not isinstance(args.seeds, int) or args.seeds < 2:
        raise ValueError(f"--seeds={args.seeds!r} must be an integer ≥ 2 (training seeds 0..N−1; seed 0 is the shipped "
                         "student): one seed has no training randomness to put in an interval")
    variant, shape = student_choice(args)
    if variant not in ("overfill", "refresh-aware"):
        raise ValueError(f"--student={args.student!r}: train-seeds compares an OverFill-trained decoder (overfill or "
                         "refresh-aware) with the standalone student")
    if getattr(args, "rebuild_student_cache", False):
        raise ValueError("--rebuild-student-cache: the trained students share the teacher's KV geometry; leave it out")
    recipe = train_choice(args)
    seed_config(recipe, 0, args.data_seed)      # --data-seed checked by TrainConfig (ValueError naming it)
    return variant, shape, recipe, list(range(args.seeds))


def embedded_models(args, variant, shape, recipe, seeds):
    """(teacher, students_for): the embedded teacher and a loader of seed ``s``'s (decoder, standalone) students,
    cached, else rebuilt from the shipped adapters, else trained (said up front, per seed)."""
    from kvlab.core import models
    from kvlab.core.models import resolve_device
    from kvlab.train.pair import load_student
    from kvlab.train.plan import announce

    for s in seeds:
        announce([variant, "standalone"], shape, seed_config(recipe, s, args.data_seed), resolve_device(args.device))
    teacher = models.load_teacher(args.device, args.dtype)

    def students_for(s):
        cfg = seed_config(recipe, s, args.data_seed)
        kw = dict(device=args.device, dtype=args.dtype, train_if_missing=True, progress=not args.no_progress, train=cfg)
        return load_student(variant, shape, **kw), load_student("standalone", shape, **kw)

    return teacher, students_for


def seeds_command(args) -> str:
    """The command line that makes this table (for its notes)."""
    parts = ["python -m kvlab train-seeds", f"--seeds {args.seeds}", f"--prompts {args.prompts}",
             f"--tokens {args.tokens}", f"--data-seed {'own' if args.data_seed is None else args.data_seed}"]
    if getattr(args, "train_recipe", "default") not in (None, "default"):
        parts.append(f"--train-recipe {args.train_recipe}")
    if getattr(args, "train_steps", None) is not None:
        parts.append(f"--train-steps {args.train_steps}")
    if getattr(args, "student", None) not in (None, "overfill"):
        parts.append(f"--student {args.student}")
    if getattr(args, "prune", None) is not None:
        parts.append(f"--prune {args.prune}")
    if getattr(args, "prompt_set", "default") != "default":
        parts.append(f"--prompt-set {args.prompt_set}")
    return " ".join(parts)
