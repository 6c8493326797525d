"""Studies: one folder per study, each holding its runs and tables, its figures where it has its own, the
"How to read this" texts of its tables (``readings.py``) and what README.md and docs/ quote from them
(``quotes.py``): :mod:`.baselines`, :mod:`.refresh`, :mod:`.eviction`, :mod:`.mc`, :mod:`.training`,
:mod:`.bench`. Built on the experiment harness (:mod:`kvlab.harness`); a study never imports an app
(``kvlab.viz``, ``kvlab.sweep``, ``kvlab.playground``, ``kvlab.cli``). May write: runs into the run store,
tables under ``--out``; benchmarks write only untracked timing files. Nothing is imported here.
"""
