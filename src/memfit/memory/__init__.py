"""The hard memory budget: budget (sizes, detection, RSS probes), ledger (accounting + RSS
watchdog), planner (pure: ModelDesc + budget -> Plan), bandwidth (measured, cached), store
(WeightStore executing a Plan behind the WeightSource protocol)."""

from .bandwidth import Bandwidth, get_bandwidth
from .budget import detect_budget, parse_size, peak_rss, resolve_budget
from .ledger import Ledger, LedgerDriftError
from .planner import ModelDesc, Plan, plan, plan_for_path
from .store import WeightStore

__all__ = ["Bandwidth", "get_bandwidth", "detect_budget", "parse_size", "peak_rss",
           "resolve_budget", "Ledger", "LedgerDriftError", "ModelDesc", "Plan", "plan",
           "plan_for_path", "WeightStore"]
