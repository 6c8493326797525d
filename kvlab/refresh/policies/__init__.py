"""Refresh policies: small frozen dataclasses with one decision method, ``should_refresh(record)``.

The protocol the decode loop reads is in :mod:`kvlab.refresh.base` (``window``, ``probe``, ``probe_every``).
``MCGate`` (the MC-dropout gate) lives beside its probe and signals in :mod:`kvlab.uncertainty.mc` and is
loaded from there on first use, so importing the policies does not import the decode loop.

:data:`REFRESH_POLICIES` is the one registry of refresh policies by name (sweeps, the playground and the run
store's rows read it): the built-ins below, plus a user's own class registered with :func:`register_refresh`
(docs/custom_policies.md).
"""
from kvlab.core.registry import REFRESH_POLICIES

from kvlab.refresh.policies.entropy import EntropyGate
from kvlab.refresh.policies.periodic import Periodic
from kvlab.refresh.policies.probe_kl import ProbeKL
from kvlab.refresh.policies.speculative import Speculative

__all__ = ["REFRESH_POLICIES", "EntropyGate", "MCGate", "Periodic", "ProbeKL", "Speculative", "register_refresh",
           "unregister_refresh"]


def _mc_gate():
    from kvlab.uncertainty.mc import MCGate

    return MCGate


register_refresh = REFRESH_POLICIES.register          # @register_refresh("mine") on your class
unregister_refresh = REFRESH_POLICIES.unregister


def __getattr__(name):
    if name == "MCGate":
        return _mc_gate()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
