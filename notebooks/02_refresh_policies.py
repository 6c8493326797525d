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
# # Refresh policies on OverFill
#
# OverFill decodes with the student on a cache the teacher prefilled; the student's cache updates
# `F_S` drift from the teacher's `F_T`. A **refresh** lets the teacher prefill only the tokens it has
# not seen (Δ) on its own cache, then splices its K/V over the last `k = min(W, |Δ|)` student
# entries (seed 000, "KV Cache Refresh"). This notebook shows one entropy-gated generation, which
# cache entries come from which model over time, and the refresh tables over a prompt set.
# All logic is in `kvlab.refresh`, `kvlab.policies`, `kvlab.refresh_tables`.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
PROMPTS = 1 if SMOKE else 8           # prompts for the tables
TOKENS = 16 if SMOKE else 128         # new tokens per run (N)
CALIB_PROMPTS = 1 if SMOKE else 4     # calibration prompts for τ / κ
TRACE_TOKENS = 24 if SMOKE else 200   # the single traced generation
TIMING_REPEATS = 1 if SMOKE else 3    # side-by-side timings per prompt and policy (overhead)
SEED = 0

# %%

from IPython.display import Markdown, display

from kvlab.data import calibration_file, load_prompts
from kvlab.decode import DecodeConfig, Decoding, Sampling
from kvlab.experiment import RunSpec, to_markdown
from kvlab.models import load_pair
from kvlab.plots import plot_entropy_trace, plot_provenance, refresh_pareto_figure
from kvlab.policies import EntropyGate, Periodic
from kvlab.refresh import provenance, run_costs
from kvlab.refresh_tables import calibrate, refresh_tables, timing_note
from kvlab.store import RunStore

teacher, student = load_pair()  # CUDA (bf16) when present, else CPU
sampling = Sampling(temperature=0.7, top_p=0.9, seed=SEED)
store = RunStore()
spec = RunSpec(prompts=tuple(r["prompt"] for r in load_prompts(n=PROMPTS)), tokens=TOKENS, sampling=sampling)
calib = RunSpec(prompts=tuple(r["prompt"] for r in load_prompts(calibration_file(), n=CALIB_PROMPTS)),
                tokens=TOKENS, sampling=sampling)

# %% [markdown]
# ## Calibrating τ
# τ is a percentile of the student's next-token entropy over no-refresh OverFill runs on the
# calibration prompts (the seed suggests the 95th–97th); `tau_budget` targets ~2.5 refreshes / 1k tokens.

# %%
cal = calibrate(teacher, student, calib, store)
tau = cal.tau(95)
print(f"{len(cal.entropy)} calibration steps: τ95 = {tau:.2f} bits, τ(2.5/1k) = {cal.tau_budget():.2f} bits, "
      f"κ90 = {cal.kappa(90):.3f} nats")

# %% [markdown]
# ## One entropy-gated generation
# Each dot is a step whose entropy crossed τ: the refresh fires right after that token.

# %%
prompt = spec.prompts[0]
gate = Decoding(teacher, student, prompt, DecodeConfig(max_new_tokens=TRACE_TOKENS, sampling=sampling,
                                                       refresh=EntropyGate(tau)))
records, matrix_gate = provenance(gate)
print(run_costs(records))
plot_entropy_trace(records, tau, title=f"EntropyGate(τ={tau:.2f}) on: {prompt[:60]}…")

# %% [markdown]
# ## Where the cache entries come from
# Rows are steps, columns cache slots. The prompt is the teacher's (C₀). With `Periodic(T, W)` the
# last `min(W, T)` student entries turn teacher-green at every refresh; a window `W < T` leaves
# older student entries in place.

# %%
T = max(2, TRACE_TOKENS // 6)
per = Decoding(teacher, student, prompt, DecodeConfig(max_new_tokens=TRACE_TOKENS, sampling=sampling,
                                                      refresh=Periodic(T, W=max(1, T // 2))))
_, matrix = provenance(per)
plot_provenance(matrix, len(per.prompt_ids), title=f"Periodic(T={T}, W={max(1, T // 2)}): teacher (green) vs student (orange)")

# %%
plot_provenance(matrix_gate, len(gate.prompt_ids), title="EntropyGate: teacher (green) vs student (orange)")

# %% [markdown]
# ## The refresh tables
# Every policy runs on the same prompts with the same per-prompt seed; ΔKL is paired against no
# refresh with a bootstrap 95 % interval. Those quality columns come from the run store. The
# overhead does not: it is a ratio of times, so `refresh_timing` re-times each policy and the
# no-refresh run back to back in this kernel (same prompt and seed, fixed N, order alternating,
# repeated) and reports the median per-pair overhead with its quartiles; the `none` row times no
# refresh against itself, the noise floor.

# %%
tables = refresh_tables(teacher, student, spec, store, calib, progress=False, timing_repeats=TIMING_REPEATS)
for name in ("refresh_periodic", "refresh_entropy", "refresh_methods"):
    display(Markdown(f"### {name}\n" + to_markdown(tables[name].round(4))))
display(Markdown("### refresh_timing\n" + timing_note(tables["refresh_timing"]) + to_markdown(tables["refresh_timing"].round(3))))

# %%
refresh_pareto_figure({"refresh_all": tables["refresh_all"], "refresh_timing": tables["refresh_timing"]})

# %% [markdown]
# ## The mechanism with the tokens held fixed
# Free-running runs mix two effects: the refresh changes the cache, then the sampled path diverges.
# `kvlab.forced` fixes the tokens (the teacher's greedy continuation) and only changes who wrote the
# cache before the student reads the second half teacher-forced.

# %%
from kvlab.forced import forced_table

forced, _ = forced_table(teacher, student, spec.prompts, store, tokens=TOKENS, split=TOKENS // 2,
                         window=max(1, min(8, TOKENS // 2 - 1)))
display(Markdown(to_markdown(forced.round(4))))
