"""The sidecar's link to the control plane: registration, fenced heartbeats that publish
its `EndpointState`, the command channel (executed at most once, acknowledged), the KV
quota holder lease, drain and deregistration.

A heartbeat goes out every `heartbeat_s`, and at once when the ledger reports a change
that matters (watermark state, or KV moved by 1 % of capacity), so routers see pressure
within one Redis round trip rather than one heartbeat period. Redis being unreachable
does not stop the sidecar (soft on control): local admission keeps working on its own
accounting, and the link keeps retrying.

Relief's migrations go through the link too: the peers a continuation may move to, as
the pool last published them (`peers`), and the reservation of room at the one chosen
(`reserve`, that peer's `POST /weir/v1/reserve`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable

import msgspec
from redis.exceptions import RedisError

from controlplane.contract import (
    EndpointState,
    Lifecycle,
    Role,
    RoomReservation,
    SchemaError,
    decode_json,
    encode_json,
)
from controlplane.store import (
    EndpointLease,
    EndpointRegistry,
    FencedError,
    RedisClient,
    cancel_loops,
)
from controlplane.store.commands import CommandChannel
from controlplane.store.quotas import QuotaStore
from controlplane.transport.http import HTTPClient, TransportError
from engine_sidecar.quota import KVQuota
from engine_sidecar.service import RESERVE_PATH, SidecarService

log = logging.getLogger("weir.sidecar.control")


class _Refusal(msgspec.Struct):
    room_tokens: int = 0


class _NoRoom(msgspec.Struct):
    """A target's 409 `no_room`: the room it has."""

    error: _Refusal


