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
# # Playground: move τ, T, k, W (and the eviction budget) and watch the run change
#
# **Explore**: every control change re-scores a run of the chosen prompt. A configuration seen before
# answers from the run store (keyed by its full config); a new one decodes live in the background,
# streaming points into the plots, and is cancelled when a control moves again.
# Readouts sit beside the *baseline*: the same prompt, mode, student, N, sampling and seed with no
# refresh and the full cache. One run is one sample (3 significant digits, no spread): set
# "prompts × seeds" above 1 for means with paired 95 % CIs vs the baseline, filled in as runs finish.
# No readout divides two separately timed runs: "teacher time" is measured inside the run, and
# "time vs baseline" times the pair back to back. "pin this run" overlays runs on the plots;
# "export PNG + CSV" saves the view. Under the plots: why each refresh fired (the policy's own words).
# teacher-PPL scores only the emitted tokens, so a τ change that alters refreshes but not the tokens
# leaves it unchanged. "precompute" runs a slider's whole range for the current prompt.
#
# **Step through**: Step / Run / Reset over one decoding: chosen token, top-5 candidates, entropy,
# cache length, whether a refresh fired, and the live map of who wrote each cache slot.
#
# **Cache inspector**: for the shown run with an eviction policy, which prompt and generated tokens each
# layer still holds after the step a slider picks: the text shaded by the share of layers keeping each
# token (hover: position, writer, score, eviction step) and the layers × positions survival map.
#
# Served as a standalone page by `make playground` (Voilà on 127.0.0.1). Logic: `kvlab.playground`.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
N = 20 if SMOKE else 96                  # new tokens per run
POLICY = "entropy"                       # initial refresh policy
TAU_PERCENTILE = 90.0                    # initial τ: this calibrated percentile of the student's entropy
CALIB_PROMPTS = 1 if SMOKE else 2        # calibration prompts (data/calibration.jsonl) for τ/κ percentiles
PRUNE_RATIO = 0.3                        # the student shown first: the untrained one pruned at this MLP ratio
PRUNE_RATIOS = (0.3,) if SMOKE else (0.2, 0.3, 0.4, 0.5)   # pruned students offered (pruned on first use)
# the "student" dropdown also offers the trained variants (kvlab.core.models.STUDENT_VARIANTS, when present):
# each loads from the model cache on first use, or the page names the command that trains it
TAU_STEP = 0.25                          # τ slider step (bits): precompute runs every position
SEED = 0

# %%
from transformers.utils import logging as hf_logging

from kvlab.core.data import calibration_file, load_prompts
from kvlab.train.pair import load_pair
from kvlab.playground import Playground, Range, Settings
from kvlab.playground.view import PlaygroundView
from kvlab.store import RunStore

hf_logging.disable_progress_bar()        # no weight-loading bars on the page
teacher, student = load_pair(ratio=PRUNE_RATIO)   # CUDA (bf16) when present, else CPU
pg = Playground(teacher, student, store=RunStore(), prune_ratios=PRUNE_RATIOS,
                settings=Settings(prompt=load_prompts()[0]["prompt"], policy=POLICY, N=N, seed=SEED, prune_ratio=PRUNE_RATIO),
                calib_prompts=[r["prompt"] for r in load_prompts(calibration_file(), n=CALIB_PROMPTS)], calib_tokens=N,
                ranges={"tau_bits": Range(0.0, 8.0, TAU_STEP)})
pg.settings = pg.settings.replace(tau_bits=pg.tau_at(TAU_PERCENTILE))   # calibrates (stored runs) first
ok = pg.start()                          # the first run + its baseline (from the store, or decoded now)

# %%
PlaygroundView(pg).widget

# %% [markdown]
# Scripted use: `pg.set(tau_bits=2.5)` changes a control exactly like the slider does (`pg.wait()`
# waits for a live run), `pg.shown.readouts` holds the numbers on screen, `pg.precompute("tau_bits")`
# fills the run store for the whole τ range, `pg.stepper()` gives the step-through object.
