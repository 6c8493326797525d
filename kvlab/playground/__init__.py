"""The interactive playground: plain-Python logic here, a thin ipywidgets view in
:mod:`kvlab.playground.view` (imported on demand, it needs ipywidgets + plotly). It writes runs into the run
store (keyed like the tables' runs) and, on export, files under ``./playground-exports/``.

* :class:`Playground` — settings in, stored/streamed runs and readouts out (background runner,
  cancellation, precompute over a slider's range).
* :class:`Stepper` — step-through over one :class:`~kvlab.decode.Decoding`.
* :class:`Settings` — every control, checked per control (:func:`check`).
"""
from kvlab.playground.controller import READOUTS, LivePoint, Playground, Progress, Shown, readouts
from kvlab.playground.runner import Cancelled, ModelGate, Runner
from kvlab.playground.settings import POLICIES, RANGES, Range, Settings, check, decode_config
from kvlab.playground.stepper import SettingsError, Stepper, StepView

__all__ = ["Cancelled", "LivePoint", "ModelGate", "POLICIES", "Playground", "Progress", "RANGES", "READOUTS", "Range",
           "Runner", "Settings", "SettingsError", "Shown", "StepView", "Stepper", "check", "decode_config", "readouts"]
