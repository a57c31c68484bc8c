"""The scheduling framework: filters → weighted scorers → one picker, over a snapshot.

Shaped after the endpoint-picker framework of llm-d's router (pkg/epp): one small
protocol per extension point, scores in [0, 1] with higher meaning better, a weight that
wraps a scorer so the scorer never knows it, a post-decision hook for a plugin that keeps
state of its own (llm-d's PreRequest), and plugins registered by name so a profile is
configuration (`controlplane.routing.registry`). Every method is synchronous and pure
over the `Cycle` it is given; whatever needs I/O (owners, block hashes, quotas) happens
before the pipeline runs. `controlplane.routing.profile` runs the pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from controlplane.routing.snapshot import EndpointView, RouteRequest, RoutingContext

if TYPE_CHECKING:
    from controlplane.routing.cost import CostModel
    from controlplane.routing.prefix_index import PrefixIndex


@dataclass(slots=True)
class Cycle:
    """One routing decision's inputs, with what every plugin would otherwise recompute:
    the prefix holders (endpoint -> leading blocks it probably caches, from the router's
    index), the host-tier holders (endpoint -> leading blocks its engine holds in host
    memory, as it publishes them), the pool's mean load, and the candidates' queue term,
    which several scorers read. Plugins only read it (not frozen because a frozen
    dataclass costs a microsecond more to build, and one is built per decision)."""

    request: RouteRequest
    ctx: RoutingContext
    holders: Mapping[str, int]
    host_holders: Mapping[str, int]
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
    """Keeps the candidates a request may go to at all. `name` is the instance's (a
    profile may hold two of one kind, e.g. bounded loads of two factors): rejections are
    counted by it."""

    name: str

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better. One value per candidate; the
    profile clamps what falls outside (NaN to 0), so one scorer's bad input cannot
    outweigh the others. `name` is the instance's, as for filters."""

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


@runtime_checkable
class PlacementHook(Protocol):
    """A plugin that learns where a request went once that endpoint has it, to keep state
    of its own the next decisions read: the prefix plugin records the prompt's blocks as
    probably cached there. Called by whoever drives the decisions
    (`controlplane.routing.Dispatcher.reached`), never during one."""

    def placed(
        self, request: RouteRequest, endpoint_id: str, prefix_index: PrefixIndex
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight >= 0.0):
            raise ValueError(
                f"scorer {self.scorer.name}: weight must be a finite number >= 0, got {self.weight}"
            )


class DecisionReason:
    """Why the picked endpoint won, as exported in `weir_router_decisions_total`."""

    PRIMARY_OWNER = "primary_owner"
    SECONDARY_OWNER = "secondary_owner"
    LEAST_COST = "least_cost"
    # A migrated continuation resumed where its sidecar had room held for it.
    RESERVED_TARGET = "reserved_target"
    NO_CANDIDATE = "no_candidate"


_NO_REJECTIONS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Decision:
    """The picked endpoint (empty when none is eligible) and the fallbacks in retry
    order: the secondary owner first, then the others by score. `rejected` counts how
    many candidates each filter removed (by the filter's instance name), which names the
    refusal when none is left; `saturated` says that refusal was a saturation filter's
    (room may come back, so the request may wait for it).

    A decision keeps the eligible candidates, their totals and each scorer's column of
    scores as computed, and ranks the fallbacks when first read: the simulator and most
    live requests never retry, so a decision does not pay for the ranking up front, nor
    for an explanation nobody asked for (`Profile.terms`)."""

    endpoint_id: str
    reason: str
    owner_hit: bool
    score: float = 0.0
    rejected: Mapping[str, int] = field(default_factory=lambda: _NO_REJECTIONS)
    saturated: bool = False
    eligible: Sequence[EndpointView] = field(default=(), repr=False, compare=False)
    totals: Sequence[float] = field(default=(), repr=False, compare=False)
    # One column per scorer, in the profile's order, one score per eligible candidate.
    scores: Sequence[Sequence[float]] = field(default=(), repr=False, compare=False)
    chosen: int = field(default=0, repr=False)
    secondary_owner: str = field(default="", repr=False)

    @classmethod
    def of(
        cls,
        request: RouteRequest,
        eligible: Sequence[EndpointView],
        totals: Sequence[float],
        scores: Sequence[Sequence[float]],
        chosen: int,
        rejected: Mapping[str, int] | None,
    ) -> Decision:
        """The decision for `eligible[chosen]`, named by which owner it is, if any."""
        picked = eligible[chosen].endpoint_id
        owners = request.owners
        if picked == request.reserved_target:
            reason = DecisionReason.RESERVED_TARGET
        elif owners and picked == owners[0]:
            reason = DecisionReason.PRIMARY_OWNER
        elif len(owners) > 1 and picked == owners[1]:
            reason = DecisionReason.SECONDARY_OWNER
        else:
            reason = DecisionReason.LEAST_COST
        # A frozen dataclass's __init__ sets each field through object.__setattr__ (about
        # 2 µs for these eleven); one decision is built per request, so its slots are set
        # through their descriptors instead, a third of that. Still frozen to its readers.
        decision = _new(cls)
        (
            s_id, s_reason, s_hit, s_score, s_rejected, s_saturated, s_eligible, s_totals,
            s_scores, s_chosen, s_second,
        ) = _DECISION_SLOTS  # fmt: skip
        s_id(decision, picked)
        s_reason(decision, reason)
        s_hit(decision, reason is DecisionReason.PRIMARY_OWNER)
        s_score(decision, totals[chosen])
        s_rejected(decision, rejected or _NO_REJECTIONS)
        s_saturated(decision, False)
        s_eligible(decision, eligible)
        s_totals(decision, totals)
        s_scores(decision, scores)
        s_chosen(decision, chosen)
        s_second(decision, owners[1] if len(owners) > 1 else "")
        return decision

    @classmethod
    def refused(cls, rejected: Mapping[str, int] | None, saturation: frozenset[str]) -> Decision:
        """No candidate was left: `rejected` names why, and `saturation` (the names of
        the profile's saturation filters) whether the request may wait."""
        rejected = rejected or _NO_REJECTIONS
        return cls(
            "", DecisionReason.NO_CANDIDATE, False, rejected=rejected,
            saturated=_refusal(rejected) in saturation,
        )  # fmt: skip

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
        return _refusal(self.rejected)


def _refusal(rejected: Mapping[str, int]) -> str:
    if not rejected:
        return "no_endpoint"
    return max(rejected.items(), key=lambda item: item[1])[0]


_new = object.__new__
# Each field's slot descriptor setter, in field order (see `Decision.of`).
_DECISION_SLOTS: tuple[Callable[[Decision, object], None], ...] = tuple(
    getattr(Decision, f.name).__set__ for f in fields(Decision)
)
