"""The router's admission queue: bounded per priority band, fair across tenants by cost.

When every candidate is saturated a request waits here instead of being sent into an
overloaded engine. Bands are served strictly by priority, highest first. Inside a band,
tenants share by KV cost with their weights (`controlplane.rules.fairness`: the tenant
with the smallest virtual counter goes next, a tenant that becomes active in a band is
lifted to the smallest counter active there). The caller charges what it places,
queued or not (`charge`, `pop`), and settles the charge when the request ends.

Each entry has a time to live (`max_wait_s`): past it, `expire` hands it back to be
refused with `overload` and a Retry-After, never silently dropped. Pure: the caller
passes the clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping
from typing import Generic, TypeVar

from controlplane.rules.fairness import VirtualCounters

T = TypeVar("T")


class QueueEntry(Generic[T]):
    """One waiting request. (A plain class, as `_Band`: a generic dataclass does not
    import when mypyc compiles it, as the fleet simulator's `--compiled` does.)"""

    __slots__ = ("enqueued_at", "expires_at", "key", "payload", "priority", "tenant")

    def __init__(
        self,
        key: str,
        tenant: str,
        priority: int,
        enqueued_at: float,
        expires_at: float,
        payload: T,
    ) -> None:
        self.key = key
        self.tenant = tenant
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.expires_at = expires_at
        self.payload = payload

    def __repr__(self) -> str:
        return (
            f"QueueEntry({self.key!r}, tenant={self.tenant!r}, priority={self.priority}, "
            f"expires_at={self.expires_at})"
        )


class QueueFullError(Exception):
    """The request's band is full: refuse it with `overload` and this Retry-After."""

    def __init__(self, priority: int, retry_after_s: float) -> None:
        super().__init__(f"priority band {priority} is full")
        self.priority = priority
        self.retry_after_s = retry_after_s


class _Band(Generic[T]):
    __slots__ = ("size", "tenants")

    def __init__(self) -> None:
        self.tenants: dict[str, deque[QueueEntry[T]]] = {}
        self.size = 0


class FairQueue(Generic[T]):
    def __init__(
        self,
        capacity_per_band: int = 256,
        max_wait_s: float = 30.0,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if capacity_per_band < 1:
            raise ValueError("capacity_per_band must be >= 1")
        if not (math.isfinite(max_wait_s) and max_wait_s > 0):
            raise ValueError("max_wait_s must be a positive number")
        self.capacity_per_band = capacity_per_band
        self.max_wait_s = max_wait_s
        self.counters = VirtualCounters(weights)
        self._bands: dict[int, _Band[T]] = {}
        self._index: dict[str, QueueEntry[T]] = {}
        # Every entry by (expiry, offer order), left in place when it leaves otherwise and
        # skipped when it reaches the top: the next expiry without a scan of the queue.
        self._expiries: list[tuple[float, int, QueueEntry[T]]] = []
        self._offers = itertools.count()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def counter(self, tenant: str) -> float:
        return self.counters.counter(tenant)

    def waiting_at_or_above(self, priority: int) -> bool:
        """Whether anything of this priority or higher waits (a newcomer queues behind)."""
        return any(band.size for p, band in self._bands.items() if p >= priority)

    def offer(
        self,
        key: str,
        tenant: str,
        priority: int,
        now: float,
        payload: T,
        max_wait_s: float | None = None,
    ) -> QueueEntry[T]:
        """Queue a request; `max_wait_s` shortens its time to live (a deadline that comes
        before the queue's own limit)."""
        if key in self._index:
            raise ValueError(f"request {key} is already queued")
        band = self._bands.setdefault(priority, _Band())
        if band.size >= self.capacity_per_band:
            raise QueueFullError(priority, self.retry_after_s(now))
        waiting = band.tenants.get(tenant)
        if waiting is None:
            self.counters.join(tenant, band.tenants)
            waiting = band.tenants[tenant] = deque()
        wait_s = self.max_wait_s if max_wait_s is None else min(max_wait_s, self.max_wait_s)
        entry = QueueEntry(key, tenant, priority, now, now + wait_s, payload)
        waiting.append(entry)
        band.size += 1
        self._index[key] = entry
        if len(self._expiries) > 2 * len(self._index) + 64:  # mostly entries gone
            self._expiries = [x for x in self._expiries if self._queued(x[2])]
            heapq.heapify(self._expiries)
        heapq.heappush(self._expiries, (entry.expires_at, next(self._offers), entry))
        return entry

    def peek(self) -> QueueEntry[T] | None:
        """The entry that goes next: highest band, then the least-served tenant, FIFO."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            if not band.size:
                continue
            counter = self.counters.counter
            tenant = min(band.tenants, key=lambda t: (counter(t), t))
            return band.tenants[tenant][0]
        return None

    def pop(self, cost: float) -> QueueEntry[T] | None:
        """Take the next entry and charge its tenant `cost` for it: what placing it costs,
        known once the caller has decided where it goes."""
        entry = self.peek()
        if entry is not None:
            self._remove(entry)
            self.charge(entry.tenant, cost)
        return entry

    def remove(self, key: str) -> QueueEntry[T] | None:
        """Withdraw a queued request (its client went away); nothing is charged."""
        entry = self._index.get(key)
        if entry is not None:
            self._remove(entry)
        return entry

    def expire(self, now: float) -> list[QueueEntry[T]]:
        """Entries whose time to live has passed, removed from the queue, in the order
        they were offered."""
        expiries, due = self._expiries, []
        while expiries and expiries[0][0] <= now:
            _, order, entry = heapq.heappop(expiries)
            if self._queued(entry):
                due.append((order, entry))
        due.sort(key=lambda pair: pair[0])
        for _, entry in due:
            self._remove(entry)
        return [entry for _, entry in due]

    def charge(self, tenant: str, cost: float) -> None:
        """Add service to a tenant's counter (a placement that did not wait here)."""
        self.counters.charge(tenant, cost)

    def retry_after_s(self, now: float) -> float:
        """When a refused client should come back: when the oldest queued entry would
        have waited its full time, at least one second."""
        oldest = min((e.enqueued_at for e in self._index.values()), default=now)
        return max(1.0, oldest + self.max_wait_s - now)

    def next_expiry(self) -> float | None:
        expiries = self._expiries
        while expiries and not self._queued(expiries[0][2]):
            heapq.heappop(expiries)
        return expiries[0][0] if expiries else None

    def _queued(self, entry: QueueEntry[T]) -> bool:
        """Still waiting here (not taken or withdrawn, nor a later entry of its key)."""
        return self._index.get(entry.key) is entry

    def _remove(self, entry: QueueEntry[T]) -> None:
        band = self._bands[entry.priority]
        waiting = band.tenants[entry.tenant]
        waiting.remove(entry)
        if not waiting:
            del band.tenants[entry.tenant]
        band.size -= 1
        del self._index[entry.key]
