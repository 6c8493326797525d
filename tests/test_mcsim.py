"""Tests for kvlab.studies.mc.sim: the blog's MC-dropout simulation, reproduced exactly."""
import io
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # allow running from any cwd
    sys.path.insert(0, str(_ROOT))

from kvlab.studies.mc import sim as mcsim  # noqa: E402
from kvlab.studies.mc.sim import SimConfig, count_triggers, contiguous_spans, phase, simulate  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return simulate(SimConfig())


# ------------------------------------------------------------------ the blog's printed numbers

EXPECTED_SUMMARY = {  # phase: steps, mean_entropy, mean_mcvar, frac_entropy_fire, frac_mcvar_fire
    "alea": (100, 8.5172, 0.0001, 0.01, 0.01),
    "conf": (150, 0.0096, 0.0001, 0.00, 0.00),
    "drift": (100, 8.1466, 0.0028, 0.00, 0.03),
    "post": (50, 0.0096, 0.0001, 0.00, 0.00),
}


def test_phase_summary_matches_blog(result):
    s = result.phase_summary
    assert list(s.index) == ["alea", "conf", "drift", "post"]
    assert s.index.name == "phase"
    assert list(s.columns) == list(mcsim.SUMMARY_COLUMNS)
    for ph, (steps, h, u, fe, fu) in EXPECTED_SUMMARY.items():
        row = s.loc[ph]
        assert int(row["steps"]) == steps
        assert round(row["mean_entropy"], 4) == h
        assert round(row["mean_mcvar"], 4) == u
        assert round(row["frac_entropy_fire"], 2) == fe
        assert round(row["frac_mcvar_fire"], 2) == fu


def test_thresholds_and_fires_match_blog(result):
    assert round(result.tau_entropy, 4) == 8.5172
    assert f"{result.tau_mcvar:.6f}" == "0.000096"
    assert result.fires_entropy == [320]
    assert result.fires_mcvar == [112, 144, 176, 336]
    ts = result.time_series
    assert list(ts["t"][ts["entropy_fire"] == 1]) == [320]
    assert list(ts["t"][ts["mcvar_fire"] == 1]) == [112, 144, 176, 336]


def test_format_summary(result):
    text = mcsim.format_summary(result)
    assert "tau_entropy=8.5172 nats, tau_mcvar=0.000096" in text
    assert "Entropy fires at: [320]" in text
    assert "MC-variance fires at: [112, 144, 176, 336]" in text


# ------------------------------------------------------------------ helpers

def test_phase_boundaries_including_t200_quirk():
    assert [phase(t) for t in (0, 99, 100, 199)] == ["conf", "conf", "drift", "drift"]
    assert phase(200) == "conf"  # seed's else-branch quirk
    assert [phase(t) for t in (201, 250, 251, 350, 351, 399)] == ["post", "post", "alea", "alea", "conf", "conf"]


def test_count_triggers_probe_and_refractory():
    s = np.ones(100)
    assert count_triggers(s, 0.5, M=16, refractory=32) == [0, 32, 64, 96]
    assert count_triggers(s, 0.5) == [0, 16, 32, 48, 64, 80, 96]  # seed defaults M=16, refractory=16
    assert count_triggers(s, 1.0, M=16, refractory=0) == []       # strictly greater than tau


def test_contiguous_spans():
    assert contiguous_spans(["a", "a", "b", "a"]) == [("a", 0, 1), ("b", 2, 2), ("a", 3, 3)]
    assert contiguous_spans([]) == []
    labels = [phase(t) for t in range(400)]
    assert contiguous_spans(labels) == [
        ("conf", 0, 99), ("drift", 100, 199), ("conf", 200, 200),
        ("post", 201, 250), ("alea", 251, 350), ("conf", 351, 399)]


# ------------------------------------------------------------------ config

def test_config_hashable_and_accepts_mappings():
    cfg = SimConfig()
    assert hash(cfg) == hash(SimConfig())
    as_dicts = SimConfig(sig_between=dict(conf=0.05, drift=1.5, post=0.05, alea=0.10),
                         alpha={"conf": 1.0, "drift": 1.0, "post": 1.0, "alea": 1 / 2.5})
    assert as_dicts == cfg and hash(as_dicts) == hash(cfg)
    assert cfg.phase_params("alea") == (0.4, 0.10, 0.01)
    assert cfg.phase_params("drift") == (1.0, 1.5, 0.05)


@pytest.mark.parametrize("kwargs, name", [
    ({"N": 1}, "N"),
    ({"D": 1}, "D"),
    ({"T": 0}, "T"),
    ({"probe_M": 0}, "probe_M"),
    ({"refractory": -1}, "refractory"),
    ({"entropy_pct": 0}, "entropy_pct"),
    ({"entropy_pct": 100}, "entropy_pct"),
    ({"mcvar_pct": 150}, "mcvar_pct"),
    ({"m_high": float("nan")}, "m_high"),
    ({"sig_between": {"conf": 0.1}}, "sig_between"),
    ({"sig_within": dict(conf=0.01, drift=-0.05, post=0.01, alea=0.01)}, "sig_within"),
    ({"alpha": dict(conf=1.0, drift=1.0, post=1.0, alea=0.0)}, "alpha"),
])
def test_bad_parameters_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SimConfig(**kwargs)


def test_small_config_runs():
    r = simulate(SimConfig(D=50, N=2, T=30, probe_M=4, refractory=4))
    assert len(r.time_series) == 30 and int(r.phase_summary["steps"].sum()) == 30


