"""A profile: the pipeline that decides where one request goes, by running its plugins.

A decision over a large pool never scans it: the candidates are the request's owners,
the endpoints that probably hold its prefix, and a request-dependent window of the
snapshot's least pressured endpoints (power of k choices over a presorted list). Each
filter then keeps what it allows, each scorer scores every kept candidate (one column
per scorer, clamped to [0, 1]), the weighted sum ranks them and the picker picks.

The plugins are the only implementation of their formulas: every decision runs them,
the simulator's included. Each runs once over the whole shortlist (a column in one list
comprehension, not a call per candidate), so a decision is about a dozen plugin calls.
Until commit 5b2b6b9 a profile of built-ins was compiled instead into one loop that
re-derived every filter and scorer. It decided in about half the instructions; the
plugins' fixed cost, a call and a comprehension each, is about 16 µs a decision on a
quiet core, 2 % of what the router adds to a request's first token and less than that
moves between runs (docs/benchmarks.md, "One routing implementation").

Near-ties can be spread (`Profile.tie_band`, off by default). Several routers serving one
pool share one snapshot, and each counts only its own dispatches until the endpoints
report them. Where candidates score alike (an idle pool; equally loaded endpoints whose
KV differs by a percent or so) the picker's deterministic choice, the first of the
highest, sends every router's next request to the same endpoint: R requests where one
router sends one and spreads the rest. Among the candidates within `tie_band` of the
picked one's total and credited with the same cached prefix, a hash of the request id
chooses instead (randomized tie-breaking, as in Envoy's and llm-d's pickers). The
routers' picks decorrelate; at light load a router's own dispatch (about 0.2 of queue
score) still takes an endpoint out of the band, so one router never doubles up on it
while an equal one is free; no pick trades cached tokens for balance, and a pick of the
prefix's primary owner stands. It does not spread what is not a tie: an endpoint one
reported request below the others still gets one request from every router
(docs/architecture.md, "Several routers per pool"). Pure: a request decides the same way
everywhere, the simulator included.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import mul
from types import MappingProxyType

from controlplane.routing.filters import BoundedLoad, WatermarkBelowCritical
from controlplane.routing.framework import (
    Cycle,
    Decision,
    Filter,
    FilterFn,
    Picker,
    PlacementHook,
    ScoreFn,
    WeightedScorer,
)
from controlplane.routing.prefix_index import PrefixIndex
from controlplane.routing.scorers import PrefixAffinity
from controlplane.routing.snapshot import (
    EndpointView,
    PoolSnapshot,
    RouteRequest,
    RoutingContext,
)

# Filters that keep new work off a full endpoint: a request they refuse may wait for room,
# and a resume, which continues a stream already accepted, takes them as preferences, not
# vetoes (`Profile.decide_resume`).
SATURATION: tuple[type, ...] = (WatermarkBelowCritical, BoundedLoad)

_NO_HOLDERS: Mapping[str, int] = MappingProxyType({})


def _bounded(scores: list[list[float]]) -> bool:
    """Whether every score is within [0, 1] (and none is NaN). A loop, because each call
    of `min` or `max` costs more than comparing a dozen scores."""
    for column in scores:
        for score in column:
            if not 0.0 <= score <= 1.0:
                return False
    return True


def clamp(score: float) -> float:
    """A score within [0, 1]: what a scorer returns outside it counts as its bound, and
    NaN as 0, so no scorer's bad input can outweigh the others (llm-d's framework clamps
    alike)."""
    if score >= 0.0:
        return score if score <= 1.0 else 1.0
    return 0.0  # negative, or NaN


@dataclass(frozen=True, slots=True)
class Profile:
    """A fixed pipeline. A decision looks at a shortlist, never the whole pool: the
    request's owners, up to `max_prefix_holders` endpoints that probably hold its
    prefix, and `candidates` endpoints from a request-dependent window of the snapshot's
    least pressured ones (power of k choices over a list ranked once per snapshot), a
    window twice `candidates` wide plus one endpoint for each request this router sent
    since the endpoints' last reports (the ranking grows staler with each).
    Plugins are named per instance, so no two filters and no two scorers share a name."""

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
    _pick: Callable[[Cycle, Sequence[EndpointView], Sequence[float]], int] = field(
        init=False, repr=False, compare=False
    )
    # Where the prefix-affinity scorer's column is among the scores (-1: none).
    _affinity_at: int = field(init=False, repr=False, compare=False)
    # The names of the saturation filters among this profile's.
    _saturation: frozenset[str] = field(init=False, repr=False, compare=False)
    # The plugins' post-decision hooks.
    _hooks: tuple[PlacementHook, ...] = field(init=False, repr=False, compare=False)
    # This profile without its saturation filters, for resumes (itself if it has none).
    _for_resumes: Profile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.scorers:
            raise ValueError(f"profile {self.name}: a profile needs at least one scorer")
        if not (math.isfinite(self.tie_band) and self.tie_band >= 0.0):
            raise ValueError(
                f"profile {self.name}: tie_band must be a number >= 0, got {self.tie_band}"
            )
        scorers = [ws.scorer for ws in self.scorers]
        for kind, named in (("filter", self.filters), ("scorer", scorers)):
            names = [p.name for p in named]
            if repeated := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(
                    f"profile {self.name}: two {kind}s are named {repeated[0]!r}; "
                    "give each instance a name of its own"
                )
        setattr_ = object.__setattr__
        setattr_(self, "_filter_fns", tuple((f.name, f.filter) for f in self.filters))
        setattr_(self, "_score_fns", tuple(scorer.score for scorer in scorers))
        setattr_(self, "_weights", tuple(ws.weight for ws in self.scorers))
        setattr_(self, "_pick", self.picker.pick)
        affinity = [i for i, scorer in enumerate(scorers) if isinstance(scorer, PrefixAffinity)]
        setattr_(self, "_affinity_at", affinity[0] if affinity else -1)
        saturation = frozenset(f.name for f in self.filters if isinstance(f, SATURATION))
        setattr_(self, "_saturation", saturation)
        plugins: tuple[object, ...] = (*self.filters, *scorers, self.picker)
        setattr_(self, "_hooks", tuple(p for p in plugins if isinstance(p, PlacementHook)))
        kept = tuple(f for f in self.filters if f.name not in saturation)
        relaxed = self if kept == self.filters else replace(self, filters=kept)
        setattr_(self, "_for_resumes", relaxed)

    def decide(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        snapshot = ctx.snapshot
        holders = host_holders = _NO_HOLDERS
        if request.block_hashes:
            if ctx.prefix_index is not None:
                holders = ctx.prefix_index.holders(request.block_hashes)
            host_holders = snapshot.host_holders(request.block_hashes)
        mean_load = (snapshot.total_load + ctx.inflight_total) / (len(snapshot.preferred) or 1)
        candidates = self._candidates(request, snapshot, holders, host_holders, ctx.inflight_total)
        cycle = Cycle(request, ctx, holders, host_holders, mean_load, {})

        rejected: dict[str, int] | None = None
        for name, keep in self._filter_fns:
            before = len(candidates)
            candidates = keep(cycle, candidates)
            if len(candidates) < before:
                if rejected is None:
                    rejected = {}
                rejected[name] = before - len(candidates)
        if not candidates:
            return Decision.refused(rejected, self._saturation)

        scores = [score(cycle, candidates) for score in self._score_fns]
        if not _bounded(scores):
            scores = [[clamp(score) for score in column] for column in scores]
        # One weighted sum per candidate over the scorers' columns, in C (map/sum), rather
        # than one pass over the candidates per scorer.
        weights = self._weights
        totals = [sum(map(mul, weights, row)) for row in zip(*scores, strict=True)]
        chosen = self._pick(cycle, candidates, totals)
        if self.tie_band and len(candidates) > 1:
            at = self._affinity_at
            affinity = scores[at] if at >= 0 else None
            chosen = spread_ties(request, candidates, totals, affinity, chosen, self.tie_band)
        return Decision.of(request, candidates, totals, scores, chosen, rejected)

    def decide_resume(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        """Where a resume goes: the usual decision, or, when only saturation stood in its
        way, the best endpoint the other filters allow. The stream was accepted already;
        refusing it there loses it, while the endpoint's own admission can still queue it
        or recompute elsewhere."""
        decision = self.decide(request, ctx)
        if decision.endpoint_id or not self._saturation.intersection(decision.rejected):
            return decision
        return self._for_resumes.decide(request, ctx)

    def placed(self, request: RouteRequest, endpoint_id: str, prefix_index: PrefixIndex) -> None:
        """The request reached `endpoint_id`: the plugins' post-decision hooks learn it."""
        for hook in self._hooks:
            hook.placed(request, endpoint_id, prefix_index)

    def terms(self, decision: Decision) -> dict[str, dict[str, float]]:
        """Each eligible candidate's weighted terms by scorer (weight times its clamped
        score), which add up to the candidate's total: why the pick won, for a request's
        trail. Computed only when asked for, from the columns the decision kept."""
        names = [ws.scorer.name for ws in self.scorers]
        weights = self._weights
        return {
            view.endpoint_id: dict(zip(names, map(mul, weights, row), strict=True))
            for view, row in zip(decision.eligible, zip(*decision.scores, strict=True), strict=True)
        }

    def _candidates(
        self,
        request: RouteRequest,
        snapshot: PoolSnapshot,
        holders: Mapping[str, int],
        host_holders: Mapping[str, int],
        sent_since: int = 0,
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
        if host_holders:  # an endpoint holding the prefix in host memory is one too
            holders = dict(holders)
            for endpoint_id, blocks in host_holders.items():
                holders[endpoint_id] = max(blocks, holders.get(endpoint_id, 0))
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
        # The ranking is as of the endpoints' last reports; each request sent since makes
        # it staler, so the window widens by one endpoint for each. Otherwise a fast pool
        # sends everything between two heartbeats into the same few endpoints.
        window = min(len(preferred), 2 * self.candidates + sent_since)
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
