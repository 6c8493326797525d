# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sweeps: a grid of policies, one results table, a Pareto front
#
# A sweep runs every config of a grid (modes × policy families × their values × N × sampling …)
# over a prompt set and writes one row per finished (config, prompt, seed) into a Parquet results
# table. It resumes (a rerun skips finished rows), records failing configs as error rows, and runs
# in this process, in worker processes (`workers=2`) or on Ray (`engine="ray"`) — the same rows
# either way. Logic: `kvlab.sweep` (spec, engines, runner, tables) and `kvlab.store.results`.
# The same grid runs from a shell: `python -m kvlab sweep examples/sweep_refresh.toml`.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
PROMPTS = 1 if SMOKE else 4          # prompts per config
TOKENS = 12 if SMOKE else 96         # new tokens per run (N)
PERIODS = [4, 8] if SMOKE else [8, 16, 32]
TAUS = [4.0] if SMOKE else [3.0, 4.0, 5.0, 6.0]
STUDENT = "pruned" if SMOKE else "overfill"   # student variant(s) (smoke: the untrained one, never trains)
ENGINE = "local"                     # "local" or "ray"
WORKERS = None                       # local: processes (None = in this process); ray: actors
RESULTS = None                       # run store root (None: $KVLAB_RUNS, else the project's runs/)

# %%
# %matplotlib inline
import tomllib

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from kvlab.viz import readings
from kvlab.viz.plots import place_labels
from kvlab.store.results import Results
from kvlab.sweep import parse_spec, run_sweep
from kvlab.sweep.tables import config_summary, pareto_mask
from kvlab.harness.tableview import show

display(Markdown(readings.smoke_banner(SMOKE)))

# %% [markdown]
# ## The grid
# A TOML spec (the same text works as a file). Refresh policies apply to OverFill; `baseline = true`
# adds each mode's run without a policy, which is what the costs are measured against.

# %%
GRID = f"""
name = "nb-refresh"
[prompts]
count = {PROMPTS}
[run]
modes = ["teacher", "student", "overfill"]
tokens = {TOKENS}
student = "{STUDENT}"                  # a list sweeps it; prune = "h0.20,i0.50" sets the shape
[sampling]
temperature = 0.7
top_p = 0.9
seed = 0
[refresh.periodic]
T = {PERIODS}
[refresh.entropy]
tau_bits = {TAUS}
[refresh.speculative]
k = {PERIODS[0]}
"""
spec = parse_spec(tomllib.loads(GRID))           # every key, value and prompt checked before any work
print(f"{len(spec.configs())} configs × {len(spec.prompts)} prompts = {len(spec.tasks())} tasks")
print(", ".join(c.policy for c in spec.configs()))

# %% [markdown]
# ## Run it
# Rows are written as tasks finish; interrupt the cell and run it again to resume.

# %%
results = Results(RESULTS)
report = run_sweep(spec, engine=ENGINE, workers=WORKERS, results=results)
print(report)

# %% [markdown]
# ## The results table
# One row per (config, prompt, seed): config columns, metrics, costs, model fingerprints, code
# version and commit, engine, host, wall time. Per-step traces are loaded on demand.

# %%
rows = results.load(sweep=spec.name)            # every run tagged with this sweep, whoever computed it
print(rows.shape, "errors:", int((rows["status"] != "ok").sum()))
show(rows.head(12), {"config": "policy", "prompt": "prompt_id", "seed": "seed", "teacher-PPL ↓": "teacher_ppl",
                     "KL(p_T‖q) ↓": "kl", "repeat@3 ↓": "repeat3", "refreshes": "refreshes",
                     "teacher tokens": "teacher_tokens", "run time (s)": "total_s", "engine": "engine",
                     "commit": "git_commit"})   # every column: rows

# %%
one = rows[(rows["refresh"] == "entropy") & (rows["status"] == "ok")].iloc[0]
trace = results.trace(one["run_key"])
trace[["step", "token_id", "entropy_bits", "source", "refreshed", "teacher_tokens", "kl_steps"]].head(8)

