"""Which Sluice replica answers a request under Ray Serve: the one that most recently served
its prompt prefix (serve_requests.PrefixKeys), unless that replica is overloaded; else the
least loaded one.

The router runs inside each ingress replica's deployment handle (Ray Serve's RequestRouter
API); its memory of keys is that ingress replica's own. Load is what this router has in
flight on each replica. A new key goes to the least loaded replica, ties broken by fewest
keys held, so that prefixes spread and each replica's cache holds its share. It counts, per
keyed request, what it did (`affine`: to the replica that last served the key; `moved`:
that one was overloaded or gone; `new`); the ingress exports the counts.

Serve ships this module to the ingress by value: the request types and the registry of
routers are reached through the imported `serve_requests` module, never copied into here.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from gateway.scale import serve_requests

KEYS_REMEMBERED = 100_000               # most recently used first; older keys start afresh


def pending_request_body(request: PendingRequest | None):
    """The Forwarded or Pinned a handle call carries, if any."""
    if request is not None and request.args and \
            isinstance(request.args[0], (serve_requests.Forwarded, serve_requests.Pinned)):
        return request.args[0]
    return None


class AffinityRouter(RequestRouter):
    def initialize_state(self, policy: str = "affinity", slack: int = 4) -> None:
        """`slack`: a replica keeps its keys until it has that many more requests in flight
        than the least loaded one. `policy` "round_robin" ignores keys (for comparison)."""
        self.policy, self.slack = policy, slack
        self.last: OrderedDict[str, ReplicaID] = OrderedDict()
        self.held: Counter[ReplicaID] = Counter()         # keys each replica served last
        self.inflight: Counter[ReplicaID] = Counter()
        self.counts: Counter[str] = Counter()
        self._turn = itertools.count()
        serve_requests.ROUTERS[self._deployment_id.name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # every rank below tried: wait, then again
        request = pending_request_body(pending_request)
        if isinstance(request, serve_requests.Pinned):
            return [[r for r in candidate_replicas if r.replica_id.unique_id == request.replica]]
        load = lambda r: self.inflight[r.replica_id]
        ranked = sorted(candidate_replicas, key=lambda r: (load(r), self.held[r.replica_id]))
        if self.policy == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[next(self._turn) % len(ordered)]], ranked]
        key = request.affinity if request else None
        cached = next((r for r in ranked if key is not None and r.replica_id == self.last.get(key)), None)
        if cached is not None and load(cached) <= load(ranked[0]) + self.slack:
            return [[cached], ranked]
        return [ranked[:1], ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = pending_request_body(pending_request)
        if isinstance(request, serve_requests.Pinned):
            return
        self.inflight[replica_id] += 1
        if request is None or request.affinity is None:
            return
        before = self.last.pop(request.affinity, None)
        self.counts["new" if before is None else "affine" if before == replica_id else "moved"] += 1
        if before is not None:
            self.held[before] -= 1
        self.last[request.affinity] = replica_id
        self.held[replica_id] += 1
        if len(self.last) > KEYS_REMEMBERED:
            self.held[self.last.popitem(last=False)[1]] -= 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.inflight[replica_id] > 0:
            self.inflight[replica_id] -= 1

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)
