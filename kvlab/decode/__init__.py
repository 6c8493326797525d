"""The decode loop and the protocols it owns.

* :mod:`.config` — :class:`DecodeConfig`, :class:`Sampling` (what a run is asked to do);
* :mod:`.records` — :class:`StepRecord`, :class:`Signals`, :class:`Trace` (what it produces);
* :mod:`.sampling` — token statistics and the seeded draw;
* :mod:`.loop` — :class:`Decoding` (one generation, stepped), :func:`run`, :func:`continue_from`;
* :mod:`.batch` — :class:`BatchDecoding`, :func:`run_batch` (B prompts in lock-step);
* :mod:`.refresh_phase`, :mod:`.evict_phase` — the probe/refresh and evict phases of the loop;
* :mod:`.protocols` — what an eviction or refresh policy is to the loop: :class:`EvictView`, :class:`Keep`, every
  optional policy attribute with its default, the validators; :mod:`.probes` — the probe registry;
  :mod:`.keys` — a policy as run-key config.

The loop edits caches only through :mod:`kvlab.cache`; it imports no policy library.
"""
from kvlab.decode.config import MODES, REFRESH_NEXT, DecodeConfig, Sampling
from kvlab.decode.keys import code_digest, policy_dict
from kvlab.decode.probes import PROBES, ProbeContext, ProbeResult, register_probe
from kvlab.decode.protocols import (EVICT_ATTRS, REFRESH_ATTRS, EvictView, Keep,
                                    evict_attr, keep_all, refresh_attr, validate_evict, validate_policy)
from kvlab.decode.records import Signals, StepRecord, Trace
from kvlab.decode.sampling import LN2, choose, token_stats, token_stats_rows
from kvlab.decode.refresh_phase import PROBE_TEACHER_UPTO, RefreshPhases, _sync  # noqa: F401
from kvlab.decode.evict_phase import EvictPhases
from kvlab.decode.loop import Decoding, _eos_ids, _trace, continue_from, run  # noqa: F401
from kvlab.decode.batch import BatchDecoding, BatchError, run_batch

__all__ = ["MODES", "REFRESH_NEXT", "DecodeConfig", "Sampling", "code_digest", "policy_dict", "PROBES", "ProbeContext",
           "ProbeResult", "register_probe", "EVICT_ATTRS", "REFRESH_ATTRS", "EvictView", "Keep",
           "evict_attr", "keep_all", "refresh_attr", "validate_evict", "validate_policy", "Signals",
           "StepRecord", "Trace", "LN2", "choose", "token_stats", "token_stats_rows", "PROBE_TEACHER_UPTO",
           "RefreshPhases", "EvictPhases", "Decoding", "continue_from", "run", "BatchDecoding", "BatchError",
           "run_batch"]
