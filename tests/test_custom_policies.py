"""Your own policy in one cell: an eviction policy and a refresh policy defined *here*, outside kvlab, each one
short class, registered with one call, then run through the decode loop, the matched-memory table, the
sawtooth, a local sweep and the playground without any edit to kvlab (docs/custom_policies.md).

Tiny random models (kvlab.core.tiny). Registrations are undone after each test (they would otherwise leak
into other test modules of the same session, e.g. the built-in registry's contents).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvlab
from kvlab.eviction import Keep

# ----------------------------------------------------------------------------- the user's two cells


@dataclass(frozen=True)
class Tova:
    """TOVA-like: over ``budget`` entries keep the newest one and the others that recent queries attended
    to most (the cache's EMA of attention mass, mean over layers)."""

    budget: int
    ema_decay: float = 0.5       # β of the cache's EMA: low = "what the last few queries looked at"
    needs_attention = True       # class attribute, not a field: the loop measures attention for this policy

    def __post_init__(self):
        if not isinstance(self.budget, int) or self.budget < 2:
            raise ValueError(f"budget={self.budget!r} must be an int >= 2 (cache entries)")

    def keep(self, view) -> Keep:
        n = view.length
        if n <= self.budget:
            return Keep(tuple(range(n)), budget=self.budget)
        ema = torch.stack(list(view.attn["ema"])).mean(0)[: n - 1]          # (n-1,): all but the newest
        top = torch.topk(ema, self.budget - 1).indices.sort().values.tolist()
        return Keep((*top, n - 1), budget=self.budget)


@dataclass(frozen=True)
class MarginGate:
    """Refresh when the student hesitates between its two best tokens, p(top1) - p(top2) < ``margin``,
    at most once every ``min_gap`` steps; a refresh rewrites at most ``W`` entries (None = all)."""

    margin: float = 0.1
    min_gap: int = 4
    W: int | None = None

    def __post_init__(self):
        if not 0.0 <= self.margin <= 1.0:
            raise ValueError(f"margin={self.margin!r} must be in [0, 1] (a probability gap)")

    @property
    def window(self):
        return self.W

    def should_refresh(self, record) -> bool:
        return record.margin < self.margin and record.since_refresh >= self.min_gap


@pytest.fixture
def registered():
    """Register both (what the notebook cell does), and undo it afterwards."""
    kvlab.register_eviction("tova")(Tova)
    kvlab.register_refresh("margin_gate", controls={"kappa": "margin"})(MarginGate)
    yield
    kvlab.unregister_eviction("tova")
    kvlab.unregister_refresh("margin_gate")


PROMPT = "the quick brown fox jumps over the lazy dog " * 2
N = 24


def _cfg(**kw):
    return kvlab.DecodeConfig(max_new_tokens=N, sampling=kvlab.Sampling(temperature=0.8, top_p=0.95, seed=1), **kw)


# ----------------------------------------------------------------------------- registration


def test_registration_is_one_call_and_reads_one_registry(registered):
    from kvlab.eviction import EVICTION_POLICIES
    from kvlab.playground.settings import POLICIES, POLICY_PARAMS, eviction_policies
    from kvlab.refresh.policies import REFRESH_POLICIES
    from kvlab.sweep.families import evict_registry, refresh_registry

    assert EVICTION_POLICIES["tova"] is Tova and evict_registry()["tova"] is Tova and eviction_policies()["tova"] is Tova
    assert REFRESH_POLICIES["margin_gate"] is MarginGate and refresh_registry()["margin_gate"] is MarginGate
    assert "margin_gate" in POLICIES and POLICY_PARAMS["margin_gate"] == ("W", "kappa")
    assert EVICTION_POLICIES.user() == ("tova",) and list(EVICTION_POLICIES)[-1] == "tova"   # built-ins first
    assert "h2o" in EVICTION_POLICIES and "periodic" in REFRESH_POLICIES


def test_importing_kvlab_registers_nothing_of_the_users():
    import subprocess
    import sys

    code = ("import kvlab; from kvlab.eviction import EVICTION_POLICIES as E; from kvlab.refresh.policies import "
            "REFRESH_POLICIES as R; print(E.user(), R.user(), len(E), len(R))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["()", "()", "12", "5"]


def test_the_decorator_form_and_rerunning_a_cell():
    try:
        @kvlab.register_eviction("keep_all_mine")
        @dataclass(frozen=True)
        class KeepAllMine:
            budget: int = 8

            def keep(self, view):
                return Keep(tuple(range(view.length)))

        first = KeepAllMine

        @kvlab.register_eviction("keep_all_mine")        # the cell runs again: a new class object replaces it
        @dataclass(frozen=True)
        class KeepAllMine:                                # noqa: F811
            budget: int = 8

            def keep(self, view):
                return Keep(tuple(range(view.length)))

        from kvlab.eviction import EVICTION_POLICIES

        assert EVICTION_POLICIES["keep_all_mine"] is KeepAllMine is not first
    finally:
        kvlab.unregister_eviction("keep_all_mine")


@pytest.mark.parametrize("call, says", [
    (lambda: kvlab.register_eviction("h2o", Tova), "built-in"),
    (lambda: kvlab.register_refresh("none", MarginGate), "built-in"),
    (lambda: kvlab.register_eviction("My Policy", Tova), "lower_snake_case"),
    (lambda: kvlab.register_eviction("mine", MarginGate), "keep("),
    (lambda: kvlab.register_refresh("mine", Tova), "should_refresh("),
    (lambda: kvlab.register_refresh("mine", controls={"kappa": "kapa"})(MarginGate), "names no field"),
    (lambda: kvlab.register_eviction("mine", type("H2O", (Tova,), {})), "class name 'H2O'"),
    (lambda: kvlab.register_eviction("mine", Tova(8)), "needs a class"),
])
def test_bad_registrations_say_what_to_fix(call, says):
    from kvlab.eviction import EVICTION_POLICIES
    from kvlab.refresh.policies import REFRESH_POLICIES

    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        call()
    assert EVICTION_POLICIES.user() == () and REFRESH_POLICIES.user() == ()      # nothing half-registered


# ----------------------------------------------------------------------------- the decode loop


def test_the_decode_loop_runs_both(registered, tiny_teacher, tiny_student):
    tr = kvlab.run(tiny_teacher, tiny_student, PROMPT, _cfg(mode="overfill", evict=Tova(budget=16),
                                                            refresh=MarginGate(margin=1.0, min_gap=4)))
    lens = [r.cache_len for r in tr.records]
    assert len(tr.records) == N and max(lens) == 16 and sum(r.evicted for r in tr.records) > 0
    refreshed = [r.step for r in tr.records if r.refreshed]
    assert refreshed == list(range(4, N, 4))   # margin < 1 always holds: every min_gap steps (none after the last)
    # the attention the loop measured for Tova is what it ranks: kept entries had the larger EMA
    from kvlab.eviction import EvictView

    attn = {"ema": [torch.tensor([0.5, 0.1, 0.3, 0.05, 0.2])] * 2}
    view = EvictView(step=1, length=5, positions=tuple(range(5)), record=None, vocab_size=10, num_layers=2, attn=attn)
    assert Tova(budget=3).keep(view).slots == (0, 2, 4)


def test_a_user_class_keys_its_runs_by_its_code(registered):
    from kvlab.refresh.base import policy_dict

    d = policy_dict(MarginGate(0.2))
    assert d["policy"] == "MarginGate" and d["margin"] == 0.2 and len(d["code"]) == 12
    assert "code" not in policy_dict(kvlab.Periodic(8))                 # built-ins: keys unchanged

    @dataclass(frozen=True)
    class MarginGate2(MarginGate):
        def should_refresh(self, record) -> bool:                       # an edited rule ...
            return record.margin < self.margin / 2

    MarginGate2.__name__ = "MarginGate"
    assert policy_dict(MarginGate2(0.2))["code"] != d["code"]           # ... keys a different run


# ----------------------------------------------------------------------------- matched-memory table + sawtooth


def test_the_matched_table_and_the_sawtooth_include_it(registered, tiny_teacher, tiny_student, tmp_path):
    from kvlab.studies.eviction.tables import EvictStudy, matched_runs, matched_table, sawtooth_frame, sawtooth_runs
    from kvlab.store import RunStore
    from kvlab.harness.experiment import RunSpec

    spec = RunSpec(prompts=(PROMPT, "hello world, how are you today? " * 2), tokens=40,
                   sampling=kvlab.Sampling(temperature=0.8, top_p=0.95, seed=1))
    study = EvictStudy(gamma=0.5, tight=16, loose=24, protect=4, sinks=2, block_size=4, tol=0.03, only=("tova", "sliding"))
    store = RunStore(tmp_path / "runs")
    per_run, info, pols = matched_runs(tiny_teacher, spec, store, study, progress=False)
    m = matched_table(per_run, info).set_index("policy")
    assert {"full", "confkv", "sliding", "tova"} <= set(m.index) and "h2o" not in m.index
    row = m.loc["tova"]
    assert row["matched_by"] == "solved budget" and row["params"].startswith("Tova(budget=")
    per_entry = m.loc["full", "mean_mb"] / m.loc["full", "mean_len"]
    assert abs(row["mean_mb"] - row["target_mb"]) <= max(study.tol * row["target_mb"], per_entry)   # matched
    assert row["peak_len"] <= row["knob"] and row["evict_events"] > 0 and row["kl"] > 0
    assert isinstance(pols["tova"], Tova) and pols["tova"].budget == row["knob"]

    saw = sawtooth_frame(sawtooth_runs(tiny_teacher, None, spec, store, pols, study), gamma=study.gamma)
    mine = saw[saw.policy == "tova"]
    assert len(mine) == 40 and mine.cache_len.max() == row["knob"] and mine.evicted.sum() > 0
    assert (mine.budget == row["knob"]).all()                            # Keep.budget arrives as a signal
    with pytest.raises(ValueError, match="only=.*known"):
        EvictStudy(only=("nope",)).families()


# ----------------------------------------------------------------------------- a local sweep


def test_a_local_sweep_runs_both(registered, tmp_path):
    from kvlab.store.results import load
    from kvlab.sweep import SpecError, parse_spec, run_sweep

    spec = parse_spec({"name": "mine", "prompts": {"count": 1}, "models": {"kind": "tiny"},
                       "run": {"modes": ["overfill"], "tokens": 12, "baseline": False},
                       "refresh": {"margin_gate": {"margin": [0.5, 1.0], "min_gap": 3}},
                       "evict": {"tova": {"budget": 10}}})
    rep = run_sweep(spec, store=tmp_path / "runs", progress=False)
    assert (rep.done, rep.errors) == (2, 0)
    df = load(tmp_path / "runs")
    assert set(df["refresh"]) == {"margin_gate"} and set(df["evict"]) == {"tova"}
    assert sorted(df["refresh_margin"]) == [0.5, 1.0] and (df["evict_budget"] == 10).all()
    assert (df["cache_len_max"] <= 10).all() and (df["refreshes"] > 0).all()
    assert df.loc[df["refresh_margin"] == 1.0, "refreshes"].item() == (12 - 1) // 3
    with pytest.raises(SpecError, match="refresh.margin_gate.kappa"):
        parse_spec({"prompts": {"count": 1}, "models": {"kind": "tiny"}, "refresh": {"margin_gate": {"kappa": 1}}})


# ----------------------------------------------------------------------------- the playground


def test_the_playground_offers_and_runs_both(registered, tiny_teacher, tiny_student, tmp_path):
    from kvlab.playground import Playground, Settings
    from kvlab.playground.settings import check, decode_config, eviction_policies
    from kvlab.store import RunStore

    s = Settings(prompt=PROMPT, N=N, policy="margin_gate", kappa=0.5, W=8, evict="tova", budget=16)
    assert check(s, eviction_names=tuple(eviction_policies())) == {}
    cfg = decode_config(s)
    assert cfg.refresh == MarginGate(margin=0.5, W=8) and cfg.evict == Tova(budget=16)
    assert set(check(s.replace(kappa=2.0), eviction_names=tuple(eviction_policies()))) == {"kappa"}   # the policy's own check
    assert set(check(s.replace(budget=1), eviction_names=tuple(eviction_policies()))) == {"budget"}

    pg = Playground(tiny_teacher, students={0.3: tiny_student}, store=RunStore(tmp_path / "runs"), prompts=[PROMPT],
                    calib_prompts=["calibrate me"], calib_tokens=N, background=False,
                    settings=Settings(prompt=PROMPT, N=N, policy="periodic", T=4, seed=3))
    pg.start()
    assert "tova" in pg.eviction_names
    assert pg.set(policy="margin_gate", kappa=1.0, evict="tova", budget=12), pg.errors
    pg.wait(60)
    sh = pg.shown
    assert sh.settings.policy == "margin_gate" and sh.readouts["refreshes"] > 0
    assert max(sh.result["steps"]["cache_len"]) == 12 and sh.base_readouts["refreshes"] == 0
    want = kvlab.run(tiny_teacher, tiny_student, PROMPT, decode_config(sh.settings))
    assert [r.token_id for r in want.records] == sh.result["steps"]["token_id"]       # the same run as kvlab's own
    assert "margin_gate" in sh.label and "tova@12" in sh.label

    pytest.importorskip("ipywidgets")      # the widgets offer them too, with the sliders their controls name
    from kvlab.playground.view import PlaygroundView

    v = PlaygroundView(pg)
    assert ("margin_gate", "margin_gate") in [(o[0], o[1]) for o in v.controls["policy"].options]
    assert "tova" in [o[1] if isinstance(o, tuple) else o for o in v.controls["evict"].options]
    assert v.policy_rows["kappa"].layout.display == "" and v.policy_rows["T"].layout.display == "none"
    v.controls["kappa"].value = 0.5
    pg.wait(60)
    assert pg.shown.settings.kappa == 0.5 and decode_config(pg.shown.settings).refresh == MarginGate(margin=0.5)


# ----------------------------------------------------------------------------- the docs show these classes


@pytest.mark.parametrize("cls", [Tova, MarginGate])
def test_the_docs_page_and_the_notebooks_show_exactly_these_classes(cls):
    import inspect
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "custom_policies.md").read_text()
    src = inspect.getsource(cls)
    body = src[src.index(f"class {cls.__name__}"):]
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    head = f"class {cls.__name__}:\n"
    shown = [b[b.index(head):] for b in blocks if head in b]
    assert len(shown) == 1, f"docs/custom_policies.md should show class {cls.__name__} once"
    norm = lambda t: t.replace("``", "`").strip()     # noqa: E731  (docstrings: RST ``x`` vs Markdown `x`)
    assert norm(shown[0]) == norm(body)
    assert len(body.strip().splitlines()) <= 30                    # one short cell
    nb = {"Tova": "05_cache_eviction.py", "MarginGate": "02_refresh_policies.py"}[cls.__name__]
    text = (Path(__file__).resolve().parent.parent / "notebooks" / nb).read_text()
    assert norm(body) in text.replace("``", "`"), f"notebooks/{nb}'s cell shows another {cls.__name__}"
