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
# # 03 · Uncertainty traces and Monte-Carlo dropout
#
# The entropy gate refreshes the cache when the student is unsure. But entropy mixes two kinds
# of uncertainty: **aleatoric** (the next token is genuinely ambiguous — "a car or a …") and
# **epistemic** (the student's internal state has drifted from what the teacher would compute).
# Only the second calls for a refresh. The *Future Work* section of the blog *KV-Cache Refresh
# Methods for Long Generation* (Emara, Kim & Abdelfattah 2025; code:
# [friendshipkim/overfill](https://github.com/friendshipkim/overfill)) proposes MC dropout: run the
# student N times with random dropout masks and measure how much the passes disagree,
#
# $$U(t) = \frac{1}{D_{vocab}} \sum_{j=1}^{D_{vocab}} \mathrm{Var}\big(\{z_{i,j}\}_{i=1}^N\big).$$
#
# Part 1 reproduces the blog's simulation exactly. Part 2 does it for real on the embedded
# student: dropout injected at inference, N passes as one batch on the shared prefix cache,
# and asks whether $U(t)$, mutual information or the argmax-flip rate track anything.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
# the embedded student: pruned (untrained) | standalone | overfill | refresh-aware; the trained ones must be
# trained once first (`python -m kvlab train-student`, ~10 min per variant); smoke runs use the untrained one
STUDENT = "pruned" if SMOKE else "overfill"
N_PROMPTS = 2 if SMOKE else 8          # prompts for the real traces
N_TOKENS = 12 if SMOKE else 64         # tokens per trace
N_PASSES = 4 if SMOKE else 8           # MC passes per step
P_DROP = 0.1                           # dropout probability on every attention / MLP output
CALIB_PROMPTS = 2 if SMOKE else 8      # prompts of data/calibration.jsonl for the gate threshold
CALIB_TOKENS = 12 if SMOKE else 32
PERCENTILE = 70                        # the blog's MC-variance percentile
PROBE_EVERY = 4 if SMOKE else 16       # the gate's probe interval M
REFRACTORY = 8 if SMOKE else 32        # the gate's refractory gap

# %%
from IPython.display import Markdown, display

from kvlab.viz import readings

display(Markdown(readings.smoke_banner(SMOKE)))

# %% [markdown]
# ## Part 1 — the blog's simulation
# Four phases: confident, epistemic drift (passes disagree *and* the distribution is flat),
# post-refresh confident, aleatoric ambiguity (flat distribution, passes agree). Both gates probe
# at a fixed interval with a refractory gap; thresholds are percentiles of each signal. The
# blog's settings (`mcsim.SimConfig` defaults) are printed with the result.

# %%
from kvlab.studies.mc import sim as mcsim

sim = mcsim.simulate()
cfg = sim.config
display(Markdown(f"{cfg.T} steps, {cfg.N} simulated passes over a {cfg.D}-word vocabulary; the gates probe every "
                 f"{cfg.probe_M} steps with a {cfg.refractory}-step refractory gap; thresholds: the "
                 f"{cfg.entropy_pct:g}th (entropy) and {cfg.mcvar_pct:g}th (MC variance) percentiles."))
print(mcsim.format_summary(sim))

# %%
mcsim.plot_triggers(sim)

# %%
phase_of = dict(zip(sim.time_series["t"], sim.time_series["phase"]))


def fires_by_phase(fires):
    return ", ".join(f"{t} ({mcsim.PHASE_LABELS[phase_of[t]]})" for t in fires) or "none"


outside = (sim.time_series["phase"] != "drift").mean()
in_drift = [t for t in sim.fires_mcvar if phase_of[t] == "drift"]
display(Markdown(
    f"Entropy cannot tell the phases apart: drift and ambiguity are both flat. Its fires: "
    f"{fires_by_phase(sim.fires_entropy)}. MC variance fires at {fires_by_phase(sim.fires_mcvar)}: "
    f"{len(in_drift)} of its {len(sim.fires_mcvar)} fires fall in the epistemic drift, where a refresh can help. "
    f"A fire outside the drift is an artefact of the percentile threshold: {outside:.0%} of the steps lie outside "
    f"the drift, so the {sim.config.mcvar_pct:g}th percentile puts τ among their variances and noise crosses it."))

# %%
from kvlab.harness.tableview import show

display(show(sim.phase_summary.reset_index(), {"phase": "phase", "steps": "steps", "mean entropy (bits)": "mean_entropy",
                                               "mean MC variance U(t)": "mean_mcvar", "entropy gate fired (share)": "frac_entropy_fire",
                                               "MC gate fired (share)": "frac_mcvar_fire"}, digits=4))
display(Markdown(readings.read_phase_summary(sim.phase_summary)))

# %% [markdown]
# ## Part 2 — real MC dropout on the student
# The embedded student (SmolLM2-135M with part of its MLP channels pruned; the share is printed
# below) was not trained with dropout, so `kvlab.uncertainty.mc.mc_dropout` *injects* it: forward hooks multiply every decoder layer's
# attention and MLP output by an inverted-dropout mask, independently per batch row, and come
# off on exit (also on error). At a decode step the clean forward drives decoding;
# `KVCache.probe_last` re-runs the same step as one batch of N on `expand`-ed views of the prefix
# cache and throws the N noisy entries away, so the decoding cache is bit-identical afterwards.
#
# Per step we record the student's entropy (clean pass) and three MC signals:
# * `u` — the blog's $U(t)$ (population variance across passes, i.e. numpy's `Z.var(axis=0)`),
# * `mi` — mutual information (BALD): $H(\bar p) - \frac1N\sum_i H(p_i)$, nats,
# * `flip` — the fraction of noisy passes whose argmax differs from the clean pass's.

