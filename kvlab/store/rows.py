"""A stored run as one flat row and one per-step trace frame (what :mod:`kvlab.store.results` writes).

A run is ``(config, result, meta)``: ``config`` is what keys it (:func:`kvlab.harness.experiment.run_config`:
models' fingerprints, prompt, decode settings; other kinds — forced KL, needle — have their own
``kind``), ``result`` is what :func:`kvlab.harness.experiment.scored_run` returns, ``meta`` is the provenance
of the process that computed it (:func:`kvlab.store.provenance.stamp`). Everything here is a pure function
of those three, so a run made by a table, a sweep worker or the playground gives the same row.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import pandas as pd


def max_delta(steps: dict) -> int:
    """Largest teacher prefill at one refresh step (what the methods table reports)."""
    return max((t - p for t, p, r in zip(steps["teacher_tokens"], steps["probe_tokens"], steps["refreshed"]) if r),
               default=0)


def trace_frame(res: dict) -> pd.DataFrame:
    """A run's per-step trace as a frame (one line per generated token; empty for non-decode runs)."""
    steps = res.get("steps") or {}
    n = len(steps.get("token_id", []))
    cols = {k: v for k, v in steps.items() if k != "signals" and isinstance(v, list) and len(v) == n}
    df = pd.DataFrame({"step": range(1, n + 1), **cols})
    if "signals" in steps:
        df["signals"] = [json.dumps(s) for s in steps["signals"]]
    for k in ("kl_steps", "teacher_logprobs"):
        if isinstance(res.get(k), list) and len(res[k]) == n:
            df[k] = res[k]
    return df


def _scalar(v) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def result_columns(res: dict) -> dict:
    """The result's scalars plus derived costs (largest refresh prefill, cache length/bytes, evictions)."""
    out = {k: v for k, v in res.items() if k != "text" and _scalar(v)}
    out["text"] = res.get("text", "")
    steps = res.get("steps")
    if steps and all(k in steps for k in ("teacher_tokens", "probe_tokens", "refreshed")):
        out["max_delta"] = max_delta(steps)
    if steps:
        for k in ("cache_len", "cache_bytes"):      # cache cost of the run (eviction shrinks it)
            vals = [v for v in steps.get(k) or [] if v is not None]
            if vals and f"{k}_max" not in out:
                out[f"{k}_max"], out[f"{k}_mean"] = max(vals), sum(vals) / len(vals)
        if "evicted" in steps and "evicted" not in out:
            out["evicted"] = sum(int(v or 0) for v in steps["evicted"])
    return out


def _registry_defaults(cls) -> dict:
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def _policy_columns(section: str, d: dict | None, registry) -> tuple[dict, str]:
    """``<section>`` (family), ``<section>_<param>`` columns and the label (family + non-default params)."""
    if not d:
        return {section: "none"}, ""
    cls_name = d.get("policy")
    family = next((f for f, c in registry.items() if c.__name__ == cls_name), str(cls_name).lower())
    cols = {section: family, **{f"{section}_{k}": v for k, v in d.items() if k != "policy"}}
    defaults = _registry_defaults(registry.get(family))
    label = "_".join([family] + [f"{k}{format(v, 'g') if isinstance(v, float) else v}" for k, v in d.items()
                                 if k != "policy" and k in defaults and v != defaults[k]])
    return cols, label


def policy_label(mode: str, labels: list[str], refresh_next: str, has_refresh: bool) -> str:
    """The config's short name: the mode alone without policies, else the policies' labels."""
    if not labels:
        return mode
    name = "+".join(labels)
    if mode != "overfill":
        name = f"{mode}+{name}"
    if has_refresh and refresh_next != "rerun":
        name += f"_{refresh_next}"
    return name


def prompt_id(prompt) -> str:
    return hashlib.sha256(str(prompt).encode()).hexdigest()[:12]


def config_columns(config: dict) -> dict:
    """Flat columns of a run's config. Decode runs: mode, N, sampling, policy family/params, a
    ``policy`` label, prompt (+ its id), fingerprints; other kinds: their scalar entries."""
    kind = config.get("kind")
    dec = config.get("decode")
    if kind != "decode" or not isinstance(dec, dict):
        out = {"kind": kind}
        for k, v in config.items():
            if k != "kind":
                out[k if k not in ("teacher", "student") else f"{k}_fp"] = v if _scalar(v) else json.dumps(v, default=str)
        if "prompt" in config:
            out["prompt_id"] = prompt_id(config["prompt"])
        return out
    from kvlab.core.registry import SECTIONS

    samp = dec.get("sampling") or {}
    row = {"kind": "decode", "mode": dec.get("mode"), "max_new_tokens": dec.get("max_new_tokens"),
           "temperature": samp.get("temperature"), "top_p": samp.get("top_p"), "seed": samp.get("seed"),
           "prompt": config.get("prompt"), "prompt_id": prompt_id(config.get("prompt")),
           "teacher_fp": config.get("teacher"), "student_fp": config.get("student")}
    m = re.search(r"-i(\d\.\d+)-", str(config.get("student") or ""))
    row["student_ratio"] = float(m.group(1)) if m else math.nan
    from kvlab.core.students import student_of_name

    row["student"], row["prune"] = student_of_name(config.get("student")) or (None, None)   # which student made it
    labels = []
    for name, sec in SECTIONS.items():
        cols, label = _policy_columns(name, dec.get(sec.field), sec.registry())
        row.update(cols)
        if label:
            labels.append(label)
    has_refresh = row.get("refresh", "none") != "none"
    row["refresh_next"] = dec.get("refresh_next", "rerun") if has_refresh else ""
    row["policy"] = policy_label(row["mode"], labels, row["refresh_next"], has_refresh)
    for k, v in config.items():          # extra keys a caller added to the config (e.g. a probe setting)
        if k not in ("kind", "teacher", "student", "prompt", "decode") and k not in row:
            row[k] = v if _scalar(v) else json.dumps(v, default=str)
    return row


def meta_columns(meta: dict) -> dict:
    """Provenance columns of the process that computed the run."""
    m = meta.get("machine") or {}
    return {"code_version": meta.get("code_version"), "git_commit": meta.get("git_commit"),
            "git_dirty": meta.get("git_dirty"), "machine_key": meta.get("machine_key"), "host": m.get("host"),
            "gpu": m.get("gpu")}


def build_row(key: str, config: dict, result: dict, meta: dict, extra: dict | None = None) -> dict:
    """The results row of one run (``status`` ``ok``); ``extra``: how it ran (engine, worker, wall_s, …)."""
    row = {"run_key": key, **config_columns(config), **result_columns(result), **meta_columns(meta)}
    for k, v in (extra or {}).items():      # never overrides what the run itself says, only fills gaps
        have = row.get(k)
        if have is None or (isinstance(have, float) and math.isnan(have)):
            row[k] = v
    row.update(status="ok", error="")
    return row
