"""The cache module: the one place that touches KV-cache tensors (:mod:`kvlab.cache.kvcache`),
with its pure-Python token mirror (:mod:`.ledger`) and surgery planner (:mod:`.plan`). Every edit changes tensors,
live maps and attention statistics in the same call, or nothing; no other package edits cache tensors."""
from kvlab.cache.kvcache import EvictReport, KVCache
from kvlab.cache.ledger import EventLog, Ledger, Row
from kvlab.cache.plan import ACTIONS, SPLICE_MODES, Block, SurgeryError, TickPlan, TickReport, plan_actions
from kvlab.cache.resident import ColumnView, Resident

__all__ = ["ACTIONS", "EvictReport", "SPLICE_MODES", "Block", "ColumnView", "EventLog", "KVCache", "Ledger", "Resident",
           "Row", "SurgeryError", "TickPlan", "TickReport", "plan_actions"]
