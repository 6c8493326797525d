"""Running one sweep task: load (once per process) the pair, run + score, build the results row.

The run itself goes through :func:`kvlab.experiment.scored_run`, i.e. the per-run JSON store: a
sweep reuses runs the tables already stored (and the tables reuse the sweep's), with the same keys.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import time
import traceback
from dataclasses import replace

import pandas as pd

from .spec import ModelSpec, Task

# --------------------------------------------------------------------------- models


def tiny_pair(ratio: float | None = 0.3, seed: int = 0):
    """A random tiny Llama teacher and a narrower student with the same KV geometry (for tests and
    benchmarks of the sweep machinery; deterministic across processes, no files)."""
    import torch

    from ..tiny import make_tiny_lm

    ratio = 0.3 if ratio is None else ratio
    with torch.random.fork_rng(devices=[]):          # leave the caller's generator alone
        teacher = make_tiny_lm(seed=seed, intermediate_size=96)
        student = make_tiny_lm(seed=seed + 1, intermediate_size=max(8, int(round(96 * (1 - ratio)))))
    return teacher, student


def load_models(models: ModelSpec, ratio):
    """(teacher, student) for a task's model spec and student ratio."""
    if models.kind == "tiny":
        return tiny_pair(ratio)
    from ..models import DEFAULT_PRUNE, load_pair

    return load_pair(models.teacher, models.student, device=models.device, dtype=models.dtype,
                     ratio=DEFAULT_PRUNE if ratio is None else ratio)


class PairCache:
    """Pairs loaded once per process (or actor) and reused by every task that needs them."""

    def __init__(self, loader=load_models):
        self.loader = loader
        self._pairs: dict = {}

    def get(self, models: ModelSpec, ratio):
        key = (models, ratio)
        if key not in self._pairs:
            self._pairs[key] = self.loader(models, ratio)
        return self._pairs[key]

    def __len__(self) -> int:
        return len(self._pairs)


class NullStore:
    """A run store that stores nothing (every run is computed)."""

    def get(self, config):
        return None

    def get_or_run(self, config, fn):
        return fn()


def open_store(root):
    """The per-run JSON store at ``root`` (``None`` = no store)."""
    if root is None:
        return NullStore()
    from ..store import RunStore

    return RunStore(root)


# --------------------------------------------------------------------------- rows


def _provenance() -> dict:
    from .. import __version__
    from ..provenance import CODE_VERSION, git_commit, git_dirty, machine_key

    return {"kvlab_version": __version__, "code_version": CODE_VERSION, "git_commit": git_commit(),
            "git_dirty": git_dirty(), "machine_key": machine_key(), "host": platform.node()}


def _scalars(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "text" and (v is None or isinstance(v, (int, float, str, bool)))}


def max_delta(steps: dict) -> int:
    """Largest teacher prefill at one refresh step (what the methods table reports)."""
    return max((t - p for t, p, r in zip(steps["teacher_tokens"], steps["probe_tokens"], steps["refreshed"]) if r),
               default=0)


def trace_frame(res: dict) -> pd.DataFrame:
    """A stored run's per-step trace as a frame (one line per generated token)."""
    steps = res.get("steps") or {}
    n = len(steps.get("token_id", []))
    cols = {k: v for k, v in steps.items() if k != "signals" and isinstance(v, list) and len(v) == n}
    df = pd.DataFrame({"step": range(1, n + 1), **cols})
    if "signals" in steps:
        df["signals"] = [json.dumps(s) for s in steps["signals"]]
    for k in ("kl_steps", "teacher_logprobs"):
        if len(res.get(k) or []) == n:
            df[k] = res[k]
    return df


def result_columns(res: dict) -> dict:
    out = _scalars(res)
    out["text"] = res.get("text", "")
    steps = res.get("steps")
    if steps:
        out["max_delta"] = max_delta(steps)
        # cache cost of the run (eviction shrinks it): entries and bytes after each step
        for k in ("cache_len", "cache_bytes"):
            vals = [v for v in steps.get(k) or [] if v is not None]
            if vals and f"{k}_max" not in out:
                out[f"{k}_max"], out[f"{k}_mean"] = max(vals), sum(vals) / len(vals)
        if "evicted" in steps and "evicted" not in out:
            out["evicted"] = sum(int(v or 0) for v in steps["evicted"])
    return out


