"""Uncertainty signals for refresh: real MC-dropout on a student (:mod:`.mc`, with the ``MCGate`` refresh
policy and its probe) and the blog's MC-dropout trigger simulation (:mod:`.mcsim`). Nothing is imported here.
"""
