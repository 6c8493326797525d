"""Refresh policies: small frozen dataclasses with one decision method, ``should_refresh(record)``.

The protocol the decode loop reads is in :mod:`kvlab.refresh.base` (``window``, ``probe``, ``probe_every``).
``MCGate`` (the MC-dropout gate) lives beside its probe and signals in :mod:`kvlab.uncertainty.mc` and is
loaded from there on first use, so importing the policies does not import the decode loop.
"""
from .entropy import EntropyGate
from .periodic import Periodic
from .probe_kl import ProbeKL
from .speculative import Speculative

__all__ = ["EntropyGate", "MCGate", "Periodic", "ProbeKL", "Speculative"]


def __getattr__(name):
    if name == "MCGate":
        from kvlab.uncertainty.mc import MCGate

        return MCGate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
