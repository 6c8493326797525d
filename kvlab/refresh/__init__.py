"""KV-cache refresh (seed 000, "KV Cache Refresh"): when the teacher rewrites the student's cache.

* :mod:`.base` — the protocol the decode loop reads: probes, the probe context, policy checks, run costs
* :mod:`.policies` — the policies, one frozen dataclass per file (periodic, entropy gate, probe-KL, speculative)
* :mod:`.choice` — one policy chosen by name and parameters (``python -m kvlab refresh --policy ...``)
* :mod:`.tables` — the blog's refresh tables from stored runs
* :mod:`.forced` — the teacher-forced study: does a teacher-written cache help, tokens held fixed?

Policies and probes decide and measure; the decode loop and the cache module act on them. Only the tables and
the forced study write: runs into the run store, tables and figures under ``--out``.
Nothing is imported here: ``from kvlab.refresh.policies import Periodic`` (or ``kvlab.Periodic``).
"""
