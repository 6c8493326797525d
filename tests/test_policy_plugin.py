"""Adding an eviction policy is one file (issue 35): a policy file dropped into ``kvlab/eviction/`` (here: into a
copy of the package) or named in ``KVLAB_PLUGINS`` (a module outside kvlab) is found by the registry on its first
read, with no other edit, and shows up in ``python -m kvlab evict --policy NAME``, a sweep's ``[evict.NAME]``
section and the playground's eviction menu; the matched-memory study runs it on the tiny models.

Also pins what the studies build: the ``policy_dict`` (run key) of policies each study builds through the one
registry path (the full dump of every study's policies was compared before and after the move).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

POLICY_FILE = '''"""Keep the newest half of the budget and every other older entry (a toy policy in one file)."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.registry import register_eviction
from kvlab.eviction.base import Keep, keep_all


@register_eviction("{name}")
@dataclass(frozen=True)
class {cls}:
    budget: int

    def __post_init__(self):
        if not isinstance(self.budget, int) or self.budget < 2:
            raise ValueError(f"budget={{self.budget!r}} must be an int >= 2 (cache entries)")

    def keep(self, view) -> Keep:
        n = view.length
        if n <= self.budget:
            return keep_all(view, budget=self.budget)
        recent = self.budget // 2
        older = list(range(0, n - recent, 2))[-(self.budget - recent):]
        return Keep(tuple(older) + tuple(range(n - recent, n)), budget=self.budget)
'''

CHECK = r'''
import json, sys
name = sys.argv[1]
from kvlab.eviction import EVICTION_POLICIES
from kvlab.cli import build_parser
from kvlab.sweep import parse_spec
from kvlab.playground.settings import Settings, eviction_policies, eviction_policy
from kvlab.studies.eviction.tables import EvictStudy
from kvlab.decode.keys import policy_dict

args = build_parser().parse_args(["evict", "--policy", f"h2o,{name}"])
spec = parse_spec({"prompts": {"count": 1}, "models": {"kind": "tiny"}, "evict": {name: {"budget": [8, 12]}}})
fams = EvictStudy(only=(name,)).families()
make, lo, hi = fams[name]
print(json.dumps({"registered": name in EVICTION_POLICIES, "builtin": name in EVICTION_POLICIES.builtin(),
                  "cli": list(args.policy), "sweep": sorted(c.policy for c in spec.configs() if any(c.choices)), "menu": name in eviction_policies(),
                  "playground": policy_dict(eviction_policy(Settings(prompt="p", evict=name, budget=16))),
                  "study": [lo, hi, policy_dict(make(10))]}))
