"""The test suite collects from any working directory (conftest imported one way: ``from conftest``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_collects_from_outside_the_repo_root(tmp_path):
    # kvlab importable (as an installed package would be) but the repo root NOT on sys.path,
    # so an `import tests.conftest` fails here as it would for a user
    (tmp_path / "kvlab").symlink_to(TESTS.parent / "kvlab")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        *sorted(str(p) for p in TESTS.glob("test_*.py"))],
                       cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.lower().split("collected")[-1]
