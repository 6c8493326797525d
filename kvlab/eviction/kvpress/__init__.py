"""NVIDIA kvpress's presses as kvlab eviction policies: bring your press, unchanged.

    import kvlab, kvpress
    policy = kvlab.ScorerPolicy(kvpress.SnapKVPress(window_size=16), budget=64, sinks=4)   # or:
    policy = kvlab.from_kvpress(kvpress.DecodingPress(kvpress.KnormPress(), target_size=64), budget=64)

A ``ScorerPress`` runs through its own ``score`` with what kvpress's hooks would give it (:mod:`.call`);
a press that is not a scorer runs through :func:`kvlab.eviction.press_policy.from_kvpress` when kvlab has its protocol (DecodingPress:
decode-time eviction; KeyRerotationPress: re-rotation) and is refused before anything runs otherwise,
with a message naming the press and what kvlab lacks (:mod:`.support`). :func:`installed_presses` lists
what the installed kvpress exports and how each runs here.

kvpress is optional: nothing here imports it until a press is used or listed (``pip install kvlab[kvpress]``
or ``make install``; it is installed ``--no-deps``, its runtime imports pinned in constraints.txt).
Importing kvpress patches transformers' attention functions (kvpress's own import side effect, for its
head-wise masking); the patched functions behave as before for a model kvpress's presses never masked.
"""
from __future__ import annotations

from kvlab.eviction.kvpress.detect import is_press, press_name
from kvlab.eviction.kvpress.support import check_press, installed_presses


__all__ = ["check_press", "installed_presses", "is_press", "press_name"]
