"""Prefix-affinity request router (Ray Serve's RequestRouter interface).

The ingress computes, per request, the hash chain of the prompt's first KV blocks (memfit's own
block keys, kv/manager.py ``block_key``, over the tokens of the prompt templated from the raw
request: the replica's prefix cache keys the same blocks, and any difference in how the two
render a message only costs affinity, never correctness) and passes it to the replica call as the ``prefix``
keyword. This router, which Serve runs inside the ingress for its deployment handle, keeps the
last replica that served each block hash and ranks that replica first when its load allows:

- the deepest block of the chain with a known owner among the live replicas wins;
- the owner is taken when it has room (ongoing < max_ongoing_requests) and its load exceeds
  the least loaded replica's by at most ``imbalance`` requests (vLLM's
  PrefixCacheAffinityRouter has the same guard); otherwise, and for a prompt without a known
  prefix, the replicas are ranked by load, and the least loaded one claims the prefix at once,
  so that a burst of requests with a new shared prefix follows the first one.

Serve itself then sends to the first rank that accepts (its rejection protocol: a replica at
max_ongoing_requests refuses and the next rank is tried), drops replicas whose actor died, and
backs off while none can take the request. Load is the larger of Serve's cached queue length
and this router's own count of requests in flight per replica.

Why Serve's router rather than affinity in the ingress with per-replica handles: Serve gives
no public handle to one replica, and its router already does the replica set, death
detection, rejection and backoff; only the ranking is ours. (``PrefixCacheAffinityRouter``
itself ships in ``ray[llm]``, which pulls in vLLM, and matches on prompt text, not tokens.)
"""

from __future__ import annotations

import collections
import importlib
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

MAX_KEYS = 1 << 16          # block hashes remembered (least recently used dropped)

# the routers of this process (the ingress's handle has one); the ingress reads their counts
ROUTERS: list["PrefixAffinityRouter"] = []


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 16, **kwargs):
        self.imbalance = int(imbalance)
        self.owner: collections.OrderedDict[int, object] = collections.OrderedDict()
        self.inflight: dict[object, int] = collections.Counter()
        self.req_replica: dict[str, object] = {}
        self.decisions = collections.Counter()   # affinity / balanced / no_prefix
        # Serve ships the class by value (cloudpickle), so this copy's module globals are not
        # the importable module's: register with the latter, where the ingress looks
        importlib.import_module("memfit.ray.router").ROUTERS.append(self)

    def _load(self, r: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(r.replica_id)
        return max(cached or 0, self.inflight.get(r.replica_id, 0))

    def _claim(self, chain, replica_id) -> None:
        for h in chain:
            self.owner[h] = replica_id
            self.owner.move_to_end(h)
        while len(self.owner) > MAX_KEYS:
            self.owner.popitem(last=False)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        chain = tuple(pending_request.kwargs.get("prefix") or ()) if pending_request else ()
        by_id = {r.replica_id: r for r in candidate_replicas}
        load = {rid: self._load(r) for rid, r in by_id.items()}
        ranked = sorted(candidate_replicas, key=lambda r: load[r.replica_id])
        least = load[ranked[0].replica_id]
        owner = None
        for h in reversed(chain):
            rid = self.owner.get(h)
            if rid in by_id:
                owner = rid
                break
        if owner is not None:
            r = by_id[owner]
            if load[owner] < r.max_ongoing_requests and load[owner] - least <= self.imbalance:
                self.decisions["affinity"] += 1
                rest = [x for x in ranked if x.replica_id != owner]
                return [[r], rest] if rest else [[r]]
        self.decisions["balanced" if chain else "no_prefix"] += 1
        if chain:
            self._claim(chain, ranked[0].replica_id)
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        chain = pending_request.kwargs.get("prefix") or ()
        if chain:
            self._claim(chain, replica_id)
        self.inflight[replica_id] += 1
        self.req_replica[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if self.req_replica.pop(internal_request_id, None) is not None:
            self.inflight[replica_id] = max(0, self.inflight[replica_id] - 1)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.inflight.pop(replica_id, None)
        for h in [h for h, rid in self.owner.items() if rid == replica_id]:
            del self.owner[h]
