"""The training Pareto (kvlab.studies.training.pareto, issue 27): points = prune shape + recipe overrides, the front, a
present point's row (short KL from the log, long KL from the log or measured, speed timed alternately), missing
points reported without loading or training anything, and the written csv / md / png. Tiny models only."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from kvlab.core.tiny import make_tiny_lm
from kvlab.train.tiny import tiny_examples
from kvlab.train.config import BASE_TRAIN, DEFAULT_TRAIN, PARETO_TRAIN
from kvlab.studies.training.pareto import parse_point, pareto_front, point_row, with_fronts


def test_points_are_a_shape_and_recipe_overrides():
    """Overrides apply to the fixed base recipe (80 steps, short prompts only), not to the default: a point names
    the same student whatever the default is; the Pareto's pick is the base with steps=160,history=0.5."""
    p = parse_point("h0.20,i0.50")
    assert p.shape.flag == "h0.20,i0.50" and p.cfg == BASE_TRAIN and p.recipe == "base"
    assert BASE_TRAIN.steps == 80 and BASE_TRAIN.history == 0.0
    assert BASE_TRAIN.replace(steps=160, history=0.5) == PARETO_TRAIN == DEFAULT_TRAIN
    assert parse_point("h0.20,i0.50:steps=160,history=0.5").cfg == PARETO_TRAIN
    assert parse_point("i0.30").shape.label == "i0.30"
    assert parse_point("h0.20,i0.50:steps=160").cfg == BASE_TRAIN.replace(steps=160)
    q = parse_point("h0.45,i0.45:lora_rank=0,lr=0.001")
    assert q.cfg == BASE_TRAIN.replace(lora_rank=0, lr=0.001) and q.shape.label == "h0.45-i0.45"
    assert q.recipe == "lora_rank=0,lr=0.001"
    assert parse_point("h0.20,i0.50:history=0.5,train-prompts=568").cfg == BASE_TRAIN.replace(history=0.5,
                                                                                            train_prompts=568)
    assert parse_point("i0.3:refresh_gap=8-32").cfg.refresh_gap == (8, 32)


@pytest.mark.parametrize("spec, match", [
    ("h0.20,i0.50:bogus=1", "--points 'h0.20,i0.50:bogus=1': 'bogus=1' must be key=value with key one of"),
    ("h0.20,i0.50:steps", "must be key=value"), ("h0.20,i0.50:steps=1.5", "steps='1.5' is not a int"),
    ("h0.20,i0.50:history=2", "--points.*--history=2.0 must be a number in"), ("h1.5,i0.5", "--points.*--prune"),
    ("", "--points"), ("h0.20,i0.50:lr=fast", "lr='fast' is not a float"),
])
def test_bad_points_name_the_flag(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_point(spec)


def test_pareto_front_keeps_the_points_nothing_beats():
    kl = [1.00, 1.20, 1.30, 0.90, float("nan"), 1.20]
    sp = [2.00, 3.00, 2.50, 1.10, 5.00, 3.00]
    # (1.30, 2.50) is beaten by (1.20, 3.00); the two (1.20, 3.00) ties do not beat each other; NaN never counts
    assert pareto_front(kl, sp) == [True, True, False, True, False, True]
    assert pareto_front([None, 1.0], [2.0, 1.0]) == [False, True]


@pytest.fixture(scope="module")
def tiny():
    teacher = make_tiny_lm(seed=0)
    return teacher, tiny_examples(teacher, 4, tokens=6)


def test_a_present_points_row_reads_the_log_and_measures_what_it_lacks(tiny):
    from kvlab.train.trainer import heldout_kl

    teacher, held_long = tiny
    student = make_tiny_lm(seed=1, intermediate_size=48)
    log = [{"step": 1, "loss": 2.0}, {"step": 2, "heldout_kl": 1.5}, {"step": 3, "heldout_kl": 1.25}]
    row = point_row(teacher, student, log, held_long, "overfill", "why", steps=2, repeats=1)
    assert row["heldout_kl"] == 1.25 and row["kl_long_from"] == "measured"
    assert row["heldout_kl_long"] == pytest.approx(heldout_kl(student, teacher, held_long, "overfill")["heldout_kl"],
                                                   abs=1e-4)
    assert row["speedup"] == pytest.approx(row["teacher_ms_step"] / row["student_ms_step"], rel=0.02)
    assert row["params_M"] == round(sum(p.numel() for p in student.model.parameters()) / 1e6, 2)
    logged = point_row(teacher, student, log + [{"step": 3, "heldout_kl": 1.2, "heldout_kl_long": 1.7}], held_long,
                       "overfill", "why", steps=2, repeats=1)
    assert (logged["heldout_kl"], logged["heldout_kl_long"], logged["kl_long_from"]) == (1.2, 1.7, "log")
    none = point_row(teacher, student, log, None, "overfill", "why", steps=2, repeats=1)
    assert none["heldout_kl_long"] is None and none["kl_long_from"].startswith("n/a")


def test_missing_points_are_reported_with_their_command_and_nothing_loads(tmp_path, monkeypatch):
    import kvlab.core.models as models
    from kvlab.studies.training.pareto import pareto_table

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))

    def boom(*a, **k):
        raise AssertionError("a model was loaded for points that are all missing")

    for name in ("load_model", "load_teacher", "teacher_path", "pruned_student_path"):
        monkeypatch.setattr(models, name, boom)
    said = []
    df = pareto_table(["i0.30", "h0.20,i0.50:steps=3,history=0.5"], log=said.append)
    assert list(df.status) == ["missing", "missing"] and not df.front.any()
    # the base recipe (80 steps, history 0) differs from the default (160 steps, history 0.5): the command says so
    assert "python -m kvlab train-student --student overfill --prune i0.30 --steps 80 --batch 4 --seed 0 " \
           "--history 0`" in said[0]
    assert df.train[1].endswith("--steps 3 --batch 4 --seed 0") and "--train" in said[1]
    assert df.heldout_set[0] == df.heldout_set[1] and df.heldout_set[0].startswith("16 (")


