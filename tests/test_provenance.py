"""Provenance: code version, commit, machine — and no failure outside a git checkout."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kvlab.store import provenance

ROOT = Path(__file__).resolve().parent.parent


def test_stamp_fields():
    s = provenance.stamp()
    assert s["code_version"] == provenance.CODE_VERSION and isinstance(s["code_version"], str)
    m = s["machine"]
    assert {"host", "cpu", "cpu_count", "gpu", "device", "torch", "transformers"} <= set(m)
    assert m["device"] in ("cpu", "cuda") and (m["gpu"] is None) == (m["device"] == "cpu")
    assert s["machine_key"] == provenance.machine_key() and len(s["machine_key"]) == 10


def test_cpu_family_tells_generations_apart(monkeypatch, tmp_path):
    """A VM's short model name (``AMD EPYC``) is followed by CPUID's family and model in ``describe_machine``; the
    pair enters the machine key (timings of two generations are not equivalent)."""
    import re

    fam = provenance.machine()["cpu_family"]
    assert fam is None or re.fullmatch(r"family \d+ model \d+", fam)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\n")
    real = provenance.Path
    monkeypatch.setattr(provenance, "Path", lambda p: info if p == "/proc/cpuinfo" else real(p))
    assert provenance._cpu_family() == "family 26 model 2"
    monkeypatch.setattr(provenance, "machine", lambda: {"gpu": None, "cpu": "AMD EPYC", "cpu_family": "family 26 model 2",
                                                        "cpu_count": 2, "torch": "2.13.0", "transformers": "5.24.0"})
    assert provenance.describe_machine() == "cpu AMD EPYC (family 26 model 2) ×2, torch 2.13.0, transformers 5.24.0"
    assert "cpu_family" in provenance.TIMING_FIELDS


def test_git_commit_in_checkout():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # not a checkout here: covered by the copy test below
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    sha = provenance.git_commit()
    assert sha and head.startswith(sha)


def test_no_git_outside_a_checkout(tmp_path):
    """A copy of the package outside any checkout: git_commit() is None, nothing raises."""
    shutil.copytree(ROOT / "kvlab", tmp_path / "kvlab", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from kvlab.store import provenance as p; assert p.git_commit() is None and p.git_dirty() is None; "
            "assert p.source_root() is None; print(p.source_label())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "unknown commit"
