"""Refresh policies: small frozen dataclasses with one decision method, ``should_refresh(record)``.

The protocol the decode loop reads is in :mod:`kvlab.refresh` (``window``, ``probe``, ``probe_every``).
"""
from .entropy import EntropyGate
from .periodic import Periodic
from .probe_kl import ProbeKL
from .speculative import Speculative
from ..mc import MCGate  # MC-dropout gate (lives beside its probe and signals in kvlab.mc)

__all__ = ["EntropyGate", "MCGate", "Periodic", "ProbeKL", "Speculative"]
