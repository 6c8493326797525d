"""Refresh policies: small frozen dataclasses with one decision method, ``should_refresh(record)``.

The protocol the decode loop reads is in :mod:`kvlab.refresh` (``window``, ``probe``, ``probe_every``).
"""
from .entropy import EntropyGate
from .periodic import Periodic
from .probe_kl import ProbeKL
from .speculative import Speculative

__all__ = ["EntropyGate", "Periodic", "ProbeKL", "Speculative"]
