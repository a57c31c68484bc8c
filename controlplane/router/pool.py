"""The router's in-memory view of its pool, and the staleness rule.

The view holds the latest routing snapshot and the local instant it was last confirmed
against the control plane. While the control plane is unreachable the router keeps routing
on the last snapshot until `staleness_s` has passed since that confirmation, then fails
closed: `current` raises a 503 with reason `snapshot_stale` instead of assuming that
endpoints it cannot see are idle. A view that never received a snapshot is stale.

Sources feed it: `static_endpoints` for a fixed list of engine URLs (`weir router
--endpoint`, benchmarks; never stale), and `StoreFeed`, which follows the control plane's
versioned change feed and converts Redis-server-time leases to local deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from controlplane.contract import EndpointState
from controlplane.ownership import OwnershipRing
from controlplane.router.errors import unavailable
from controlplane.routing import EndpointView, PoolSnapshot
from controlplane.store import PoolFollower, StoredPool

log = logging.getLogger(__name__)

OwnerLookup = Callable[[int], tuple[str, ...]]
Listener = Callable[[PoolSnapshot, tuple[EndpointView, ...]], None]


def _no_owners(_key: int) -> tuple[str, ...]:
    return ()


class PoolView:
    def __init__(self, pool: str, staleness_s: float) -> None:
        if not staleness_s > 0:  # also rejects NaN; infinite suits a static pool
            raise ValueError(f"staleness_s must be a positive number, got {staleness_s}")
        self.pool = pool
        self.staleness_s = staleness_s
        self._snapshot = PoolSnapshot(pool, ())
        self.owners: OwnerLookup = _no_owners
        self.confirmed_at = -math.inf
        self.error = "no snapshot received yet"
        self._listeners: list[Listener] = []

    @property
    def snapshot(self) -> PoolSnapshot:
        """The latest snapshot, however stale (status pages, metrics)."""
        return self._snapshot

    def on_change(self, listener: Listener) -> None:
        """Call `listener(snapshot, endpoints that left)` after every update."""
        self._listeners.append(listener)

    def update(
        self, endpoints: Sequence[EndpointView], now: float, *, version: int = 0,
        ring_version: int = 0, owners: OwnerLookup | None = None,
    ) -> PoolSnapshot:  # fmt: skip
        """Install a new snapshot confirmed at local instant `now`."""
        before = self._snapshot.endpoints
        snapshot = PoolSnapshot(
            self.pool, tuple(endpoints), version=version, ring_version=ring_version, taken_at=now
        )
        self._snapshot = snapshot
        self.owners = owners or _no_owners
        self.confirm(now)
        removed = tuple(e for e in before if e.endpoint_id not in snapshot.by_id)
        for listener in self._listeners:
            listener(snapshot, removed)
        return snapshot

    def confirm(self, now: float) -> None:
        """The control plane was read at `now` and nothing changed."""
        self.confirmed_at = now
        self.error = ""

    def failed(self, reason: str) -> None:
        """The control plane could not be read: keep the snapshot, remember why."""
        self.error = reason

    def is_stale(self, now: float) -> bool:
        return now - self.confirmed_at > self.staleness_s

    def current(self, now: float) -> PoolSnapshot:
        if self.is_stale(now):
            raise unavailable(
                "snapshot_stale",
                f"the pool snapshot was last confirmed {now - self.confirmed_at:.1f}s ago "
                f"(bound {self.staleness_s:g}s): {self.error or 'no update'}",
                retry_after_s=1.0,
            )
        return self._snapshot


def new_reports(
    versions: dict[str, int], snapshot: PoolSnapshot, removed: Sequence[EndpointView]
) -> list[str]:
    """The endpoints whose report is new since `versions` last saw them (updated here);
    the endpoints that left are forgotten."""
    fresh = []
    for view in snapshot.endpoints:
        if versions.get(view.endpoint_id) != view.state.version:
            versions[view.endpoint_id] = view.state.version
            fresh.append(view.endpoint_id)
    for view in removed:
        versions.pop(view.endpoint_id, None)
    return fresh


def static_endpoints(
    pool: str, model: str, urls: Sequence[str], *, kv_capacity_tokens: int = 1 << 20
) -> list[EndpointView]:
    """Endpoints for a fixed list of engine URLs: always leased, state never reported."""
    return [
        EndpointView(
            EndpointState(
                pool=pool,
                endpoint_id=f"static-{i}",
                address=url.rstrip("/"),
                model=model,
                kv_capacity_tokens=kv_capacity_tokens,
            ),
            lease_deadline=math.inf,
        )
        for i, url in enumerate(urls)
    ]


def routing_endpoints(store: StoredPool, now: float) -> list[EndpointView]:
    """The store's endpoints with their leases as local deadlines: a lease that lapses
    between two reads takes its endpoint out of routing on time, reaper or not."""
    server_now = store.server_time_ms
    return [
        EndpointView(state, now + (store.lease_expires_ms.get(eid, 0) - server_now) / 1000.0)
        for eid, state in store.endpoints.items()
    ]


class RingOwners:
    """Owners from the consistent-hash ring of the store's membership, plus hot-prefix
    overrides. The ring is rebuilt only when the membership changes, not per heartbeat."""

    def __init__(self, vnodes: int) -> None:
        self.vnodes = vnodes
        self._ring: OwnershipRing | None = None

    def __call__(self, store: StoredPool) -> OwnerLookup:
        membership = store.membership()
        ring = self._ring
        if ring is None or ring.membership != membership:
            ring = self._ring = OwnershipRing(membership, self.vnodes)
        table, now_ms = store.hot_prefixes, store.server_time_ms
        return lambda key: ring.owners_with_overrides(key, table, now_ms)


class StoreFeed:
    """Follows one pool's change feed into a `PoolView`: a full snapshot once, deltas
    after, waking on the feed's blocking read. Every successful read confirms the view;
    failures are recorded and retried every `block_s`, and the view goes stale on its own
    once the bound passes."""

    def __init__(
        self,
        follower: PoolFollower,
        view: PoolView,
        clock: Callable[[], float],
        *,
        block_s: float = 0.5,
        owners_for: Callable[[StoredPool], OwnerLookup] | None = None,
    ) -> None:
        self.follower = follower
        self.view = view
        self.clock = clock
        self.block_s = block_s
        self.owners_for = owners_for

    def apply(self) -> None:
        store = self.follower.snapshot
        now = self.clock()
        self.view.update(
            routing_endpoints(store, now),
            now,
            version=store.position.seq,
            ring_version=store.membership_version,
            owners=self.owners_for(store) if self.owners_for else None,
        )

    async def run(self) -> None:
        first = True
        block_ms = max(1, int(self.block_s * 1000))
        while True:
            try:
                refreshed = await self.follower.refresh()
                if first or refreshed.changed:
                    first = False
                    self.apply()
                else:
                    self.view.confirm(self.clock())
                await self.follower.registry.wait_for_change(self.follower.position, block_ms)
            except (RedisError, OSError) as exc:
                log.warning("pool %s: control plane unreachable (%s)", self.view.pool, exc)
                self.view.failed(f"control plane unreachable: {exc}")
                await asyncio.sleep(self.block_s)
