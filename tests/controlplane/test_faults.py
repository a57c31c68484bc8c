"""Faults the registry must survive, against real redis-server and redis-sentinel processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import redis
from redis.asyncio import Redis

from controlplane.contract import EndpointState
from controlplane.store import (
    EndpointLease,
    EndpointRegistry,
    FencedError,
    PoolFollower,
    RedisSettings,
    connect,
    reap_forever,
)
from tests.controlplane.records import POOL, endpoint
from tests.controlplane.sentinel_topology import SERVICE, SentinelTopology
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis


@contextlib.asynccontextmanager
async def _beating(
    leases: list[EndpointLease], states: list[EndpointState], period_s: float
) -> AsyncIterator[None]:
    tasks = [
        asyncio.create_task(lease.run(_const(state), period_s))
        for lease, state in zip(leases, states, strict=True)
    ]
    try:
        yield
    finally:
        # A cancel can be lost inside the Redis client while it reconnects (one full run
        # in several hung here for 300 s, the beats going on): cancel until they end.
        while pending := [task for task in tasks if not task.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
        await asyncio.gather(*tasks, return_exceptions=True)


def _const(state: EndpointState) -> Callable[[], EndpointState]:
    return lambda: state


async def _eventually(check: Callable[[], object], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                if await check():  # type: ignore[misc]
                    return
            except redis.RedisError:
                pass
            await asyncio.sleep(0.05)


async def test_redis_restart_mid_heartbeats_rebuilds_the_pool(fresh_redis: RedisServer) -> None:
    client = connect(RedisSettings(url=fresh_redis.url, retries=10, backoff_cap_s=0.2))
    registry = EndpointRegistry(client, POOL)
    states = [endpoint(f"e{i}") for i in range(3)]
    leases = [EndpointLease(registry, ttl_s=5) for _ in states]
    follower = PoolFollower(registry)
    try:
        async with _beating(leases, states, period_s=0.05):

            async def all_registered() -> bool:
                return all(lease.version >= 3 for lease in leases)

            await _eventually(all_registered)
            await follower.refresh()
            before = follower.snapshot
            epochs = {eid: s.epoch for eid, s in before.endpoints.items()}
            assert set(epochs) == {"e0", "e1", "e2"}

            await asyncio.to_thread(fresh_redis.restart)  # all data lost, as after a crash

            async def rebuilt() -> bool:
                snap = await registry.snapshot()
                return set(snap.endpoints) == set(epochs) and all(
                    snap.endpoints[e].epoch > epochs[e] for e in epochs
                )

            await _eventually(rebuilt)
        refreshed = await follower.refresh()
        assert refreshed.resynced
        after = follower.snapshot
        assert after.position.incarnation != before.position.incarnation
        assert {e: s.epoch > epochs[e] for e, s in after.endpoints.items()} == dict.fromkeys(
            epochs, True
        )
        assert all(lease.registrations == 2 for lease in leases)
    finally:
        await client.aclose()


async def test_expired_lease_leaves_membership_within_ttl_plus_reaper_period(
    client: Redis, registry: EndpointRegistry
) -> None:
    ttl_s, period_s = 0.3, 0.1
    alive = EndpointLease(registry, ttl_s=5)
    await alive.beat(endpoint("alive"))
    dead = await registry.register(endpoint("dead"), ttl_s=ttl_s)  # never beats again
    lease = (await registry.snapshot()).lease_expires_ms["dead"]
    passes: list[tuple[int, tuple[str, ...]]] = []
    gone = asyncio.Event()

    def record(reaped: object) -> None:
        from controlplane.store import Reaped

        assert isinstance(reaped, Reaped)
        passes.append((reaped.server_time_ms, reaped.endpoints))
        if "dead" in reaped.endpoints:
            gone.set()

    reaper = asyncio.create_task(reap_forever(registry, period_s, record))
    try:
        async with asyncio.timeout(30):
            await gone.wait()
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
    # Removed by the first pass that ran after the lease lapsed (server time), not later.
    first_after = next(i for i, (t, _) in enumerate(passes) if t > lease)
    assert "dead" in passes[first_after][1]
    assert all("dead" not in eps for t, eps in passes if t <= lease)
    snap = await registry.snapshot()
    assert snap.membership().members == ("alive",)
    assert dead.epoch > 0


async def test_sentinel_failover_clients_reconnect_and_heartbeats_rebuild_state() -> None:
    with SentinelTopology() as topology:
        settings = RedisSettings(
            sentinels=(("127.0.0.1", topology.sentinel_port),),
            sentinel_service=SERVICE,
            retries=10,
            backoff_cap_s=0.3,
            connect_timeout_s=0.5,
            command_timeout_s=2.0,
        )
        client = connect(settings)
        registry = EndpointRegistry(client, POOL)
        state = endpoint("e0")
        lease = EndpointLease(registry, ttl_s=15)
        replica = redis.Redis(port=topology.replica_port)
        try:
            async with _beating([lease], [state], period_s=0.05):

                async def beating() -> bool:
                    return lease.version >= 5

                await _eventually(beating)
                epoch = lease.epoch
                # Make sure the replica has the registration, then kill the master.
                master = redis.Redis(port=topology.master.port)
                master.wait(1, 5000)
                master.close()
                version_before = lease.version
                await asyncio.to_thread(topology.master.stop)

                def promoted() -> bool:
                    return bool(replica.info("replication")["role"] == "master")

                async def replica_promoted() -> bool:
                    return await asyncio.to_thread(promoted)

                await _eventually(replica_promoted, timeout_s=60)

                async def resumed() -> bool:
                    return lease.version >= version_before + 5

                await _eventually(resumed, timeout_s=60)
            raw = replica.hget(f"weir:{{{POOL}}}:state", "e0")
            assert isinstance(raw, bytes)
            stored_epoch, stored_version, lifecycle, _lease = raw.split(b" ")
            # Same epoch: the lease never lapsed, so no re-registration was needed; the
            # new master holds the heartbeats written after the failover.
            assert int(stored_epoch) == epoch
            assert lease.registrations == 1
            assert int(stored_version) >= version_before + 5
            assert lifecycle == b"ready"
            snap = await registry.snapshot()
            assert snap.lease_valid("e0")
        finally:
            replica.close()
            await client.aclose()


async def test_unreachable_redis_keeps_the_last_view(fresh_redis: RedisServer) -> None:
    client = connect(RedisSettings(url=fresh_redis.url, retries=1, backoff_cap_s=0.05,
                                   connect_timeout_s=0.5))  # fmt: skip
    registry = EndpointRegistry(client, POOL)
    follower = PoolFollower(registry)
    try:
        await registry.register(endpoint("a"), ttl_s=30)
        await follower.refresh()
        before = follower.snapshot
        await asyncio.to_thread(fresh_redis.stop)
        with pytest.raises(redis.ConnectionError):
            await follower.refresh()
        views = follower.watch(block_s=0.05)
        assert set((await anext(views)).endpoints) == {"a"}  # the last view, still served
        await views.aclose()
        after = follower.snapshot
        assert after.endpoints == before.endpoints
        assert after.position == before.position
        assert after.server_time_ms >= before.server_time_ms  # staleness stays measurable
    finally:
        await client.aclose()


async def test_a_fenced_lease_stops_writing_for_good(registry: EndpointRegistry) -> None:
    old, successor = EndpointLease(registry, ttl_s=30), EndpointLease(registry, ttl_s=30)
    await old.beat(endpoint("e0", kv_used_tokens=1))
    await successor.beat(endpoint("e0", kv_used_tokens=2))  # the same id, registered again
    await successor.beat(endpoint("e0", kv_used_tokens=3))
    for _ in range(2):
        with pytest.raises(FencedError):
            await old.beat(endpoint("e0", kv_used_tokens=666))
    assert not await old.release()
    stored = (await registry.snapshot()).endpoints["e0"]
    assert (stored.epoch, stored.version, stored.kv_used_tokens) == (successor.epoch, 2, 3)
    assert await successor.release()
    assert (await registry.snapshot()).endpoints == {}
