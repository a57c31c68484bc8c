"""The two baselines every load balancer ships: round robin and least outstanding requests.

Round robin is what a Kubernetes Service (kube-proxy) or SGLang router's `round_robin`
policy does: the next healthy worker in turn, blind to load. Least outstanding requests is
Envoy's and nginx's `least_conn` idea without sampling: the worker with the fewest requests
this router has in flight, ties broken by a seeded random choice so no worker is favoured.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleetsim.baselines.view import WorkerView, healthy
from fleetsim.workloads import RequestSpec


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RequestSpec, workers: Sequence[WorkerView], now: float) -> int:
        alive = healthy(workers)
        chosen = alive[self._next % len(alive)]
        self._next += 1
        return chosen.index

    def forget(self, worker: int) -> None:
        return None


class LeastOutstanding:
    name = "least_outstanding"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: RequestSpec, workers: Sequence[WorkerView], now: float) -> int:
        alive = healthy(workers)
        fewest = min(w.outstanding for w in alive)
        tied = [w.index for w in alive if w.outstanding == fewest]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def forget(self, worker: int) -> None:
        return None
