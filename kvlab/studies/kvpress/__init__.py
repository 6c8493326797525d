"""kvpress's presses, unchanged, in kvlab's eviction study (issue 38): :func:`~kvlab.studies.kvpress.table.kvpress_table`
(each press at prefill and at decode time beside kvlab's sliding window, batched, teacher-forced KL to the full cache)
and :func:`~kvlab.studies.kvpress.heads.heads_table` (what averaging a press's per-head scores over heads costs)."""
