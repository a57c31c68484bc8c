"""Built-in scorers: one term of the cost model each, turned into a score in [0, 1].

A term of `half_at_s` seconds scores 0.5, zero cost scores 1, and the score falls toward
0 as the cost grows: `score = half / (half + cost)`. This keeps every scorer bounded and
monotone, so a profile's weights alone decide how the terms trade off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.contract import Role
from controlplane.routing.cost import CostModel
from controlplane.routing.framework import Cycle
from controlplane.routing.prefix_index import PrefixIndex
from controlplane.routing.snapshot import EndpointView, RouteRequest


def _check_half(name: str, half_at_s: float) -> None:
    if not (math.isfinite(half_at_s) and half_at_s > 0.0):
        raise ValueError(f"scorer {name}: half_at_s must be a positive number, got {half_at_s}")


@dataclass(frozen=True, slots=True)
class PrefixAffinity:
    """The uncached-prefill term. Cached tokens are estimated from the approximate prefix
    index and from ownership: the primary owner of the prefix key is assumed to hold the
    owner-key blocks (the secondary half of them) even before the index has seen it.

    Tiers: the blocks an endpoint publishes as held in its engine's host tier (an
    offloaded request's, `EndpointState.host_prefixes`) are credited at `host_weight` a
    block, the rest of what it holds at 1: loading a page back over PCIe is cheaper than
    computing it and dearer than finding it on the device. The defaults are Dynamo's KV
    router's (`--router-kv-overlap-score-credit` 1.0 for the device,
    `--router-host-cache-hit-weight` 0.75 for host memory), so a resumed continuation
    goes where its pages are, and a device copy of them elsewhere still wins.

    Anti-hotspot: an endpoint whose queue alone is longer than `max_wait_s` gets no cache
    credit, so affinity never keeps a hot owner busy past the max wait.

    The index is this plugin's state: its post-decision hook (`placed`) fills it with
    where each prompt's blocks went.
    """

    cost: CostModel = field(default_factory=CostModel)
    block_tokens: int = 64
    owner_blocks: int = 4
    max_wait_s: float = 2.0
    half_at_s: float = 0.25
    host_weight: float = 0.75
    name: str = "prefix-affinity"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)
        if self.block_tokens <= 0 or self.owner_blocks < 0:
            raise ValueError("prefix-affinity: block_tokens must be > 0, owner_blocks >= 0")
        if not 0.0 <= self.host_weight <= 1.0:
            raise ValueError(
                f"prefix-affinity: host_weight must be in [0, 1], got {self.host_weight}"
            )

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        request, holders, block = cycle.request, cycle.holders, self.block_tokens
        # Credit only the owners and the prefix holders: everyone else caches nothing.
        credit = {endpoint_id: blocks * block for endpoint_id, blocks in holders.items()}
        host_weight = self.host_weight
        for endpoint_id, host in cycle.host_holders.items():
            # Its first `host` blocks wait in host memory; what the index adds beyond
            # them is on the device.
            device = max(0, holders.get(endpoint_id, 0) - host)
            credit[endpoint_id] = round((host_weight * host + device) * block)
        owner_tokens = self.owner_blocks * block
        for endpoint_id, tokens in zip(
            request.owners, (owner_tokens, owner_tokens // 2), strict=False
        ):
            if credit.get(endpoint_id, 0) < tokens:
                credit[endpoint_id] = tokens
        cached = [credit.get(v.endpoint_id, 0) for v in candidates]
        half = self.half_at_s
        if not any(cached):
            return [half / (half + c) for c in self.cost.uncached_prefill_s(request, cached)]
        # A long queue voids cache credit: affinity never keeps a request waiting past it.
        max_wait = self.max_wait_s
        queue = cycle.queue_s(self.cost, candidates)
        cached = [0 if q > max_wait else c for c, q in zip(cached, queue, strict=True)]
        return [half / (half + c) for c in self.cost.uncached_prefill_s(request, cached)]

    def placed(self, request: RouteRequest, endpoint_id: str, prefix_index: PrefixIndex) -> None:
        """The prompt's blocks are probably cached at `endpoint_id` from now on."""
        if request.block_hashes:
            prefix_index.record(endpoint_id, request.block_hashes)


@dataclass(frozen=True, slots=True)
class QueueScorer:
    """The queue term: prompt tokens waiting for prefill and requests queued, including
    the ones this router dispatched since the endpoint's last heartbeat."""

    cost: CostModel = field(default_factory=CostModel)
    half_at_s: float = 0.25
    name: str = "queue"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        half = self.half_at_s
        return [half / (half + c) for c in cycle.queue_s(self.cost, candidates)]


@dataclass(frozen=True, slots=True)
class KVPressureScorer:
    """The future-KV-growth term: KV used plus the reserved growth of what already runs
    there plus this request's own prompt and expected output, against capacity."""

    cost: CostModel = field(default_factory=CostModel)
    half_at_s: float = 1.0
    name: str = "kv-pressure"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        request, cost, half = cycle.request, self.cost, self.half_at_s
        return [half / (half + c) for c in cost.future_kv_s(request, candidates)]


@dataclass(frozen=True, slots=True)
class SLORiskScorer:
    """The SLO-risk term: expected lateness against the TTFT objective and the request's
    deadline on each endpoint, from the latency its sidecar predicts (or, without a
    prediction, its queue and the prompt's prefill)."""

    cost: CostModel = field(default_factory=CostModel)
    half_at_s: float = 0.5
    name: str = "slo-risk"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        request, cost, half = cycle.request, self.cost, self.half_at_s
        queue = cycle.queue_s(cost, candidates)
        risks = cost.slo_risk_s(request, candidates, queue, cycle.ctx)
        return [half / (half + c) for c in risks]


@dataclass(frozen=True, slots=True)
class LoadScorer:
    """The load-penalty term: how far an endpoint's load is above the pool's mean."""

    cost: CostModel = field(default_factory=CostModel)
    half_at_s: float = 0.1
    name: str = "load"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        ctx, mean, cost, half = cycle.ctx, cycle.mean_load, self.cost, self.half_at_s
        return [half / (half + c) for c in cost.load_penalty(candidates, ctx, mean)]


@dataclass(frozen=True, slots=True)
class TransferScorer:
    """The transfer term: the KV a prefill endpoint must ship to decode afterwards."""

    cost: CostModel = field(default_factory=CostModel)
    half_at_s: float = 0.05
    name: str = "transfer"

    def __post_init__(self) -> None:
        _check_half(self.name, self.half_at_s)

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        request, cost, half = cycle.request, self.cost, self.half_at_s
        if request.role is not Role.PREFILL:  # only a prefill ships KV afterwards
            return [1.0] * len(candidates)
        return [half / (half + c) for c in cost.transfer_s(request, candidates)]
