"""The pieces everything else stands on: loading models (:mod:`.models`), width pruning (:mod:`.prune`),
KV compatibility of a pair (:mod:`.compat`), scoring (:mod:`.metrics`), prompt files (:mod:`.data`),
tiny random models for tests (:mod:`.tiny`) and command-line argument types (:mod:`.args`).
Nothing is imported here.
"""