# %%
from kvlab.studies.mc import real as mc_real
from kvlab.uncertainty import mc
from kvlab.core.data import load_prompts
from kvlab.train.pair import load_pair

teacher, student = load_pair(variant=STUDENT)
pruned = 1 - student.config.intermediate_size / teacher.config.intermediate_size
print(f"student: {pruned:.0%} of the MLP channels pruned "
      f"({teacher.config.intermediate_size} → {student.config.intermediate_size} per layer)")
prompts = [r["prompt"] for r in load_prompts(n=N_PROMPTS)]
traces, corr = mc_real.correlation_study(teacher, student, prompts, ps=(P_DROP,), tokens=N_TOKENS, n_passes=N_PASSES)
corr.round(3)

# %% [markdown]
# `r_*` are Pearson correlations with the student's entropy over all probed steps (greedy
# OverFill decodes here; step 1 comes from the teacher's prefill and is not probed). The reading
# below is computed from this run's table; `make figures` measures the same correlations with
# sampled decoding at three dropout rates (`figures/mc_real_correlations.md`, `mc_real.png`).

# %%
c = corr.iloc[0]
vocab = student.model.get_output_embeddings().weight.shape[0]


def strength(r):
    return "essentially uncorrelated with" if abs(r) < 0.2 else ("weakly tied to" if abs(r) < 0.4 else "tracks")


display(Markdown(
    f"Over {int(c.steps)} probed steps ({len(prompts)} prompts × {N_TOKENS} tokens, N = {N_PASSES}, p = {P_DROP}): "
    f"r_U = {c.r_u:+.2f}, r_MI = {c.r_mi:+.2f}, r_flip = {c.r_flip:+.2f}. "
    f"**The blog's U(t) is {strength(c.r_u)} the student's entropy; MI is {strength(c.r_mi)} it and the flip rate "
    f"{strength(c.r_flip)} it.** A plausible reason for U (not tested here): it averages the variance of all "
    f"{vocab:,} logits, so the tail that dropout shakes whatever the head of the distribution looks like weighs "
    f"as much as the head. MI and the flip rate look at probabilities and the argmax. A signal that *only* "
    f"tracked entropy would add nothing over the entropy gate, so this is a warning, not a verdict."))

# %%
first = traces[traces["prompt"] == 0]
first[["step", "token", "entropy", "u", "mi", "flip"]].head(12).round(3)

# %% [markdown]
# ## The MCGate
# `MCGate` is a refresh policy of the refresh loop (notebook 02): `probe = "mc"`, every
# `probe_every` steps the loop runs the MC probe (N extra student passes, counted in the run's
# cost), and the gate fires when the chosen signal exceeds its threshold at least `refractory`
# steps after the last refresh. The threshold is calibrated as a percentile of the signal over
# decodes of the calibration prompts (`data/calibration.jsonl`), like the blog's 70th percentile
# (`MCGate.calibrated(...)` does it for one signal; here one calibration run serves all three).

# %%
from kvlab.core.data import calibration_file

calib = [r["prompt"] for r in load_prompts(calibration_file(), n=CALIB_PROMPTS)]
taus = mc.calibration_thresholds(teacher, student, percentile=PERCENTILE, prompts=calib, tokens=CALIB_TOKENS,
                                 n_passes=N_PASSES, p=P_DROP)
gates = {sig: mc.MCGate(threshold=tau, signal=sig, probe_every=PROBE_EVERY, refractory=REFRACTORY,
                        n_passes=N_PASSES, dropout_p=P_DROP)
         for sig, tau in taus.items()}
gates

# %% [markdown]
# Replaying the gates over the stored traces (the counterfactual in which a fire does not change
# the rest of the decode) gives the steps where each would refresh, and the extra student
# passes it costs: N per probe step.

# %%
import pandas as pd

rows = []
for i, df in traces.groupby("prompt"):
    for sig, g in gates.items():
        fired = mc_real.replay_gate(g, df)
        probes = int((df["step"] % g.probe_every == 0).sum())
        rows.append({"prompt": i, "signal": sig, "fires": fired, "probes": probes,
                     "extra_student_passes": probes * g.n_passes, "decode_passes": len(df)})
firings = pd.DataFrame(rows)
display(firings)
display(Markdown(readings.read_firings(firings)))

# %%
fires0 = {sig: mc_real.replay_gate(g, first) for sig, g in gates.items()}
mc_real.plot_real_trace(first, fires0, title=f"prompt 0: entropy vs U vs MI vs flip (p={P_DROP}, N={N_PASSES}); "
                                       "dashed = gate fires")

# %%
display(Markdown(readings.read_mc_trace(first, fires0)))

# %% [markdown]
# **Reading.** Compare the correlations measured above with the simulation: there $U(t)$ separates
# epistemic drift from aleatoric ambiguity by construction; on a real student it is only useful if
# it moves with where the student is unsure (the `r_u` column; `make figures` measures it at three
# dropout rates in `figures/mc_real_correlations.md`). Whether a signal fires *where refreshing helps* (lower KL to the teacher afterwards) is a
# question for the refresh loop: with `PROBES["mc"]` wired in, `MCGate` can be compared with the
# entropy gate at equal cost (its N extra student passes per probe are counted).
