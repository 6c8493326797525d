"""``python -m kvlab bench sweep``: one small grid on three engines, side by side in one run.
Writes only into temporary run stores of its own and prints the table.

For each engine (in-process, ``--workers 2`` processes, Ray with 2 actors on a local instance):

* ``startup_s`` — engine start + loading the models in every worker (a warm-up sweep of other
  seeds; Ray also counts ``ray.init``);
* ``wall_s`` / ``tasks_per_s`` — the timed sweep on warm workers (no run store: every run computed);
* ``task_s`` — the sum of the tasks' own wall times (inside the worker), ``of_which_load_s`` the
  part spent loading models (a worker the warm-up did not reach loads them in the timed sweep);
* ``overhead_ms_per_task`` — ``(wall_s * workers - task_s) / tasks``: time a worker slot spent on
  anything but running tasks (scheduling, (de)serialising rows and traces, writing Parquet, idling
  at the end of the grid);
* for Ray also ``noop_roundtrip_ms``: one actor method call that does nothing, awaited one by one.

Ratios are against the in-process engine measured in the same run. Quality columns of the three
runs are compared row by row (same spec, same seeds).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pandas as pd

QUALITY = ["tokens", "teacher_ppl", "kl", "repeat3", "tail_logprob", "refreshes", "teacher_tokens", "text"]


def bench_grid(tokens: int = 16, prompts: int = 4, models: str = "embedded", device=None, dtype=None, seed: int = 0):
    from kvlab.sweep.spec import parse_spec

    data = {"name": "bench", "prompts": {"count": prompts}, "run": {"modes": ["overfill"], "tokens": tokens},
            "sampling": {"seed": seed}, "models": {"kind": models}, "refresh": {"periodic": {"T": [4, 8]}}}
    if device:
        data["models"]["device"] = device
    if dtype:
        data["models"]["dtype"] = dtype
    return parse_spec(data)


def _measure(engine, spec, warm, root: Path) -> dict:
    from kvlab.store.results import Results
    from kvlab.sweep.runner import run_sweep

    t0 = time.perf_counter()
    run_sweep(warm, store=Results(root / "warm"), progress=False, engine_obj=engine)
    startup = time.perf_counter() - t0
    res = Results(root / "timed")       # a fresh store: every run computed
    rep = run_sweep(spec, store=res, progress=False, engine_obj=engine)
    rows = res.load(compact=False)
    if rep.errors:
        raise RuntimeError(f"bench sweep: {rep.errors} tasks failed on {engine.name}: {rep.error_messages[:2]}")
    return {"startup_s": startup, "wall_s": rep.wall_s, "tasks": rep.done, "task_s": float(rows["wall_s"].sum()),
            "load_s": float(rows["load_s"].sum()) if "load_s" in rows else float("nan"), "rows": rows}


def bench_sweep(tokens: int = 16, prompts: int = 4, workers: int = 2, models: str = "embedded",
                device=None, dtype=None) -> str:
    import torch

    from kvlab.sweep.engines import LocalEngine, ProcessEngine, RayEngine
    from kvlab.sweep.task import PairCache

    spec = bench_grid(tokens, prompts, models, device, dtype)
    warm = bench_grid(tokens, max(1, min(prompts, workers)), models, device, dtype, seed=1000)
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvlab-bench-sweep-") as tmp:
        tmp = Path(tmp)
        eng = LocalEngine(pairs=PairCache())      # a fresh cache: model loading counts as startup
        out["local"] = _measure(eng, spec, warm, tmp / "local") | {"workers": 1}
        eng = ProcessEngine(workers, threads=1)
        try:
            out[f"processes x{workers}"] = _measure(eng, spec, warm, tmp / "proc") | {"workers": workers}
        finally:
            eng.close()
        t0 = time.perf_counter()
        eng = RayEngine(workers, None, num_cpus=workers)
        init_s = time.perf_counter() - t0
        try:
            m = _measure(eng, spec, warm, tmp / "ray")
            m["startup_s"] += init_s
            actor = eng._start()[0]
            eng.ray.get(actor.ping.remote())
            t0 = time.perf_counter()
            n = 50
            for _ in range(n):
                eng.ray.get(actor.ping.remote())
            m["noop_roundtrip_ms"] = 1000 * (time.perf_counter() - t0) / n
            out[f"ray x{workers}"] = m | {"workers": workers}
        finally:
            eng.close()
    base = out["local"]
    lines = []
    for name, m in out.items():
        tps = m["tasks"] / m["wall_s"]
        lines.append({"engine": name, "tasks": m["tasks"], "startup_s": round(m["startup_s"], 2),
                      "wall_s": round(m["wall_s"], 2), "tasks_per_s": round(tps, 3),
                      "speedup_vs_local": round(tps / (base["tasks"] / base["wall_s"]), 3),
                      "task_s": round(m["task_s"], 2), "of_which_load_s": round(m["load_s"], 2),
                      "overhead_ms_per_task": round(1000 * (m["wall_s"] * m["workers"] - m["task_s"]) / m["tasks"], 1),
                      "noop_roundtrip_ms": round(m.get("noop_roundtrip_ms", float("nan")), 2)})
    table = pd.DataFrame(lines)

    def quality(rows):
        return rows.sort_values("run_key").reset_index(drop=True)[["run_key"] + [c for c in QUALITY if c in rows]]

    q = [quality(m["rows"]) for m in out.values()]
    diffs = []
    for name, x in zip(list(out)[1:], q[1:]):
        for c in x.columns:
            a, b = q[0][c], x[c]
            if len(a) != len(b) or not (a == b).all():
                num = pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b)
                d = f"max |diff| {float((a - b).abs().max()):.3g}" if num else f"{int((a != b).sum())} rows differ"
                diffs.append(f"{name}: {c} ({d})")
    same = "yes" if not diffs else "NO — " + "; ".join(diffs)
    ray_over = table.iloc[2]["overhead_ms_per_task"] - table.iloc[0]["overhead_ms_per_task"]
    head = (f"bench sweep: overfill, periodic T in {{4, 8}} + no refresh, {prompts} prompts x {tokens} tokens "
            f"= {spec and len(spec.tasks())} tasks, models={models}, torch threads/worker="
            f"{torch.get_num_threads()} (local) / 1 (workers), cpu_count={os.cpu_count()}")
    tail = (f"ratios (same run): processes x{workers} / local tasks/s = {table.iloc[1]['speedup_vs_local']:.2f}; "
            f"ray x{workers} / local = {table.iloc[2]['speedup_vs_local']:.2f}; ray / processes = "
            f"{table.iloc[2]['tasks_per_s'] / table.iloc[1]['tasks_per_s']:.2f}; Ray scheduling overhead per task "
            f"{ray_over:+.1f} ms vs in-process (no-op actor round trip {table.iloc[2]['noop_roundtrip_ms']:.2f} ms)\n"
            f"identical quality rows from all engines: {same}")
    return "\n".join([head, table.to_string(index=False), tail])
