"""The blog's tables and figures from results rows (``python -m kvlab figures --from-results``).
Reads result rows; writes tables and figures under ``--out``.

One big sweep (on a cluster, say) regenerates ``baselines``, ``refresh_periodic/entropy/methods``
and the Pareto figure: rows are turned into the per-run frames the table functions of
:mod:`kvlab.studies.baselines.table` and :mod:`kvlab.studies.refresh.tables` already take.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.harness.experiment import COSTS, METRICS

# A table compares runs of one setting; rows of other settings go to other tables.
SETTING = ["max_new_tokens", "temperature", "top_p", "teacher_fp", "student_fp"]
INFO_PARAMS = {"T": "refresh_T", "tau_bits": "refresh_tau_bits", "M": "refresh_M", "kappa": "refresh_kappa",
               "k": "refresh_k", "W": "refresh_W"}


def usable(rows: pd.DataFrame, where: str | None = None) -> pd.DataFrame:
    """Finished decode runs of this code version (every policy family: refresh, eviction, both),
    optionally filtered by a pandas ``query``. Error rows, other kinds of runs (forced KL, needle)
    and rows of older code versions are dropped; the store holds one row per run, so nothing needs
    de-duplicating."""
    from kvlab.store.provenance import CODE_VERSION

    if not len(rows):
        return rows
    df = rows[rows["status"] == "ok"].copy() if "status" in rows else rows.copy()
    if "kind" in df:
        df = df[df["kind"].fillna("decode") == "decode"]
    if "code_version" in df:
        df = df[df["code_version"] == CODE_VERSION]
    if where:
        try:
            df = df.query(where)
        except Exception as e:  # noqa: BLE001 - pandas raises many types for a bad expression
            raise ValueError(f"--where {where!r} is not a valid pandas query on the results columns ({e})") from None
    return df


def no_evict(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of runs without eviction (the blog's baselines and refresh tables compare those)."""
    return df[df["evict"].fillna("none") == "none"] if "evict" in df else df


def family(df: pd.DataFrame) -> pd.Series:
    """A row's policy family: its policies' families joined by ``+`` (e.g. ``periodic``, ``h2o``,
    ``periodic+sliding``), or the mode for a run without policies."""
    from kvlab.sweep.families import SECTIONS

    parts = [df[s].fillna("none").astype(str) if s in df else pd.Series("none", index=df.index) for s in SECTIONS]
    out = pd.Series("", index=df.index, dtype=object)
    for p in parts:
        out = out.where(p == "none", out.where(out == "", out + "+") + p)
    return out.where(out != "", df["mode"])


