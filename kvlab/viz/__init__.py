"""Pictures and readings for people, at the top of the package: the figure renderer (:mod:`.figures`; the
registry is :mod:`kvlab.harness.figures`), plot functions of stored tables (:mod:`.plots`), "how to read this"
texts (:mod:`.readings`, which gathers each study's ``kvlab/studies/<study>/readings.py``), the cache inspector
(:mod:`.inspector`), live-map pictures (:mod:`.livemap`) and the numbers quoted in README.md and docs/
(:mod:`.docs`, which walks each study's ``quotes.py``). Reads tables and traces; writes only figure files and,
:mod:`.docs`, the generated blocks of the Markdown pages. Nothing is imported here.
"""
