"""Shared fixtures: tiny random-config Llama models (fast, offline) and the real embedded pair."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvlab.core.tiny import make_tiny_lm  # noqa: E402  (tests import it from here)


@pytest.fixture(scope="session")
def tiny_teacher():
    return make_tiny_lm(seed=0)


@pytest.fixture(scope="session")
def tiny_student():
    """Same KV geometry as ``tiny_teacher``, different (narrower) MLP and weights."""
    return make_tiny_lm(seed=1, intermediate_size=48)


@pytest.fixture(scope="session")
def real_pair():
    """The embedded teacher and the UNTRAINED pruned student (i0.30; CPU, fp32), built once into the kvlab
    cache dir. Tests never train the full students (CI starts with an empty model cache)."""
    from kvlab.train.pair import load_pair

    return load_pair(device="cpu", variant="pruned", shape="i0.30")
