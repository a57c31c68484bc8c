"""The router's immutable view of one pool, and of what the router itself has in flight.

A routing decision reads only a `PoolSnapshot` and a `RouteRequest`: both are frozen, so
the same pipeline runs live (the router rebuilds the snapshot when the control plane's
change feed moves) and inside the fleet simulator on a virtual clock.

Liveness is explicit: each endpoint carries the local-clock instant its lease lapses
unless renewed (`lease_deadline`), so a lapsed lease takes an endpoint out of routing even
before the control plane's reaper publishes its removal. An endpoint the snapshot does not
list is unknown, never idle.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Protocol

from controlplane.contract import EndpointState, Lifecycle, Role

_NO_INFLIGHT: Mapping[str, int] = MappingProxyType({})
_NONE_HELD: Mapping[str, int] = MappingProxyType({})
_NO_TIPS: Mapping[int, tuple[str, ...]] = MappingProxyType({})

# Where a routable endpoint ranks in `PoolSnapshot.preferred`: watermark, KV pressure,
# reported load, then its position among the snapshot's endpoints (the stable sort's
# tie-break), so that every key is distinct and a bisection finds an endpoint's place.
_RankKey = tuple[int, float, int, int]


def _rank_key(view: EndpointView, position: int) -> _RankKey:
    return (view.watermark_rank, view.state.kv_pressure, view.reported_load, position)


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One endpoint as the router sees it: its last reported state plus lease timing.

    The derived fields are computed once per snapshot because every decision reads them
    for every candidate, and a flat slot read is the cheapest read Python has:
    `routable` (ready, not draining), `watermark_rank`, the load it reported, its
    committed KV (used plus reserved growth), and the state fields the cost model reads.
    """

    state: EndpointState
    lease_deadline: float
    endpoint_id: str = field(init=False)
    routable: bool = field(init=False)
    watermark_rank: int = field(init=False)
    reported_load: int = field(init=False)
    kv_committed_tokens: int = field(init=False)
    kv_capacity_tokens: int = field(init=False)
    queued_requests: int = field(init=False)
    waiting_prefill_tokens: int = field(init=False)
    predicted_ttft_s: float = field(init=False)
    predicted_tpot_s: float = field(init=False)
    prefill_s_per_token: float = field(init=False)
    is_prefill: bool = field(init=False)

    def __post_init__(self) -> None:
        # Through the slots' own setters, not object.__setattr__ (which looks each name
        # up first): about half the time, and a view is built at every report a router
        # reads (hundreds a second in a large fleet, or its simulation).
        s = self.state
        (
            s_id, s_routable, s_rank, s_load, s_committed, s_capacity, s_queued, s_waiting,
            s_ttft, s_tpot, s_prefill, s_is_prefill,
        ) = _VIEW_DERIVED  # fmt: skip
        s_id(self, s.endpoint_id)
        s_routable(self, s.lifecycle is Lifecycle.READY)
        s_rank(self, s.watermark.rank)
        s_load(self, s.running_requests + s.queued_requests)
        s_committed(self, s.kv_used_tokens + s.kv_reserved_growth_tokens)
        s_capacity(self, s.kv_capacity_tokens)
        s_queued(self, s.queued_requests)
        s_waiting(self, s.waiting_prefill_tokens)
        s_ttft(self, s.predicted_ttft_s)
        s_tpot(self, s.predicted_tpot_s)
        s_prefill(self, s.predicted_prefill_s_per_token)
        s_is_prefill(self, s.role is Role.PREFILL)


# The derived fields' slot setters, in field order (see `EndpointView.__post_init__`).
_VIEW_DERIVED: tuple[Callable[[EndpointView, object], None], ...] = tuple(
    getattr(EndpointView, f.name).__set__ for f in fields(EndpointView) if not f.init
)


