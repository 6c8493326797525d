"""The cache module: the one place that touches KV-cache tensors (:mod:`kvlab.cache.kvcache`),
with its pure-Python token mirror (:mod:`.ledger`) and surgery planner (:mod:`.plan`)."""
from .kvcache import EvictReport, KVCache
from .ledger import EventLog, Ledger, Row
from .plan import ACTIONS, SPLICE_MODES, Block, SurgeryError, TickPlan, TickReport, plan_actions

__all__ = ["ACTIONS", "EvictReport", "SPLICE_MODES", "Block", "EventLog", "KVCache", "Ledger", "Row", "SurgeryError",
           "TickPlan", "TickReport", "plan_actions"]
