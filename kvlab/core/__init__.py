"""The pieces everything else stands on: loading models (:mod:`.models`), width pruning (:mod:`.prune`),
KV compatibility of a pair (:mod:`.compat`), scoring (:mod:`.metrics`), prompt files (:mod:`.data`),
tiny random models for tests (:mod:`.tiny`) and command-line argument types (:mod:`.args`).
May write: the converted teacher and pruned students under the kvlab cache dir (``$KVLAB_CACHE``).
Nothing is imported here.
"""