def _host_tips(ready: Iterable[EndpointView]) -> Mapping[int, tuple[str, ...]]:
    tips: dict[int, tuple[str, ...]] = {}
    for e in ready:
        for tip in e.state.host_prefixes:
            tips[tip] = (*tips.get(tip, ()), e.endpoint_id)
    return MappingProxyType(tips) if tips else _NO_TIPS


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Every endpoint of a pool the router knows about, at one control-plane version.

    `version` is the change-feed version the snapshot reflects and `ring_version` the
    membership version owners were computed from. `taken_at` and `fresh_until` are
    local-clock instants: past `fresh_until` the snapshot is too stale to route on.
    """

    pool: str
    endpoints: tuple[EndpointView, ...]
    version: int = 0
    ring_version: int = 0
    taken_at: float = 0.0
    fresh_until: float = float("inf")
    by_id: MappingProxyType[str, EndpointView] = field(init=False, repr=False, compare=False)
    preferred: tuple[EndpointView, ...] = field(init=False, repr=False, compare=False)
    total_load: int = field(init=False, repr=False, compare=False)
    # Host-tier prefix -> the routable endpoints that publish it (EndpointState.
    # host_prefixes), indexed once per snapshot so a decision looks its blocks up.
    host_tips: Mapping[int, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    # Endpoint id -> its index in `endpoints`, and `preferred`'s rank keys in its order:
    # what `replacing` needs to move one endpoint without ranking them all again.
    _positions: Mapping[str, int] = field(init=False, repr=False, compare=False)
    _rank_keys: tuple[_RankKey, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "by_id", MappingProxyType({e.endpoint_id: e for e in self.endpoints}))
        setattr_(self, "_positions", {e.endpoint_id: i for i, e in enumerate(self.endpoints)})
        # Ranked once per snapshot, not per request: a decision over a 1,000-endpoint pool
        # looks at the owners, the prefix holders and a few of the least pressured
        # endpoints, never at all of them.
        ranked = sorted((_rank_key(e, i), e) for i, e in enumerate(self.endpoints) if e.routable)
        setattr_(self, "_rank_keys", tuple(key for key, _ in ranked))
        ready = tuple(e for _, e in ranked)
        setattr_(self, "preferred", ready)
        setattr_(self, "total_load", sum(e.reported_load for e in ready))
        setattr_(self, "host_tips", _host_tips(ready))

    def replacing(self, views: Iterable[EndpointView], *, taken_at: float) -> PoolSnapshot:
        """This snapshot with each of `views` in place of its endpoint's view (appended
        when the pool did not list it), in order, exactly as a snapshot built from the
        new endpoints would be, at `taken_at`. A report changes one endpoint: moving it
        in the ranking is a bisection and a few copies in C, where ranking the pool again
        sorts every endpoint, and a fleet of hundreds reports hundreds of times a second
        (the simulator moves all the reports since the router last looked at once: the
        copies are then made once for all of them)."""
        setattr_ = object.__setattr__
        derived = object.__new__(PoolSnapshot)
        endpoints = list(self.endpoints)
        positions = self._positions
        keys, preferred = list(self._rank_keys), list(self.preferred)
        total_load = self.total_load
        by_id = self.by_id.copy()  # the proxied dict's own copy: dict(proxy) goes key by key
        tips = self.host_tips
        tips_moved = False
        for view in views:
            endpoint_id = view.endpoint_id
            old = by_id.get(endpoint_id)
            if old is None:
                position = len(endpoints)
                endpoints.append(view)
                positions = {**positions, endpoint_id: position}
            else:
                position = positions[endpoint_id]
                endpoints[position] = view
            if old is not None and old.routable:
                at = bisect_left(keys, _rank_key(old, position))
                del keys[at], preferred[at]
                total_load -= old.reported_load
            if view.routable:
                key = _rank_key(view, position)
                at = bisect_left(keys, key)
                keys.insert(at, key)
                preferred.insert(at, view)
                total_load += view.reported_load
            by_id[endpoint_id] = view
            if view.state.host_prefixes or (old is not None and old.state.host_prefixes):
                tips_moved = True
        if tips_moved:
            tips = _host_tips(preferred)
        for name, value in (
            ("pool", self.pool),
            ("endpoints", tuple(endpoints)),
            ("version", self.version),
            ("ring_version", self.ring_version),
            ("taken_at", taken_at),
            ("fresh_until", self.fresh_until),
            ("by_id", MappingProxyType(by_id)),
            ("preferred", tuple(preferred)),
            ("total_load", total_load),
            ("host_tips", tips),
            ("_positions", positions),
            ("_rank_keys", tuple(keys)),
        ):
            setattr_(derived, name, value)
        return derived

    @classmethod
    def of(
        cls,
        pool: str,
        states: Iterable[EndpointState],
        *,
        lease_deadline: float = float("inf"),
        **kwargs: float | int,
    ) -> PoolSnapshot:
        """A snapshot whose endpoints all share one lease deadline (tests, simulator)."""
        views = tuple(EndpointView(state, lease_deadline) for state in states)
        return cls(pool, views, **kwargs)  # type: ignore[arg-type]

    def is_stale(self, now: float) -> bool:
        return now > self.fresh_until

    def host_holders(self, block_hashes: tuple[int, ...]) -> Mapping[str, int]:
        """Endpoint id -> how many leading blocks of the prompt it holds in its host tier:
        the deepest of the prompt's blocks an endpoint publishes as a host prefix (chained
        hashes: that block's prefix is all of the blocks before it)."""
        tips = self.host_tips
        if not tips:
            return _NONE_HELD
        held: dict[str, int] = {}
        for position, block in enumerate(block_hashes, start=1):
            for endpoint_id in tips.get(block, ()):
                held[endpoint_id] = position
        return held


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs to know about one request, prepared before the pipeline runs.

    `block_hashes` are the prompt's chained block hashes (seeded by the cache identity) and
    `owners` the consistent-hash owners of its prefix key, primary first: both come from
    `controlplane.ownership` in the router's prepare step, so the pipeline stays pure.
    `deadline_s` is the time budget left (0 = none); `waited_s` how long the request has
    already queued in the router. `reserved_target` is the endpoint holding room for a
    migrated stream's continuation, where its resume is tried first.
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_new_tokens: int
    tenant: str = ""
    adapter: str = ""
    role: Role = Role.MIXED
    priority: int = 0
    deadline_s: float = 0.0
    waited_s: float = 0.0
    block_hashes: tuple[int, ...] = ()
    owners: tuple[str, ...] = ()
    exclude: frozenset[str] = frozenset()
    reserved_target: str = ""

    @property
    def primary_owner(self) -> str:
        return self.owners[0] if self.owners else ""

    @property
    def secondary_owner(self) -> str:
        return self.owners[1] if len(self.owners) > 1 else ""


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """Everything one decision may read besides the request: the snapshot, the instant,
    the router's own in-flight count per endpoint (requests it dispatched that the
    endpoint's next heartbeat will not yet show) and the approximate prefix index."""

    snapshot: PoolSnapshot
    now: float
    inflight: Mapping[str, int] = field(default_factory=lambda: _NO_INFLIGHT)
    inflight_total: int = 0
    prefix_index: PrefixLookup | None = None

    def load(self, view: EndpointView) -> int:
        """Requests on an endpoint: what it reported plus what this router sent since."""
        return view.reported_load + self.inflight.get(view.endpoint_id, 0)


class PrefixLookup(Protocol):
    """Read side of the approximate prefix index (see `controlplane.routing.prefix_index`)."""

    def holders(self, block_hashes: tuple[int, ...]) -> Mapping[str, int]:
        """Endpoint id -> how many leading blocks of the prompt it probably holds."""
        ...
