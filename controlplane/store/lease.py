"""The two ends of a lease: the holder that keeps it alive, the reaper that ends it.

`EndpointLease` is what a sidecar holds: it numbers heartbeats, registers again (with its
last epoch as the floor, so epochs keep rising even after Redis lost its counter) when the
store no longer knows it, and refuses to write once fenced by a successor. `reap_forever`
removes lapsed leases on a period; an expired endpoint therefore leaves the membership
within its TTL plus one reaper period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from redis.exceptions import RedisError

from controlplane.contract import EndpointState
from controlplane.store.registry import (
    EndpointRegistry,
    FencedError,
    HeartbeatResult,
    HeartbeatStatus,
    Reaped,
)

log = logging.getLogger(__name__)


class EndpointLease:
    """One endpoint's registration, as its sidecar keeps it."""

    def __init__(self, registry: EndpointRegistry, ttl_s: float) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self.endpoint_id = ""
        self.epoch = 0
        self.version = 0
        self.registrations = 0
        self.fenced: FencedError | None = None

    async def register(self, state: EndpointState) -> EndpointState:
        if self.fenced is not None:
            raise self.fenced
        stored = await self.registry.register(state, self.ttl_s, epoch_floor=self.epoch)
        self.endpoint_id, self.epoch, self.version = state.endpoint_id, stored.epoch, 1
        self.registrations += 1
        return stored

    async def beat(self, state: EndpointState) -> HeartbeatResult:
        """Heartbeat `state` under this lease's epoch with the next version.

        Registers again when the store lost the record (Redis restarted, failover lost the
        last writes, the lease expired); raises `FencedError`, now and on every later call,
        once a successor holds the endpoint id.
        """
        if self.fenced is not None:
            raise self.fenced
        if self.epoch == 0:
            return self._registered(await self.register(state))
        attempt = msgspec.structs.replace(state, epoch=self.epoch, version=self.version + 1)
        try:
            result = await self.registry.heartbeat(attempt, self.ttl_s)
        except FencedError as exc:
            self.fenced = exc
            raise
        if result.status is HeartbeatStatus.OK:
            self.version = attempt.version
        elif result.status is HeartbeatStatus.STALE:
            # The store is ahead of us (our earlier beat landed though its reply was lost):
            # continue above what it holds.
            self.version = max(self.version, result.version)
        elif result.must_register:
            log.info("endpoint %s: store answered %s; registering again",
                     state.endpoint_id, result.status)  # fmt: skip
            return self._registered(await self.register(state))
        return result

    @staticmethod
    def _registered(stored: EndpointState) -> HeartbeatResult:
        # A registration reports no lease expiry: the snapshot has it.
        return HeartbeatResult(
            HeartbeatStatus.OK, stored.epoch, stored.version, stored.lifecycle.value, 0
        )

    async def run(self, current_state: Callable[[], EndpointState], period_s: float) -> None:
        """Beat every `period_s` until cancelled or fenced. Redis errors are logged and
        the next beat tries again (the client reconnects with backoff)."""
        while True:
            try:
                await self.beat(current_state())
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(period_s)

    async def release(self) -> bool:
        """Deregister on a clean shutdown (no-op if fenced or never registered)."""
        if self.fenced is not None or self.epoch == 0:
            return False
        return await self.registry.deregister(self.endpoint_id, self.epoch)


async def reap_forever(
    registry: EndpointRegistry,
    period_s: float,
    on_pass: Callable[[Reaped], Awaitable[None] | None] | None = None,
) -> None:
    """Reap expired leases and overrides every `period_s` until cancelled. Any number of
    reapers may run (each removal is atomic); errors are logged and retried next period."""
    while True:
        try:
            reaped = await registry.reap()
            if reaped.endpoints:
                log.info("pool %s: leases expired: %s", registry.pool, ", ".join(reaped.endpoints))
            if on_pass is not None:
                pending = on_pass(reaped)
                if pending is not None:
                    await pending
        except RedisError as exc:
            log.warning("pool %s: reaper pass failed: %s", registry.pool, exc)
        await asyncio.sleep(period_s)
