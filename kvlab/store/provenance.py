"""Which code and which machine produced a result: the version, commit and machine every stored run and every
table carries. Reads the git checkout and the platform; writes nothing.

* :data:`CODE_VERSION` — bumped by hand whenever decoding or scoring semantics change (what a
  stored run means). The run store keys runs by it, so a bump invalidates every stored run.
* :func:`git_commit` — the checkout's short commit (``None`` outside a git checkout).
* :func:`machine` — host, CPU/GPU, library versions, default device; :func:`machine_key` hashes
  the part that decides timings (hardware + library versions, not the host name), so a run timed
  on other hardware is never reused for timing columns.

Everything here is computed lazily on first call and cached; nothing runs at import time.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

# Bump on any change of what a run means (decode loop, refresh, scoring). Changelog:
#   2026-11-22.kl-student: refresh span fix (the entry "rerun" leaves to the student is
#     rewritten at the next refresh); score's `kl` averages only over student-chosen steps (`kl_all`: all
#     steps); runs are tied to CODE_VERSION + machine in the store.
#   2026-11-22.evict: DecodeConfig(evict=...), eviction in the loop; records' cache_len is the cache length after the
#     step (differs on "teacher"/"student" refresh steps), records store cache_bytes.
#   2026-11-23.per-layer: per-layer live sets: each layer keeps its own entries and a
#     per-layer eviction decision (Keep.layers) really evicts per layer; per-layer attention statistics.
#   2026-11-23.per-layer-decisions: BlockEvict and ConfKV(pyramidal=True) decide per layer (Conf-KV-L's
#     shallowest layer keeps B, the deepest rho*B); PyramidKV; per-layer re-rotation.
#   2026-11-23.per-layer-ranking: H2O, Scissorhands, SnapKV and uniform Conf-KV decide per layer too, each layer
#     keeping its own top entries by its own attention statistic (per_layer=False: the layer-mean ranking).
CODE_VERSION = "2026-11-23.per-layer-ranking.issue25-evict"

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # kvlab/


@functools.lru_cache(maxsize=1)
def source_root() -> Path | None:
    """The project folder when kvlab runs from a source checkout (editable install or
    ``PYTHONPATH``), i.e. the package's parent holding kvlab's ``pyproject.toml``; else ``None``."""
    root = PACKAGE_DIR.parent
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if 'name = "kvlab"' in text else None


def _git(*args: str) -> str | None:
    root = source_root()
    if root is None:
        return None
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _git_state() -> tuple[str | None, bool | None]:
    top = _git("rev-parse", "--show-toplevel")
    # only the checkout that *is* the project (not a repo that merely contains a venv with kvlab)
    if top is None or Path(top).resolve() != source_root():
        return None, None
    sha = _git("rev-parse", "--short=12", "HEAD")
    if sha is None:
        return None, None
    # ignored files (runs/, .venv/) do not count, nor figures/: it holds this code's own outputs
    status = _git("status", "--porcelain", "--", ".", ":(exclude)figures")
    return sha, (bool(status) if status is not None else None)


def git_commit() -> str | None:
    """Short SHA of the source checkout's HEAD, or ``None`` (not a checkout, no git). Cached."""
    return _git_state()[0]


def git_dirty() -> bool | None:
    """True if the checkout differs from HEAD (edited or new non-ignored files): the code that ran
    is not exactly the commit."""
    return _git_state()[1]


def commit_label(sha: str | None, dirty) -> str:
    """``"<sha>"``, ``"<sha>+dirty"`` or ``"unknown commit"`` (no sha)."""
    return "unknown commit" if not sha else sha + ("+dirty" if dirty else "")


def source_label() -> str:
    """:func:`commit_label` of this checkout — for table notes."""
    return commit_label(*_git_state())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_family() -> str | None:
    """``"family 26 model 2"`` from ``/proc/cpuinfo`` (a VM's model name can be as short as ``AMD EPYC``: two CPU
    generations then read alike, and their timings differ about twofold); None where it is not read."""
    try:
        got = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k in ("cpu family", "model") and k not in got:
                got[k] = v.strip()
            if not line.strip() and got:
                break
        return f"family {got['cpu family']} model {got['model']}" if len(got) == 2 else None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _machine() -> tuple:
    import torch

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf = None
    cuda = torch.cuda.is_available()
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_family": _cpu_family(),
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()) if cuda else None,
        "device": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": tf,
    }
    return tuple(sorted(info.items()))


def machine() -> dict:
    """Where code runs: host, platform, python, cpu (model name), cpu_count, cpu_family (``family F model M``, the
    x86 CPUID numbers, or None), gpu (name or None),
    device (the default, ``cuda`` or ``cpu``), torch and transformers versions. Cached."""
    return dict(_machine())


TIMING_FIELDS = ("cpu", "cpu_family", "cpu_count", "gpu", "device", "torch", "transformers")


def machine_key() -> str:
    """Hash of the timing-relevant part of :func:`machine` (hardware, libraries; not the host name)."""
    m = machine()
    blob = json.dumps({k: m.get(k) for k in TIMING_FIELDS}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def describe_machine() -> str:
    """One line for table notes, e.g. ``"cpu AMD EPYC (family 26 model 2) ×2, torch 2.13.0"``."""
    m = machine()
    fam = f" ({m['cpu_family']})" if m.get("cpu_family") else ""
    hw = f"gpu {m['gpu']}" if m["gpu"] else f"cpu {m['cpu']}{fam} ×{m['cpu_count']}"
    return f"{hw}, torch {m['torch']}, transformers {m['transformers']}"


def stamp() -> dict:
    """What every stored run carries: code version, commit (+dirty), machine info and its key."""
    return {"code_version": CODE_VERSION, "git_commit": git_commit(), "git_dirty": git_dirty(),
            "machine": machine(), "machine_key": machine_key()}