# ------------------------------------------------------------------ plots and outputs

def _hlines(ax):
    return [ln for ln in ax.lines if len(set(np.asarray(ln.get_ydata(), float))) == 1]


@pytest.mark.parametrize("fn, title, tau_attr", [
    (mcsim.plot_entropy, "Student Entropy over Time (simulated)", "tau_entropy"),
    (mcsim.plot_mcvar, "MC-Variance over Time (simulated)", "tau_mcvar"),
])
def test_single_plots(result, fn, title, tau_attr):
    from matplotlib.figure import Figure
    fig = fn(result)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title() == title
    assert any(np.isclose(ln.get_ydata()[0], getattr(result, tau_attr)) for ln in _hlines(ax))
    assert len(ax.collections) == 1 and len(ax.patches) >= 6  # fire markers, phase spans
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    for phase in ("confident", "epistemic drift", "post-refresh", "aleatoric"):   # the shading is explained
        assert any(phase in t for t in legend), legend
    fig.savefig(io.BytesIO(), format="png")  # renders headless


def test_trigger_plot(result):
    from matplotlib.figure import Figure
    fig = mcsim.plot_triggers(result)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert "Refresh triggers" in fig._suptitle.get_text()
    for ax, tau, fires in zip(fig.axes, (result.tau_entropy, result.tau_mcvar),
                              (result.fires_entropy, result.fires_mcvar)):
        assert any(np.isclose(ln.get_ydata()[0], tau) for ln in _hlines(ax))
        assert len(ax.collections[0].get_offsets()) == len(fires)
        assert any("aleatoric" in t.get_text() for t in ax.get_legend().get_texts())
    fig.savefig(io.BytesIO(), format="png")


def test_write_outputs(result, tmp_path):
    info = mcsim.write_outputs(result, tmp_path / "out")
    assert json.loads(json.dumps(info)) == {
        "tau_entropy": result.tau_entropy, "tau_mcvar": result.tau_mcvar,
        "fires_entropy": [320], "fires_mcvar": [112, 144, 176, 336]}
    ts = pd.read_csv(tmp_path / "out" / "mc_time_series.csv")
    assert list(ts.columns) == list(mcsim.TIME_SERIES_COLUMNS) and len(ts) == 400
    summ = pd.read_csv(tmp_path / "out" / "mc_phase_summary.csv")
    assert list(summ.columns) == ["phase", *mcsim.SUMMARY_COLUMNS]
    assert list(summ["phase"]) == ["alea", "conf", "drift", "post"]


# ------------------------------------------------------------------ verbatim seed reference

def _seed_reference():
    """Verbatim copy of the seed's simulation loop (numpy only, no plotting)."""
    SEED = 0; D = 5000; N = 16; T = 400  # noqa: E702
    m_high, m_mid = 8.0, 3.0
    sig_between = dict(conf=0.05, drift=1.5, post=0.05, alea=0.10)
    sig_within = dict(conf=0.01, drift=0.05, post=0.01, alea=0.01)
    alpha = dict(conf=1.0, drift=1.0, post=1.0, alea=1/2.5)
    rng = np.random.default_rng(SEED)

    def phase(t):
        if   0   <= t < 100: return 'conf'   # noqa: E271,E701
        elif 100 <= t < 200: return 'drift'  # noqa: E701
        elif 200 <  t <=250: return 'post'   # noqa: E222,E225,E701
        elif 250 <  t <=350: return 'alea'   # noqa: E222,E225,E701
        else: return 'conf'                  # noqa: E701

    def base_logits(ph):
        mu = np.full(D, -m_high if ph in ('conf','post') else -m_mid)
        if ph == 'alea':
            mu[:] = 0.0
            top = rng.choice(D, 2, replace=False)
            mu[top] = [0.2, 0.18]
        else:
            c = rng.integers(D)
            mu[c] = m_high if ph in ('conf','post') else m_mid
        return mu

    def softmax(x):
        x = x - x.max()
        ex = np.exp(x)
        return ex / ex.sum()

    U = rng.normal(size=(N, D))
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    H = np.zeros(T)
    Uvar = np.zeros(T)
    phases = []
    for t in range(T):
        ph = phase(t)
        phases.append(ph)
        mu = base_logits(ph) * alpha[ph]
        Z = []
        for i in range(N):
            z_i = (mu
                   + sig_between[ph] * U[i]
                   + sig_within[ph]  * rng.normal(size=D))  # noqa: E221
            Z.append(z_i)
        Z = np.stack(Z)
        P = np.apply_along_axis(softmax, 1, Z)
        pbar = P.mean(0)
        H[t] = -(pbar * np.log(pbar + 1e-9)).sum()
        Uvar[t] = Z.var(axis=0).mean()
    return H, Uvar, phases


def test_matches_verbatim_seed_reference(result):
    H, Uvar, phases = _seed_reference()
    ts = result.time_series
    assert list(ts["phase"]) == phases
    assert np.allclose(ts["entropy"].to_numpy(), H, rtol=0, atol=1e-12)
    assert np.allclose(ts["mc_var"].to_numpy(), Uvar, rtol=0, atol=1e-12)
    assert result.tau_entropy == pytest.approx(float(np.percentile(H, 90)), abs=1e-12)
    assert result.tau_mcvar == pytest.approx(float(np.percentile(Uvar, 70)), abs=1e-15)
