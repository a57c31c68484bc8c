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

Near-ties can be spread (`Profile.tie_band`, off by default). Several routers serving one pool share one
snapshot, and each counts only its own dispatches until the endpoints report them. Where
candidates score alike (an idle pool; equally loaded endpoints whose KV differs by a
percent or so) the picker's deterministic choice, the first of the highest, sends every
router's next request to the same endpoint: R requests where one router sends one and
spreads the rest. Among the candidates within `tie_band` of the picked one's total and
credited with the same cached prefix, a hash of the request id chooses instead
(randomized tie-breaking, as in Envoy's and llm-d's pickers). The routers' picks
decorrelate; at light load a router's own dispatch (about 0.2 of queue score) still takes
an endpoint out of the band, so one router never doubles up on it while an equal one is
free; no pick trades cached tokens for balance, and a pick of the prefix's primary owner
stands. It does not spread what is not a tie: an endpoint one reported request below the
others still gets one request from every router (docs/architecture.md, "Several routers
per pool"). Pure: a request decides the same way everywhere, the simulator included.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from operator import mul
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from controlplane.routing.snapshot import (
    EndpointView,
    PoolSnapshot,
    RouteRequest,
    RoutingContext,
)

if TYPE_CHECKING:
    from controlplane.routing.cost import CostModel
    from controlplane.routing.fused import FusedPipeline


@dataclass(slots=True)
class Cycle:
    """One routing decision's inputs, with what every plugin would otherwise recompute:
    the prefix holders (endpoint -> leading blocks it probably caches), the pool's mean
    load, and the candidates' queue term, which several scorers read. Plugins only read
    it (not frozen because a frozen dataclass costs a microsecond more to build, and one
    is built per decision)."""

    request: RouteRequest
    ctx: RoutingContext
    holders: Mapping[str, int]
    mean_load: float
    _queues: dict[int, tuple[Sequence[EndpointView], list[float]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def queue_s(self, cost: CostModel, candidates: Sequence[EndpointView]) -> list[float]:
        """`cost.queue_s` of these candidates, computed once per decision and cost model."""
        known = self._queues.get(id(cost))
        if known is not None and known[0] is candidates:
            return known[1]
        queues = cost.queue_s(candidates, self.ctx)
        self._queues[id(cost)] = (candidates, queues)
        return queues


class Filter(Protocol):
    """Keeps the candidates a request may go to at all."""

    name: str

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better. One value per candidate."""

    name: str

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]: ...


FilterFn = Callable[[Cycle, Sequence[EndpointView]], list[EndpointView]]
ScoreFn = Callable[[Cycle, Sequence[EndpointView]], list[float]]


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


_NO_HOLDERS: Mapping[str, int] = MappingProxyType({})
_NO_REJECTIONS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Decision:
    """The picked endpoint (empty when none is eligible) and the fallbacks in retry
    order: the secondary owner first, then the others by score. `rejected` counts how
    many candidates each filter removed, which names the refusal when none is left.

    A decision keeps the eligible candidates and their totals as computed and ranks the
    fallbacks when first read: the simulator and most live requests never retry, so a
    decision does not pay for the ranking up front."""

    endpoint_id: str
    reason: str
    owner_hit: bool
    score: float = 0.0
    rejected: Mapping[str, int] = field(default_factory=lambda: _NO_REJECTIONS)
    eligible: Sequence[EndpointView] = field(default=(), repr=False, compare=False)
    totals: Sequence[float] = field(default=(), repr=False, compare=False)
    chosen: int = field(default=0, repr=False)
    secondary_owner: str = field(default="", repr=False)

    @classmethod
    def of(
        cls,
        request: RouteRequest,
        eligible: Sequence[EndpointView],
        totals: Sequence[float],
        chosen: int,
        rejected: Mapping[str, int] | None,
    ) -> Decision:
        """The decision for `eligible[chosen]`, named by which owner it is, if any."""
        picked = eligible[chosen].endpoint_id
        owners = request.owners
        if owners and picked == owners[0]:
            reason = DecisionReason.PRIMARY_OWNER
        elif len(owners) > 1 and picked == owners[1]:
            reason = DecisionReason.SECONDARY_OWNER
        else:
            reason = DecisionReason.LEAST_COST
        # A frozen dataclass's __init__ sets each field through object.__setattr__ (about
        # 2 µs for these nine); one decision is built per request, so its slots are set
        # through their descriptors instead, a third of that. Still frozen to its readers.
        decision = _new(cls)
        s_id, s_reason, s_hit, s_score, s_rejected, s_eligible, s_totals, s_chosen, s_second = (
            _DECISION_SLOTS
        )
        s_id(decision, picked)
        s_reason(decision, reason)
        s_hit(decision, reason is DecisionReason.PRIMARY_OWNER)
        s_score(decision, totals[chosen])
        s_rejected(decision, rejected or _NO_REJECTIONS)
        s_eligible(decision, eligible)
        s_totals(decision, totals)
        s_chosen(decision, chosen)
        s_second(decision, owners[1] if len(owners) > 1 else "")
        return decision

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The other eligible candidates in retry order: the secondary owner, then by
        score (ties in candidate order, owners first)."""
        chosen, totals, eligible = self.chosen, self.totals, self.eligible
        others = [i for i in range(len(eligible)) if i != chosen]
        others.sort(key=totals.__getitem__, reverse=True)
        order = [eligible[i].endpoint_id for i in others]
        secondary = self.secondary_owner
        if secondary and secondary in order and order[0] != secondary:
            order.remove(secondary)
            order.insert(0, secondary)
        return tuple(order)

    @property
    def refusal(self) -> str:
        """The filter that removed the most candidates: why nothing could be picked."""
        if not self.rejected:
            return "no_endpoint"
        return max(self.rejected.items(), key=lambda item: item[1])[0]


def spread_ties(
    request: RouteRequest,
    candidates: Sequence[EndpointView],
    totals: Sequence[float],
    affinity: Sequence[float] | None,
    chosen: int,
    band: float,
) -> int:
    """Among the candidates whose total is within `band` of `totals[chosen]` and whose
    prefix-affinity score (when the profile has one) equals the chosen one's, the one a
    hash of the request id names; `chosen` itself when it has no such peer, or when it is
    the request's primary owner: the one endpoint every router sends the prefix to stays
    its home, even where a short prompt credits the secondary as fully cached too."""
    if candidates[chosen].endpoint_id == request.primary_owner:
        return chosen
    floor = totals[chosen] - band
    if affinity is None:
        ties = [i for i, total in enumerate(totals) if total >= floor]
    else:
        credit = affinity[chosen]
        ties = [i for i, total in enumerate(totals) if total >= floor and affinity[i] == credit]
    if len(ties) == 1:
        return chosen
    # CRC-32 is linear: ids that differ in one character (a simulator's r1, r2, ...) have
    # related low bits. A multiplicative mix spreads them over the high bits, which pick;
    # the candidate window's rotation uses the low ones.
    mixed = (zlib.crc32(request.request_id.encode()) * _GOLDEN) & 0xFFFFFFFF
    return ties[mixed * len(ties) >> 32]


_GOLDEN = 0x9E3779B1  # 2^32 / the golden ratio, Knuth's multiplicative hash
_AFFINITY = "prefix-affinity"  # the scorer whose equal scores mean equal cached prefixes
_new = object.__new__
# Each field's slot descriptor setter, in field order (see `Decision.of`).
_DECISION_SLOTS: tuple[Callable[[Decision, object], None], ...] = tuple(
    getattr(Decision, f.name).__set__ for f in fields(Decision)
)


# Filters that keep new work off a full endpoint. A resume continues a stream already
# accepted: for it they are preferences, not vetoes (`Profile.decide_resume`).
SATURATION = frozenset({"bounded-load", "watermark-below-critical"})


@dataclass(frozen=True, slots=True)
class Profile:
    """A fixed pipeline. A decision looks at a shortlist, never the whole pool: the
    request's owners, up to `max_prefix_holders` endpoints that probably hold its
    prefix, and `candidates` endpoints from a request-dependent window of the snapshot's
    least pressured ones (power of k choices over a list ranked once per snapshot)."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker
    candidates: int = 4
    max_prefix_holders: int = 4
    # Near-ties within this much total score are spread by the request's hash (0: the
    # picker's pick stands); see the module's docstring.
    tie_band: float = 0.0
    # Bound methods and weights, looked up once per profile instead of per decision.
    _filter_fns: tuple[tuple[str, FilterFn], ...] = field(init=False, repr=False, compare=False)
    _score_fns: tuple[ScoreFn, ...] = field(init=False, repr=False, compare=False)
    _weights: tuple[float, ...] = field(init=False, repr=False, compare=False)
    # Where the prefix-affinity scorer's column is among the scores (-1: none).
    _affinity_at: int = field(init=False, repr=False, compare=False)
    # The plugins fused into one loop when they are all built-ins it reproduces.
    _fused: FusedPipeline | None = field(init=False, repr=False, compare=False)
    # This profile without its saturation filters, for resumes (itself if it has none).
    _for_resumes: Profile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.scorers:
            raise ValueError(f"profile {self.name}: a profile needs at least one scorer")
        if not (math.isfinite(self.tie_band) and self.tie_band >= 0.0):
            raise ValueError(
                f"profile {self.name}: tie_band must be a number >= 0, got {self.tie_band}"
            )
        # Imported here: the fused pipeline is built from the plugins, which import this module.
        from controlplane.routing.fused import fuse

        setattr_ = object.__setattr__
        setattr_(self, "_filter_fns", tuple((f.name, f.filter) for f in self.filters))
        setattr_(self, "_score_fns", tuple(ws.scorer.score for ws in self.scorers))
        setattr_(self, "_weights", tuple(ws.weight for ws in self.scorers))
        names = [ws.scorer.name for ws in self.scorers]
        setattr_(self, "_affinity_at", names.index(_AFFINITY) if _AFFINITY in names else -1)
        setattr_(self, "_fused", fuse(self.filters, self.scorers, self.picker, self.tie_band))
        kept = tuple(f for f in self.filters if f.name not in SATURATION)
        relaxed = self if kept == self.filters else replace(self, filters=kept)
        setattr_(self, "_for_resumes", relaxed)

    @property
    def fused(self) -> bool:
        """Whether decisions run the fused loop rather than the plugins one by one."""
        return self._fused is not None

    def decide(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        holders = _NO_HOLDERS
        if ctx.prefix_index is not None and request.block_hashes:
            holders = ctx.prefix_index.holders(request.block_hashes)
        snapshot = ctx.snapshot
        mean_load = (snapshot.total_load + ctx.inflight_total) / (len(snapshot.preferred) or 1)
        shortlist = self._candidates(request, snapshot, holders)
        fused = self._fused
        if fused is not None:
            return fused.decide(request, ctx, holders, mean_load, shortlist)
        return self._run_plugins(Cycle(request, ctx, holders, mean_load, {}), shortlist)

    def decide_resume(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        """Where a resume goes: the usual decision, or, when only saturation stood in its
        way, the best endpoint the other filters allow. The stream was accepted already;
        refusing it there loses it, while the endpoint's own admission can still queue it
        or recompute elsewhere."""
        decision = self.decide(request, ctx)
        if decision.endpoint_id or not SATURATION.intersection(decision.rejected):
            return decision
        return self._for_resumes.decide(request, ctx)

    def decide_with_plugins(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        """The same decision by running each plugin in turn, fused or not: the reference
        the fused loop is checked against."""
        holders = _NO_HOLDERS
        if ctx.prefix_index is not None and request.block_hashes:
            holders = ctx.prefix_index.holders(request.block_hashes)
        snapshot = ctx.snapshot
        mean_load = (snapshot.total_load + ctx.inflight_total) / (len(snapshot.preferred) or 1)
        cycle = Cycle(request, ctx, holders, mean_load, {})
        return self._run_plugins(cycle, self._candidates(request, snapshot, holders))

    def _run_plugins(self, cycle: Cycle, candidates: list[EndpointView]) -> Decision:
        rejected: dict[str, int] | None = None
        for name, keep in self._filter_fns:
            before = len(candidates)
            candidates = keep(cycle, candidates)
            if len(candidates) < before:
                if rejected is None:
                    rejected = {}
                rejected[name] = before - len(candidates)
        if not candidates:
            return Decision(
                "", DecisionReason.NO_CANDIDATE, False, rejected=rejected or _NO_REJECTIONS
            )

        # One weighted sum per candidate over the scorers' columns, in C (map/sum), rather
        # than one pass over the candidates per scorer.
        weights = self._weights
        scores = [score(cycle, candidates) for score in self._score_fns]
        totals = [sum(map(mul, weights, column)) for column in zip(*scores, strict=True)]
        chosen = self.picker.pick(cycle, candidates, totals)
        if self.tie_band and len(candidates) > 1:
            at = self._affinity_at
            chosen = spread_ties(
                cycle.request, candidates, totals, scores[at] if at >= 0 else None, chosen,
                self.tie_band,
            )  # fmt: skip
        return Decision.of(cycle.request, candidates, totals, chosen, rejected)

    def _candidates(
        self, request: RouteRequest, snapshot: PoolSnapshot, holders: Mapping[str, int]
    ) -> list[EndpointView]:
        exclude, owners = request.exclude, request.owners
        by_id = snapshot.by_id
        if len(snapshot.endpoints) <= self.candidates + len(owners):
            chosen = [by_id[o] for o in owners if o in by_id and o not in exclude]
            chosen += [
                e
                for e in snapshot.endpoints
                if e.endpoint_id not in owners and e.endpoint_id not in exclude
            ]
            return chosen

        seen = set(exclude)
        chosen = []
        for endpoint_id in owners:
            if endpoint_id not in seen and (view := by_id.get(endpoint_id)) is not None:
                seen.add(endpoint_id)
                chosen.append(view)
        if holders:
            # Usually one endpoint holds the prefix: nothing to rank.
            most = self.max_prefix_holders
            best = (
                list(holders)[:most]
                if len(holders) == 1
                else sorted(holders, key=holders.__getitem__, reverse=True)[:most]
            )
            for endpoint_id in best:
                if endpoint_id not in seen and (view := by_id.get(endpoint_id)) is not None:
                    seen.add(endpoint_id)
                    chosen.append(view)
        preferred = snapshot.preferred
        window = min(len(preferred), 2 * self.candidates)
        if not window:
            return chosen
        start = zlib.crc32(request.request_id.encode()) % window
        wanted = len(chosen) + self.candidates
        for i in range(start, start + window):  # the window, rotated to start
            view = preferred[i % window]
            if view.endpoint_id not in seen:
                chosen.append(view)
                if len(chosen) == wanted:
                    break
        return chosen