def execute(task: Task, pairs: PairCache, store, engine: str = "local", worker: str = "") -> tuple[dict, pd.DataFrame | None]:
    """Run one task; never raises for the task's own failure (an ``error`` row instead)."""
    from ..experiment import run_config, scored_run
    from ..store import run_key

    started = time.time()
    t0 = time.perf_counter()
    row = {**task.columns(), "engine": engine, "worker": worker or f"pid{os.getpid()}"}
    trace = None
    try:
        t_load = time.perf_counter()
        teacher, student = pairs.get(task.models, task.config.student_ratio)
        row["load_s"] = time.perf_counter() - t_load      # > 0 only for a worker's first task of a pair
        key_cfg = run_config(teacher, student, task.prompt, replace(task.decode, keep_dists=True))
        reused = store.get(key_cfg) is not None
        res = scored_run(teacher, student, task.prompt, task.decode, store)
        row.update(result_columns(res))
        row.update({"status": "ok", "error": "", "reused": reused, "run_key": run_key(key_cfg),
                    "teacher_fp": teacher.fingerprint, "student_fp": student.fingerprint,
                    "device": str(teacher.device)})
        trace = trace_frame(res)
    except Exception as e:   # noqa: BLE001 - a failing config is a result; the sweep goes on
        tb = traceback.format_exc(limit=6)
        row.update({"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]})
    row.update(_provenance())
    row.update({"wall_s": time.perf_counter() - t0, "started_at": started, "finished_at": time.time()})
    return row, trace


# --------------------------------------------------------------------------- the JSON store -> rows


def _policy_columns(section: str, d: dict | None, registry) -> tuple[dict, str]:
    if not d:
        return {section: "none"}, ""
    cls_name = d.get("policy")
    family = next((f for f, c in registry.items() if c.__name__ == cls_name), str(cls_name).lower())
    cols = {section: family, **{f"{section}_{k}": v for k, v in d.items() if k != "policy"}}
    cls = registry.get(family)
    defaults = {}
    if cls is not None:
        import dataclasses

        if dataclasses.is_dataclass(cls):
            defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    label = "_".join([family] + [f"{k}{format(v, 'g') if isinstance(v, float) else v}" for k, v in d.items()
                                 if k != "policy" and k in defaults and v != defaults[k]])
    return cols, label


def row_from_stored(key: str, data: dict) -> tuple[dict, pd.DataFrame] | None:
    """A results row for one per-run JSON store entry (``engine == "import"``), or None if it is
    not a scored decode run."""
    import hashlib

    from .families import SECTIONS

    cfg, res = data.get("config") or {}, data.get("result") or {}
    dec = cfg.get("decode")
    if cfg.get("kind") != "decode" or not isinstance(dec, dict) or "teacher_ppl" not in res:
        return None
    samp = dec.get("sampling") or {}
    ctx = (data.get("meta") or {}).get("code_version"), (data.get("meta") or {}).get("machine_key")
    row = {"row_id": f"import-{key}-" + hashlib.sha256(repr(ctx).encode()).hexdigest()[:8], "run_key": key, "sweep": "", "mode": dec.get("mode"),
           "max_new_tokens": dec.get("max_new_tokens"), "temperature": samp.get("temperature"),
           "top_p": samp.get("top_p"), "seed": samp.get("seed"),
           "prompt": cfg.get("prompt"), "prompt_id": hashlib.sha256(str(cfg.get("prompt")).encode()).hexdigest()[:12],
           "teacher_fp": cfg.get("teacher"), "student_fp": cfg.get("student")}
    m = re.search(r"-i(\d\.\d+)-", str(cfg.get("student") or ""))
    row["student_ratio"] = float(m.group(1)) if m else math.nan
    labels = []
    for name, sec in SECTIONS.items():
        cols, label = _policy_columns(name, dec.get(sec.field), sec.registry())
        row.update(cols)
        if label:
            labels.append(label)
    has_refresh = row.get("refresh", "none") != "none"
    row["refresh_next"] = dec.get("refresh_next", "rerun") if has_refresh else ""
    pol = "+".join(labels) if labels else row["mode"]
    if labels and row["mode"] != "overfill":
        pol = f"{row['mode']}+{pol}"
    if has_refresh and row["refresh_next"] != "rerun":
        pol += f"_{row['refresh_next']}"
    row["policy"] = pol
    row.update(result_columns(res))
    meta = data.get("meta") or {}
    row.update({"status": "ok", "error": "", "engine": "import", "reused": True,
                "code_version": meta.get("code_version"), "git_commit": meta.get("git_commit"),
                "git_dirty": meta.get("git_dirty"), "machine_key": meta.get("machine_key"),
                "host": (meta.get("machine") or {}).get("host"), "finished_at": 0.0})
    return row, trace_frame(res)
