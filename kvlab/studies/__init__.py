"""Studies: running and storing decode runs over a prompt set (:mod:`.experiment`), the baselines table
(:mod:`.baselines`), the benchmarks (:mod:`.bench`) and the argument helpers commands share (:mod:`.args`).
May write: runs into the run store, tables under ``--out``; benchmarks write only untracked timing files.
Nothing is imported here.
"""