def pick_setting(df: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """The rows of the most populous setting (N, sampling, models), and that setting."""
    cols = [c for c in SETTING if c in df]
    if not len(df):
        return df, {}
    key = df[cols].astype(str).agg("|".join, axis=1)
    best = key.value_counts().index[0]
    sub = df[key == best]
    return sub, {c: (v.item() if hasattr(v, "item") else v) for c in cols for v in [sub[c].iloc[0]]}


def _pair_ids(df: pd.DataFrame) -> pd.Series:
    """Runs pair across policies when they share prompt and seed."""
    k = df["prompt_id"].astype(str) + "#" + df["seed"].astype(str)
    return pd.Series(pd.factorize(k, sort=True)[0], index=df.index)


def per_run(df: pd.DataFrame, policy: pd.Series) -> pd.DataFrame:
    out = pd.DataFrame({"policy": policy, "prompt_idx": _pair_ids(df)})
    for c in METRICS + COSTS + ["max_delta"]:
        out[c] = df[c] if c in df else np.nan
    out = out.drop_duplicates(["policy", "prompt_idx"], keep="last")
    return out.reset_index(drop=True)


def _complete(runs: pd.DataFrame) -> pd.DataFrame:
    """Only the pairs every policy ran (paired statistics need the same prompts everywhere)."""
    n_pol = runs["policy"].nunique()
    counts = runs.groupby("prompt_idx")["policy"].nunique()
    keep = counts[counts == n_pol].index
    return runs[runs["prompt_idx"].isin(keep)].reset_index(drop=True)


def baselines_from_rows(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    from kvlab.studies.baselines.table import baselines_table

    df = no_evict(df)
    base = df[df["refresh"].fillna("none") == "none"] if "refresh" in df else df
    base = base[base["mode"].isin(["teacher", "overfill", "student"])]
    if not len(base):
        return None
    runs = _complete(per_run(base, base["mode"]))
    return (baselines_table(runs), runs) if len(runs) else None


def refresh_from_rows(df: pd.DataFrame) -> dict[str, pd.DataFrame] | None:
    from kvlab.studies.refresh.tables import tables_from_runs

    df = no_evict(df)
    of = df[df["mode"] == "overfill"]
    if "refresh" not in of or not len(of):
        return None
    fam = of["refresh"].fillna("none")
    name = of["policy"].where(fam != "none", "none")
    runs = _complete(per_run(of, name))
    if "none" not in set(runs["policy"]) or runs["policy"].nunique() < 2:
        return None
    info = pd.DataFrame({"policy": name, "family": fam,
                         "refresh_next": of["refresh_next"].fillna("") if "refresh_next" in of else ""})
    for col, src in INFO_PARAMS.items():
        info[col] = of[src] if src in of else np.nan
    info["percentile"] = np.nan
    info = info.drop_duplicates("policy").reset_index(drop=True)
    info = info[info["policy"].isin(set(runs["policy"]))]
    return tables_from_runs(runs, info)


def kl_notes_for(df: pd.DataFrame) -> list[str]:
    from kvlab.harness.experiment import kl_notes

    return kl_notes(df)


def write_from_results(rows: pd.DataFrame, out, where: str | None = None) -> tuple[list[Path], str]:
    """Write ``baselines`` and ``refresh_*`` tables + their figures from results rows into ``out``,
    and ``sweep_configs`` (:func:`config_summary`: every config of every family, eviction included).
    Returns (paths, a note saying which rows were used)."""
    from kvlab.studies.baselines.table import write_baselines
    from kvlab.viz.figures import render
    from kvlab.viz.plots import baselines_figure  # noqa: F401  (registers the figures)
    from kvlab.studies.refresh.tables import write_refresh

    df = usable(rows, where)
    if not len(df):
        raise ValueError("no finished rows to build tables from (run a sweep, or drop --where)")
    df, setting = pick_setting(df)
    out = Path(out)
    paths = []
    b = baselines_from_rows(df)
    if b is not None:
        paths += write_baselines(b[0], b[1], out)
        paths.append(render("baselines", out))
    r = refresh_from_rows(df)
    if r is not None:
        paths += write_refresh(r, out)
        paths.append(render("refresh_pareto", out))
    from kvlab.harness.experiment import write_table

    summary = config_summary(df)
    paths += write_table(summary.round(6), out, "sweep_configs", notes=[
        "one line per config of every policy family (refresh, eviction, both, plain modes): means over its runs",
        "`teacher_tokens_per_token`: teacher tokens (refresh prefills + probes; teacher mode: every step) per "
        "generated token; `evicted`: cache entries evicted per run; `cache_len_*`: cache length after each step",
        "`teacher_pct`: the teacher's compute time inside a run / the rest of that run, in % (timed in one run)",
        *kl_notes_for(summary)])
    note = (f"{len(df)} rows of setting {setting}" + (f" (of {len(usable(rows, where))} usable rows; "
            "choose another with --where)" if len(usable(rows, where)) != len(df) else ""))
    return [p for p in paths if p is not None], note


# --------------------------------------------------------------------------- Pareto view of any sweep


def config_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per config (``policy`` within a setting) of every family — refresh, eviction, both,
    plain modes —: mean quality and cost (eviction: ``evicted`` entries, ``cache_len_max/mean``).

    ``teacher_tokens_per_token`` = teacher tokens per generated token beyond the prompt's prefill:
    refresh prefills + probes, or every decode step in teacher mode ((N - 1) / N);
    ``teacher_pct`` = mean in-run teacher share: the teacher's compute time inside a run / the rest of
    that same run, in % (both timed in one run, so it is a ratio measured side by side).

    No latency overhead *between* configs is computed here: rows of a sweep are timed on different
    workers, machines and moments, and a ratio of such times measures the machine, not the policy
    (so no such ratio is shown). Wall-clock overhead comes from :func:`kvlab.studies.refresh.tables.paired_timing`, which
    times each policy and its reference interleaved in one process."""
    df = usable(rows)
    if not len(df):
        return pd.DataFrame()
    keys = [c for c in ("max_new_tokens", "student", "prune", "student_ratio", "temperature", "top_p") if c in df]
    df["family"] = family(df)
    for c in ("refreshes", "teacher_tokens", "evicted"):
        df[c] = df[c].fillna(0) if c in df else 0
    g = df.groupby(keys + ["policy", "family"], sort=False, dropna=False)
    cols = ["teacher_ppl", "kl", "repeat3", "total_s", "teacher_tokens", "tokens", "refreshes", "evicted"]
    out = g[cols + [c for c in ("cache_len_max", "cache_len_mean") if c in df]].mean()
    out["kl_std"] = g["kl"].std(ddof=1)
    out["teacher_ppl_std"] = g["teacher_ppl"].std(ddof=1)
    out["teacher_pct"] = g["teacher_pct"].mean().fillna(0.0) if "teacher_pct" in df else np.nan
    out["n_runs"] = g.size()
    out = out.reset_index()
    # teacher mode: every token after the first is a teacher forward (the prompt prefill, shared by
    # teacher and OverFill runs, is not counted anywhere); other modes: refresh prefills + probes
    tt = np.where(out["family"] == "teacher", out["tokens"] - 1, out["teacher_tokens"])
    out["teacher_tokens_per_token"] = tt / out["tokens"]
    return out


def pareto_mask(cost, quality) -> np.ndarray:
    """True where no other point is at least as cheap and as good and strictly better in one (both minimised)."""
    c, q = np.asarray(cost, float), np.asarray(quality, float)
    keep = np.ones(len(c), bool)
    for i in range(len(c)):
        dominated = (c <= c[i]) & (q <= q[i]) & ((c < c[i]) | (q < q[i]))
        keep[i] = not dominated.any() and np.isfinite(c[i]) and np.isfinite(q[i])
    return keep
