"""The experiment harness, below the studies and above the policies: running and storing decode runs over a
prompt set (:mod:`.experiment`), the bootstrap over training seeds and prompts (:mod:`.hierarchical`),
teacher-forced scores (:mod:`.forced`), run costs (:mod:`.costs`), the figure registry (:mod:`.figures`), tables
for people (:mod:`.tableview`), the pieces of "How to read this" texts (:mod:`.prose`) and of the numbers the pages
quote (:mod:`.quotes`), and the argument helpers commands share (:mod:`.args`). Nothing is imported here.
"""
