"""Pictures and readings for people: the figure registry (:mod:`.base`) and renderer (:mod:`.figures`), plot
functions of stored tables (:mod:`.plots`), "how to read this" texts (:mod:`.readings`), tables for people
(:mod:`.tableview`), live-map pictures (:mod:`.livemap`) and the numbers quoted in README.md and docs/
(:mod:`.docs`). Reads tables and traces; writes only figure files and, :mod:`.docs`, the generated blocks of
the Markdown pages. Nothing is imported here.
"""
