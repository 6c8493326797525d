"""Pictures and readings for people: the figure registry (:mod:`.base`) and renderer (:mod:`.figures`), plot
functions of stored tables (:mod:`.plots`), "how to read this" texts (:mod:`.readings`), tables for people
(:mod:`.tableview`) and live-map pictures (:mod:`.livemap`). Nothing is imported here.
"""
