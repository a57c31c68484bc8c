"""A reader's in-memory view of a pool, kept current from the change feed.

A router takes one full snapshot, then applies deltas: the cost of a refresh is
proportional to what changed, not to the pool. A gap (the feed was trimmed past the
view's position, or Redis lost the pool and started a new incarnation) is never papered
over: the follower takes a new full snapshot. If Redis is unreachable the view stays as it
was; `snapshot.server_time_ms` then keeps advancing on the local monotonic clock from the
last server reading, so callers can bound how stale a view they route on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from types import MappingProxyType

from redis.exceptions import RedisError

from controlplane.contract import EndpointState
from controlplane.ownership import HotPrefixOverride, HotPrefixTable
from controlplane.store.registry import EndpointRegistry
from controlplane.store.snapshot import Change, ChangeKind, FeedPosition, StoredPool

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Refresh:
    """What one `refresh()` did: deltas applied, or a full resync."""

    applied: int
    resynced: bool

    @property
    def changed(self) -> bool:
        return self.resynced or self.applied > 0


class PoolFollower:
    """Keeps `snapshot` equal to the pool in Redis as of the last refresh."""

    def __init__(self, registry: EndpointRegistry, *, batch: int = 1000) -> None:
        self.registry = registry
        self.batch = batch
        self._position = FeedPosition()
        self._membership_version = 0
        self._endpoints: dict[str, EndpointState] = {}
        self._leases: dict[str, int] = {}
        self._hot: dict[int, HotPrefixOverride] = {}
        self._hot_version = 0
        self._server_ms = 0
        self._read_at = time.monotonic()
        self._synced = False
        self._cached: StoredPool | None = None

    @property
    def position(self) -> FeedPosition:
        return self._position

    @property
    def snapshot(self) -> StoredPool:
        """An immutable copy of the view (rebuilt only after something changed)."""
        if self._cached is None:
            self._cached = StoredPool(
                pool=self.registry.pool,
                position=self._position,
                membership_version=self._membership_version,
                endpoints=MappingProxyType(dict(self._endpoints)),
                lease_expires_ms=MappingProxyType(dict(self._leases)),
                hot_prefixes=HotPrefixTable(self._hot_version, MappingProxyType(dict(self._hot))),
                server_time_ms=self._server_ms,
            )
        server_ms = self._server_ms + int((time.monotonic() - self._read_at) * 1000)
        if server_ms == self._cached.server_time_ms:
            return self._cached
        return dataclasses.replace(self._cached, server_time_ms=server_ms)

    async def refresh(self) -> Refresh:
        """Bring the view up to date: deltas when possible, a full snapshot when not."""
        if not self._synced:
            await self._resync()
            return Refresh(0, True)
        applied = 0
        while True:
            batch = await self.registry.changes(self._position, self.batch)
            if batch.resync:
                log.info("pool %s: change feed gap after %s; resynchronising",
                         self.registry.pool, self._position)  # fmt: skip
                await self._resync()
                return Refresh(applied, True)
            self._mark_read(batch.server_time_ms)
            for change in batch.changes:
                self._apply(change)
            applied += len(batch.changes)
            self._position = batch.position
            if batch.changes:
                self._cached = None
            if not batch.more:
                return Refresh(applied, False)

    async def watch(self, block_s: float = 1.0) -> AsyncGenerator[StoredPool, None]:
        """Yield the snapshot now and after every change, waiting on the feed in between.

        Redis errors are logged and retried after `block_s`. If Redis is unreachable at
        the start, the last view (if there is one) is yielded anyway: routing goes on
        from it, and its `server_time_ms` keeps advancing so staleness stays measurable.
        """
        block_ms = max(1, int(block_s * 1000))
        first = True
        while True:
            try:
                changed = (await self.refresh()).changed
                reachable = True
            except (RedisError, OSError) as exc:
                log.warning("pool %s: cannot refresh (%s); keeping the last view",
                            self.registry.pool, exc)  # fmt: skip
                changed, reachable = False, False
            if self._synced and (first or changed):
                first = False
                yield self.snapshot
                continue
            if not reachable:
                await asyncio.sleep(block_s)
                continue
            try:
                await self.registry.wait_for_change(self._position, block_ms)
            except (RedisError, OSError) as exc:
                log.warning("pool %s: cannot wait for changes (%s)", self.registry.pool, exc)
                await asyncio.sleep(block_s)

    async def _resync(self) -> None:
        snap = await self.registry.snapshot()
        self._endpoints = dict(snap.endpoints)
        self._leases = dict(snap.lease_expires_ms)
        self._hot = dict(snap.hot_prefixes.overrides)
        self._hot_version = snap.hot_prefixes.version
        self._membership_version = snap.membership_version
        self._position = snap.position
        self._mark_read(snap.server_time_ms)
        self._synced = True
        self._cached = None

    def _mark_read(self, server_ms: int) -> None:
        self._server_ms = server_ms
        self._read_at = time.monotonic()

    def _apply(self, change: Change) -> None:
        if change.membership_version is not None:
            self._membership_version = change.membership_version
        if change.kind is ChangeKind.UPSERT and change.endpoint is not None:
            self._endpoints[change.key] = change.endpoint
            self._leases[change.key] = change.lease_expires_ms
        elif change.kind in (ChangeKind.UPSERT, ChangeKind.GONE):
            self._endpoints.pop(change.key, None)
            self._leases.pop(change.key, None)
        elif change.kind is ChangeKind.HOT_SET:
            self._hot_version = change.hot_version
            if change.hot is not None:
                self._hot[change.hot.key] = change.hot
            else:
                self._hot.pop(int(change.key), None)
        else:
            self._hot_version = change.hot_version
            self._hot.pop(int(change.key), None)