'''


def _check(env, name: str, cwd: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHECK, name], capture_output=True, text=True, env=env, timeout=300,
                       cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_policy_file_in_kvlab_eviction_needs_no_other_edit(tmp_path):
    """A copy of the package (the Python files) with one new file in kvlab/eviction/: a built-in everywhere."""
    shutil.copytree(ROOT / "kvlab", tmp_path / "kvlab", ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    (tmp_path / "data").symlink_to(ROOT / "data")                  # the prompts a sweep spec reads
    (tmp_path / "kvlab" / "eviction" / "every_other.py").write_text(POLICY_FILE.format(name="every_other",
                                                                                       cls="EveryOther"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("KVLAB_PLUGINS", None)
    got = _check(env, "every_other", tmp_path)
    assert got["registered"] and got["builtin"] and got["menu"]
    assert got["cli"] == ["h2o", "every_other"] and got["sweep"] == sorted(["every_other_budget12", "every_other_budget8"])
    assert got["playground"] == {"policy": "EveryOther", "budget": 16}
    assert got["study"] == [2, 4096, {"policy": "EveryOther", "budget": 10}]


def test_a_plugin_module_outside_kvlab_is_found_through_KVLAB_PLUGINS(tmp_path):
    (tmp_path / "my_policies.py").write_text(POLICY_FILE.format(name="every_other", cls="EveryOther"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "KVLAB_PLUGINS": "my_policies",
           "OMP_NUM_THREADS": "1"}
    got = _check(env, "every_other", tmp_path)
    assert got["registered"] and not got["builtin"] and got["menu"]       # the user's: no built-in name reserved
    assert got["cli"] == ["h2o", "every_other"] and got["sweep"] == sorted(["every_other_budget12", "every_other_budget8"])
    assert got["playground"]["policy"] == "EveryOther" and "code" in got["playground"]   # keyed by its code too
    r = subprocess.run([sys.executable, "-m", "kvlab", "evict", "--policy", "nope", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "every_other" in r.stderr          # the error lists it among the choices
    assert not (tmp_path / "o").exists()


def test_the_study_runs_a_one_file_policy_on_the_tiny_models(tiny_teacher, tmp_path, monkeypatch):
    """The matched-memory study solves the new policy's budget to Conf-KV's memory (what `evict --policy` runs)."""
    import importlib

    import kvlab
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec
    from kvlab.store import RunStore
    from kvlab.studies.eviction.tables import EvictStudy, matched_runs, matched_table

    (tmp_path / "my_policies_tiny.py").write_text(POLICY_FILE.format(name="every_other_tiny", cls="EveryOtherTiny"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("my_policies_tiny")
        spec = RunSpec(prompts=("the quick brown fox jumps over the lazy dog " * 2,) * 2, tokens=24,
                       sampling=Sampling(temperature=0.8, top_p=0.95, seed=1))
        study = EvictStudy(gamma=0.5, tight=16, loose=24, protect=4, sinks=2, gammas=(), only=("every_other_tiny",))
        per_run, info, pols = matched_runs(tiny_teacher, spec, RunStore(tmp_path / "runs"), study, progress=False)
        row = matched_table(per_run, info).set_index("policy").loc["every_other_tiny"]
        assert row["matched_by"] == "solved budget" and row["evict_events"] > 0
        assert type(pols["every_other_tiny"]).__name__ == "EveryOtherTiny"
    finally:
        kvlab.unregister_eviction("every_other_tiny")


# ----------------------------------------------------------------------------- what the studies build (run keys)

def _pd(p):
    from kvlab.decode.keys import policy_dict

    return policy_dict(p)


def test_the_studies_build_the_same_policies_as_before_the_registry_path():
    """A handful of the dicts dumped before the move (every study's, bench's and playground's policies)."""
    from kvlab.playground.settings import Settings, eviction_policy
    from kvlab.studies.bench.bench import decode_evict_policies, default_evict_policies
    from kvlab.studies.eviction import needle
    from kvlab.studies.eviction.tables import EvictStudy

    fams = EvictStudy().families()
    assert {k: fams[k][1:] for k in ("confkv_fixed", "sliding", "snapkv", "block")} == {
        "confkv_fixed": (13, 4096), "sliding": (5, 4096), "snapkv": (9, 4096), "block": (1, 512)}
    assert _pd(fams["confkv_fixed"][0](40)) == _pd(kvlab_confkv(gamma=0.0, tight=40, loose=40, protect=8, sinks=4))
    assert _pd(fams["block_kvcrush"][0](7)) == {"policy": "BlockEvict", "block_size": 2, "start_blocks": 2,
                                                 "evictable_blocks": 7, "recent_blocks": 4, "score": "norm_sum",
                                                 "snapkv_window": 8, "pool_window": 7, "rerotate": False, "kvcrush": 2,
                                                 "anchor": "mean", "seed": 0, "ema_decay": 0.9}
    assert _pd(fams["h2o"][0](17)) == {"policy": "H2O", "budget": 17, "recent": 8, "ema_decay": 0.9,
                                       "per_layer": True, "sinks": 4}
    assert _pd(fams["snapkv"][0](17)) == {"policy": "SnapKV", "budget": 17, "window": 8, "kernel": 5,
                                          "ema_decay": 0.9, "per_layer": True}
    c = _pd(needle.needle_confkv(128, 0.9))
    assert (c["tight"], c["loose"], c["protect"], c["sinks"], c["gamma"]) == (96, 128, 16, 4, 0.9)
    blk = _pd(needle.needle_policies(128)["block"])
    assert (blk["block_size"], blk["start_blocks"], blk["evictable_blocks"], blk["recent_blocks"]) == (16, 1, 4, 2)
    m = needle.matched_needle_policies(100.0, 23, 128)
    assert _pd(m["h2o"]) == {"policy": "H2O", "budget": 100, "recent": 16, "ema_decay": 0.9, "per_layer": True, "sinks": 4}
    assert _pd(m["snapkv"])["budget"] == 89 and _pd(m["block"])["evictable_blocks"] == 20
    b = default_evict_policies(2048)
    assert _pd(b["block"])["evictable_blocks"] == 29 and _pd(b["confkv_int8"])["int8_window"] == 128
    assert (_pd(b["confkv"])["tight"], _pd(b["confkv"])["loose"], _pd(b["random"])["recent"]) == (512, 1024, 128)
    bb = decode_evict_policies(64)
    assert (_pd(bb["evict:confkv"])["tight"], _pd(bb["evict:confkv"])["protect"], _pd(bb["evict:h2o"])["recent"]) == (64, 16, 16)
    s = Settings(prompt="p", evict="confkv", budget=64, gamma=0.3)
    assert {k: _pd(eviction_policy(s))[k] for k in ("tight", "loose", "protect", "gamma")} == {
        "tight": 32, "loose": 64, "protect": 8, "gamma": 0.3}
    p = _pd(eviction_policy(s.replace(evict="block")))
    assert (p["start_blocks"], p["evictable_blocks"], p["recent_blocks"]) == (1, 10, 4)
    assert _pd(eviction_policy(s.replace(evict="sliding", budget=8))) == {"policy": "SlidingWindow", "window": 8, "sinks": 4}


def kvlab_confkv(**kw):
    from kvlab.eviction import ConfKV

    return ConfKV(**kw)


@pytest.mark.integration
def test_python_m_kvlab_evict_runs_a_one_file_policy_end_to_end(tmp_path):
    """The whole command, as a user types it, on the embedded pair: a policy file dropped into a copy of
    kvlab/eviction/ is a row of the matched-memory table (solved to Conf-KV's mean memory) it writes."""
    shutil.copytree(ROOT / "kvlab", tmp_path / "kvlab", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "kvlab" / "eviction" / "every_other.py").write_text(POLICY_FILE.format(name="every_other",
                                                                                       cls="EveryOther"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("KVLAB_PLUGINS", None)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kvlab", "evict", "--policy", "every_other", "--prompts", "1",
                        "--tokens", "4", "--no-needle", "--no-progress", "--out", str(out), "--runs", str(tmp_path / "runs")],
                       capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    import pandas as pd

    table = pd.read_csv(out / "evict_matched.csv")
    row = table[table.policy == "every_other"].iloc[0]
    assert row["matched_by"] == "solved budget" and row["params"].startswith("EveryOther(budget=")
    assert "h2o" not in set(table.policy)                       # --policy names the fixed-budget families
