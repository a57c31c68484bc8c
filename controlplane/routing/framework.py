"""The scheduling framework: filters → weighted scorers → one picker, over a snapshot.

Shaped after the endpoint-picker framework of llm-d's router (pkg/epp): one small
protocol per extension point, scores in [0, 1] with higher meaning better, a weight that
wraps a scorer so the scorer never knows it, and plugins registered by name so a profile
is configuration (`controlplane.routing.registry`). Every method is synchronous and pure
over the `Cycle` it is given; whatever needs I/O (owners, block hashes, quotas) happens
before the pipeline runs.

A decision over a large pool never scans it: the candidates are the request's owners,
the endpoints that probably hold its prefix, and a request-dependent window of the
snapshot's least pressured endpoints (power of k choices over a presorted list).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.routing.snapshot import EndpointView, RouteRequest, RoutingContext


@dataclass(frozen=True, slots=True)
class Cycle:
    """One routing decision's inputs, with what every plugin would otherwise recompute:
    the prefix holders (endpoint -> leading blocks it probably caches) and the pool's
    mean load."""

    request: RouteRequest
    ctx: RoutingContext
    holders: Mapping[str, int]
    mean_load: float


class Filter(Protocol):
    """Keeps the candidates a request may go to at all."""

    name: str

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better. One value per candidate."""

    name: str

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one candidate given the weighted total score of each."""

    name: str

    def pick(
        self, cycle: Cycle, candidates: Sequence[EndpointView], scores: Sequence[float]
    ) -> int: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float

    def __post_init__(self) -> None:
        if not self.weight >= 0.0:  # also rejects NaN
            raise ValueError(f"scorer {self.scorer.name}: weight must be >= 0, got {self.weight}")


class DecisionReason:
    """Why the picked endpoint won, as exported in `weir_router_decisions_total`."""

    PRIMARY_OWNER = "primary_owner"
    SECONDARY_OWNER = "secondary_owner"
    LEAST_COST = "least_cost"
    NO_CANDIDATE = "no_candidate"


@dataclass(frozen=True, slots=True)
class Decision:
    """The picked endpoint (empty when none is eligible) and the fallbacks in retry
    order: the secondary owner first, then the others by score. `rejected` counts how
    many candidates each filter removed, which names the refusal when none is left."""

    endpoint_id: str
    reason: str
    owner_hit: bool
    fallbacks: tuple[str, ...] = ()
    score: float = 0.0
    rejected: Mapping[str, int] = field(default_factory=dict)

    @property
    def refusal(self) -> str:
        """The filter that removed the most candidates: why nothing could be picked."""
        if not self.rejected:
            return "no_endpoint"
        return max(self.rejected.items(), key=lambda item: item[1])[0]


@dataclass(frozen=True, slots=True)
class Profile:
    """A fixed pipeline. `candidates` bounds how many endpoints of the least pressured
    ones a decision looks at besides the owners and the prefix holders."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker
    candidates: int = 4
    max_prefix_holders: int = 4

    def decide(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        snapshot = ctx.snapshot
        holders: Mapping[str, int] = {}
        if ctx.prefix_index is not None and request.block_hashes:
            holders = ctx.prefix_index.holders(request.block_hashes)
        ready = len(snapshot.preferred) or 1
        cycle = Cycle(request, ctx, holders, (snapshot.total_load + ctx.inflight_total) / ready)

        candidates = self._candidates(cycle)
        rejected: dict[str, int] = {}
        for f in self.filters:
            before = len(candidates)
            candidates = f.filter(cycle, candidates)
            if len(candidates) < before:
                rejected[f.name] = before - len(candidates)
            if not candidates:
                return Decision("", DecisionReason.NO_CANDIDATE, False, rejected=rejected)

        weighted = self.scorers
        first = weighted[0]
        totals = [first.weight * x for x in first.scorer.score(cycle, candidates)]
        for ws in weighted[1:]:
            w = ws.weight
            totals = [
                t + w * x for t, x in zip(totals, ws.scorer.score(cycle, candidates), strict=True)
            ]
        chosen = self.picker.pick(cycle, candidates, totals)
        picked = candidates[chosen].endpoint_id

        primary, secondary = request.primary_owner, request.secondary_owner
        ranked = sorted(range(len(candidates)), key=totals.__getitem__, reverse=True)
        fallbacks = [candidates[i].endpoint_id for i in ranked if i != chosen]
        if secondary in fallbacks:
            fallbacks.remove(secondary)
            fallbacks.insert(0, secondary)
        if picked == primary:
            reason = DecisionReason.PRIMARY_OWNER
        elif picked == secondary:
            reason = DecisionReason.SECONDARY_OWNER
        else:
            reason = DecisionReason.LEAST_COST
        return Decision(
            picked, reason, picked == primary, tuple(fallbacks), totals[chosen], rejected
        )

    def _candidates(self, cycle: Cycle) -> list[EndpointView]:
        request, snapshot = cycle.request, cycle.ctx.snapshot
        exclude = request.exclude
        by_id = snapshot.by_id
        if len(snapshot.endpoints) <= self.candidates + len(request.owners):
            owners = [by_id[o] for o in request.owners if o in by_id and o not in exclude]
            rest = [e for e in snapshot.endpoints if e.endpoint_id not in request.owners]
            return owners + [e for e in rest if e.endpoint_id not in exclude]

        seen: set[str] = set(exclude)
        chosen: list[EndpointView] = []
        for endpoint_id in request.owners:
            view = by_id.get(endpoint_id)
            if view is not None and endpoint_id not in seen:
                seen.add(endpoint_id)
                chosen.append(view)
        if cycle.holders:
            best = sorted(cycle.holders.items(), key=lambda item: -item[1])
            for endpoint_id, _ in best[: self.max_prefix_holders]:
                view = by_id.get(endpoint_id)
                if view is not None and endpoint_id not in seen:
                    seen.add(endpoint_id)
                    chosen.append(view)
        preferred = snapshot.preferred
        window = min(len(preferred), 2 * self.candidates)
        start = zlib.crc32(request.request_id.encode()) % window if window else 0
        taken = 0
        for offset in range(window):
            view = preferred[(start + offset) % window]
            if view.endpoint_id in seen:
                continue
            seen.add(view.endpoint_id)
            chosen.append(view)
            taken += 1
            if taken == self.candidates:
                break
        return chosen