# %% [markdown]
# ## Quality vs cost: the Pareto front
# Per config: mean KL(p_T‖q) and teacher-PPL against two costs — teacher tokens per generated token
# (refresh prefills + probes) and the in-run teacher share (teacher compute time / the rest of the same
# run, both timed inside one run; latency ratios *between* sweep rows would compare machines and
# moments, not policies — `python -m kvlab refresh` times policies side by side for that). Circled
# points are Pareto-optimal (no other config is both cheaper and better).

# %%
summary = config_summary(rows)
colors = {"teacher": "#1b9e77", "student": "#d95f02", "overfill": "#7570b3", "periodic": "#66a61e",
          "entropy": "#e7298a", "speculative": "#e6ab02", "probe_kl": "#a6761d", "mc": "#666666"}
fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
for ax, (x, xlabel), (y, ylabel) in zip(axes, [("teacher_tokens_per_token", "teacher tokens per generated token"),
                                               ("teacher_pct", "in-run teacher time % of the run")],
                                        [("kl", "KL(p_T‖q) nats ↓"), ("teacher_ppl", "teacher-PPL ↓")]):
    pts = summary[summary["policy"] != "teacher"] if x == "teacher_pct" else summary
    for fam, g in pts.groupby("family", sort=False):
        ax.scatter(g[x], g[y], color=colors.get(fam, "gray"), label=fam, s=36, zorder=3)
    front = pts[pareto_mask(pts[x], pts[y])].sort_values(x)
    ax.plot(front[x], front[y], color="k", lw=1, ls="--", zorder=2, label="Pareto front")
    ax.scatter(front[x], front[y], s=140, facecolors="none", edgecolors="k", zorder=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(linestyle=":", linewidth=0.6)
    ax.margins(0.15)
axes[0].legend(fontsize=8)
fig.suptitle(f"{spec.name}: {readings.plural(len(spec.prompts), 'prompt')} × {TOKENS} tokens, means over prompts")
fig.tight_layout()
for ax, (x, y) in zip(axes, [("teacher_tokens_per_token", "kl"), ("teacher_pct", "teacher_ppl")]):
    pts = summary[summary["policy"] != "teacher"] if x == "teacher_pct" else summary
    px = ax.transData.transform(pts[[x, y]].to_numpy(dtype=float))
    for (vx, vy), lab, off in zip(pts[[x, y]].to_numpy(), pts["policy"], place_labels(ax, px, list(pts["policy"]), 7, fig.dpi)):
        ax.annotate(lab, (vx, vy), xytext=off, textcoords="offset points", fontsize=7, va="bottom",
                    ha="right" if off[0] < 0 else ("center" if off[0] == 0 else "left"),
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if abs(off[0]) > 8 or abs(off[1]) > 15 else None)
display(fig)
plt.close(fig)
display(Markdown(readings.read_pareto(summary, "teacher_tokens_per_token", "kl",
                                      pareto_mask(summary["teacher_tokens_per_token"], summary["kl"]))))

# %%
show(summary, {"config": "policy", "family": "family", "KL(p_T‖q) ↓": ("kl", "kl_std"), "teacher-PPL ↓": "teacher_ppl",
               "repeat@3 ↓": "repeat3", "refreshes": "refreshes", "teacher tokens / token": "teacher_tokens_per_token",
               "in-run teacher time %": "teacher_pct", "runs": "n_runs"})   # every column: summary

# %% [markdown]
# ## The blog's tables from the same rows
# `python -m kvlab figures --from-results` does this for the whole results table.

# %%
from kvlab.sweep.tables import refresh_from_rows, usable

tables = refresh_from_rows(usable(rows))
periodic = tables["refresh_periodic"]
display(show(periodic, {"policy": "policy", "T": "T", "teacher-PPL ↓": "teacher_ppl", "KL(p_T‖q) ↓": "kl",
                        "ΔKL vs none (95 % CI)": ("d_kl", "d_kl_lo", "d_kl_hi"), "refreshes": "refreshes",
                        "teacher tokens": "teacher_tokens", "prompts": "n_prompts"}))
display(Markdown(readings.read_periodic(periodic)))