class ControlLink:
    def __init__(
        self,
        service: SidecarService,
        redis: RedisClient,
        pool: str,
        endpoint_id: str,
        address: str,
        heartbeat_s: float,
        lease_ttl_s: float,
        admin_token: str = "",
    ) -> None:
        self.service = service
        self.redis = redis
        self.registry = EndpointRegistry(redis, pool)
        self.lease = EndpointLease(self.registry, lease_ttl_s)
        self.pool, self.endpoint_id, self.address = pool, endpoint_id, address
        self.heartbeat_s = heartbeat_s
        self.started_at = time.time()
        self.lease_ttl_s = lease_ttl_s
        self.quota = KVQuota(
            QuotaStore(redis, pool),
            service.ledger,
            f"sidecar.{endpoint_id}",
            lease_ttl_s,
            service.metrics,
        )
        service.quota = self.quota
        service.actions.link = self  # ordered migrations hold room at a peer first
        self.commands = CommandChannel(redis, pool)
        self._executed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._room_unknown_until = 0.0  # relief's room reads paused until then (monotonic)
        # Reservations at migration targets: the pool's sidecars share one admin token.
        self.admin_token = admin_token
        self._peers_http = HTTPClient(connect_timeout_s=heartbeat_s, read_timeout_s=heartbeat_s)
        self._heartbeat: asyncio.Task[None] | None = None
        self._commands: asyncio.Task[None] | None = None
        self._closing = False
        self._last_preemptions = 0
        self._last_beat = time.monotonic()

    def state(self) -> EndpointState:
        """This endpoint as it is now (the lease fills in epoch and version)."""
        service, ledger = self.service, self.service.ledger
        now = time.monotonic()
        elapsed = max(1e-3, now - self._last_beat)
        preemptions_per_s = (ledger.preemptions - self._last_preemptions) / elapsed
        self._last_preemptions, self._last_beat = ledger.preemptions, now
        forecast = ledger.latency.forecast(ledger.load())
        return EndpointState(
            pool=self.pool,
            endpoint_id=self.endpoint_id,
            address=self.address,
            model=service.limits.model,
            role=service.policy.role,
            bootstrap_port=service.info.bootstrap_port
            if service.policy.role is Role.PREFILL
            else 0,
            lifecycle=Lifecycle.DRAINING if service.draining else Lifecycle.READY,
            watermark=ledger.watermark,
            page_size=service.info.page_size,
            kv_capacity_tokens=ledger.capacity_tokens,
            kv_used_tokens=ledger.used_tokens,
            # Room held for migrating continuations is committed like reserved growth:
            # routers and peers must not count on it.
            kv_reserved_growth_tokens=ledger.reserved + ledger.held_tokens,
            kv_growth_tokens_per_s=max(0.0, ledger.growth.tokens_per_s),
            waiting_prefill_tokens=ledger.waiting_prefill,
            running_requests=ledger.running,
            queued_requests=ledger.queued,
            preemptions_per_s=preemptions_per_s,
            predicted_ttft_s=forecast.wait_s,
            predicted_tpot_s=forecast.tpot_s,
            predicted_prefill_s_per_token=forecast.prefill_s_per_token,
            host_prefixes=service.host_prefixes.published(),
            started_at=self.started_at,
            updated_at=time.time(),
        )

    async def beat(self) -> None:
        """One heartbeat (the lease registers first when needed), with its metric."""
        metrics = self.service.metrics
        ledger = self.service.ledger
        changed_at = ledger.changed_at
        ledger.changed.clear()
        ledger.changed_at = None
        own_used = ledger.own_used
        try:
            await self.lease.beat(self.state())
            ledger.published(own_used)
            await self.quota.renew()
            await self.quota.refresh_tenants()
            await self.quota.retry_releases()
        except FencedError as exc:
            metrics.count("weir_sidecar_heartbeats_total", "fenced")
            log.error("%s; this sidecar stops publishing", exc)
            return
        except (RedisError, OSError, SchemaError) as exc:
            metrics.count("weir_sidecar_heartbeats_total", "error")
            log.warning("heartbeat failed: %s", exc)
            if ledger.changed_at is None:
                ledger.changed_at = changed_at
            return
        metrics.count("weir_sidecar_heartbeats_total", "ok")
        if changed_at is not None:
            delay = ledger.clock() - changed_at
            metrics.observe("weir_sidecar_state_publish_delay_seconds", delay)

    async def _run(self) -> None:
        changed = self.service.ledger.changed
        while self.lease.fenced is None and not self._closing:
            await self.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=self.heartbeat_s)

    async def _run_commands(self) -> None:
        """Execute this endpoint's commands at most once each, acknowledging them."""
        while self.lease.fenced is None:
            try:
                deliveries = await self.commands.receive(
                    self.endpoint_id, self.endpoint_id, block_s=self.heartbeat_s
                )
                for delivery in deliveries:
                    command = delivery.command
                    if command.command_id not in self._executed:
                        self._executed[command.command_id] = None
                        if len(self._executed) > 10_000:
                            self._executed.popitem(last=False)
                        done = command.endpoint_id == self.endpoint_id and (
                            await self.service.execute(command)
                        )
                        log.info("command %s (%s): %s", command.command_id, command.kind,
                                 "done" if done else "did not apply")  # fmt: skip
                    await self.commands.ack(self.endpoint_id, delivery.entry_id)
            except (RedisError, OSError) as exc:
                log.warning("command channel: %s", exc)
                await asyncio.sleep(self.heartbeat_s)

    async def peers(self) -> list[EndpointState]:
        """The other endpoints of the pool a continuation could migrate to (lease valid,
        same role), as they last published; none when the control plane cannot say
        (relief then migrates nothing). After a failed read it does not ask again for a
        few heartbeats: relief under exhaustion must not wait on an unreachable Redis
        pass after pass."""
        if time.monotonic() < self._room_unknown_until:
            return []
        try:
            snapshot = await asyncio.wait_for(self.registry.snapshot(), self.heartbeat_s)
        except (RedisError, OSError, SchemaError, TimeoutError) as exc:
            log.info("relief: the pool's room is unknown (%s)", exc)
            self._room_unknown_until = time.monotonic() + 5 * self.heartbeat_s
            return []
        role = self.service.policy.role
        now_ms = snapshot.server_time_ms
        return [
            state
            for endpoint_id, state in snapshot.endpoints.items()
            if endpoint_id != self.endpoint_id
            and state.role is role
            and snapshot.lease_expires_ms.get(endpoint_id, 0) > now_ms
        ]

    async def reserve(
        self, peer: EndpointState, asked: RoomReservation
    ) -> tuple[RoomReservation | None, int]:
        """Ask `peer` to hold room for a continuation (its `POST /weir/v1/reserve`, with
        this pool's admin token): the grant, or None and the room it says it has (0 when
        it did not answer, or answered something else)."""
        headers = {"Content-Type": "application/json"}
        if self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        try:
            async with await self._peers_http.request(
                "POST", peer.address + RESERVE_PATH, encode_json(asked), headers
            ) as reply:
                body = await reply.read()
                status = reply.status
        except TransportError as exc:
            log.info("relief: %s did not answer a reservation: %s", peer.endpoint_id, exc)
            return None, 0
        try:
            if status == 200:
                return decode_json(body, RoomReservation), 0
            if status == 409:
                return None, msgspec.json.decode(body, type=_NoRoom).error.room_tokens
        except (SchemaError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("relief: %s answered a reservation with %s", peer.endpoint_id, exc)
            return None, 0
        log.info("relief: %s answered a reservation with HTTP %d", peer.endpoint_id, status)
        return None, 0

    def start(self) -> None:
        self._heartbeat = asyncio.create_task(self._run(), name="weir-sidecar-heartbeat")
        self._commands = asyncio.create_task(self._run_commands(), name="weir-sidecar-commands")

    async def drain(self) -> None:
        """Out of routing for good: mark draining in the store and publish it."""
        try:
            if self.lease.epoch:
                await self.registry.drain(self.endpoint_id, self.lease.epoch)
        except (RedisError, OSError, FencedError) as exc:
            log.warning("drain in the store failed: %s", exc)
        await self.beat()

    async def close(self) -> None:
        # The heartbeat ends after its current beat rather than cancelled inside a Redis
        # call (a command cancelled mid-reply can leave its connection unreleased).
        self._closing = True
        self.service.ledger.changed.set()
        ends: list[Awaitable[object]] = []
        if self._commands is not None:
            ends.append(cancel_loops([self._commands]))
        if self._heartbeat is not None:
            ends.append(self._heartbeat)
        await asyncio.gather(*ends, return_exceptions=True)
        # Bounded: with Redis gone, what is left comes back when the holder lease lapses.
        await self.quota.close(timeout_s=max(0.5, self.lease_ttl_s / 3))
        with contextlib.suppress(RedisError, OSError):
            await self.lease.release()
        await self.redis.aclose()
        await self._peers_http.close()
