"""Uncertainty signals for refresh: real MC-dropout on a student (:mod:`.mc`, with the ``MCGate`` refresh
policy and its probe) and the blog's MC-dropout trigger simulation (:mod:`.mcsim`). :mod:`.mc` adds forward hooks
to a model only inside a ``with`` block that removes them, and probes a cache without changing it.
Nothing is imported here.
"""