def test_cli_checks_points_and_student_before_anything_loads(capsys, monkeypatch, tmp_path):
    import kvlab.core.models as models
    from kvlab.cli import main

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_teacher", boom)
    assert main(["train-pareto", "--points", "i0.30:stepz=3"]) == 2
    assert "--points 'i0.30:stepz=3'" in capsys.readouterr().err
    assert main(["train-pareto", "--student", "pruned"]) == 2
    assert "--student='pruned'" in capsys.readouterr().err
    assert main(["train-pareto", "--points", "i0.30", "i0.3", "--out", str(tmp_path)]) == 2
    assert "listed twice" in capsys.readouterr().err
    assert main(["train-pareto", "--points", "i0.30", "h0.20,i0.50:steps=3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out          # both missing in an empty cache: listed, written, nothing loaded
    assert "i0.30 is not trained" in out and "missing" in (tmp_path / "train_pareto.md").read_text()


def test_the_written_table_says_what_each_column_is_and_draws_the_front(tiny, tmp_path):
    from kvlab.studies.training.pareto import write_pareto

    teacher, held_long = tiny
    rows = []
    for i, (spec, width) in enumerate((("i0.30", 64), ("h0.20,i0.50", 32), ("h0.45,i0.45:steps=160", 16))):
        student = make_tiny_lm(seed=1, intermediate_size=width)
        log = [{"step": 2, "heldout_kl": 1.0 + 0.1 * i}] + ([{"step": 2, "heldout_kl_long": 1.4}] if i == 2 else [])
        rows.append({"point": spec, "status": "cached", **point_row(teacher, student, log, held_long, "overfill", "x",
                                                                     steps=2, repeats=1)})
    rows.append({"point": "i0.10", "status": "missing", "train": "python -m kvlab train-student ..."})
    df = with_fronts(rows)
    assert not df.front[3] and df.front[0]              # the lowest KL is on the front; a missing point never
    paths = write_pareto(df, tmp_path, "python -m kvlab train-pareto --points i0.30")
    assert sorted(p.name for p in paths) == ["train_pareto.csv", "train_pareto.md", "train_pareto.png"]
    back = pd.read_csv(tmp_path / "train_pareto.csv")
    assert list(back.point) == list(df.point) and math.isnan(back.speedup[3])
    assert list(back.front) == list(df.front) and list(back.kl_long_from[:3]) == ["measured", "measured", "log"]
    md = (tmp_path / "train_pareto.md").read_text()
    assert md.startswith("# Training Pareto") and "Reproduce: `python -m kvlab train-pareto --points i0.30`" in md
    for col in ("heldout_kl", "heldout_kl_long", "kl_long_from", "speedup", "front", "heldout_set"):
        assert f"`{col}`" in md
    assert "| i0.30 |" in md and "train-student ..." not in md
    assert (tmp_path / "train_pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_speed_reads_the_forward_cache_without_the_deprecated_name(monkeypatch):
    """transformers >= 5.24 logs "`past_key_values`/`cache_params` are deprecated" (once, through its logger, so
    pytest's warning filter never sees it) when code reads ``out.past_key_values``; decode_speed reads the cache
    through kvlab.core.compat.output_cache."""
    import transformers.utils.generic as generic

    from kvlab.core.compat import output_cache
    from kvlab.studies.training.study import decode_speed

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: said.append(msg))
    teacher, student = make_tiny_lm(seed=0), make_tiny_lm(seed=1, intermediate_size=48)
    r = decode_speed(teacher, student, "a tiny prompt", steps=2, repeats=1)
    assert r["teacher_ms_step"] > 0 and r["student_ms_step"] > 0
    assert not [m for m in said if "deprecated" in m], said
    import torch
    with torch.inference_mode():
        out = teacher.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert output_cache(out) is not None and not said


def test_the_docs_table_names_the_variant_and_the_file_it_reads(tmp_path):
    """The README/docs quote of a kept Pareto run (kvlab.studies.training.quotes): the standalone student's tuning run
    is quoted from its own file and says which variant was trained; a missing file says where to keep one."""
    from kvlab.studies.training.quotes import VIEWS, pareto_table

    rows = [{"point": "h0.20,i0.50", "status": "cached", "params_M": 75.47, "heldout_kl": 1.133, "heldout_kl_long": 1.2,
             "speedup": 1.4, "front": False, "front_long": False, "student": "standalone", "device": "cpu",
             "threads": 2},
            {"point": "h0.20,i0.50:steps=160,history=0.5", "status": "cached", "params_M": 75.47, "heldout_kl": 1.071,
             "heldout_kl_long": 1.1, "speedup": 1.5, "front": True, "front_long": True, "student": "standalone",
             "device": "cpu", "threads": 2}]
    path = tmp_path / "train_pareto_standalone.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    text = pareto_table(tmp_path, str(path))
    assert "--student standalone" in text and str(path) in text
    assert "| `h0.20,i0.50:steps=160,history=0.5` | 75.5 | 1.071 |" in text and "yes / yes" in text
    missing = pareto_table(tmp_path, str(tmp_path / "none.csv"))
    assert "No measured run" in missing and "none.csv" in missing
    assert "pareto_standalone" in VIEWS and "pareto" in VIEWS
