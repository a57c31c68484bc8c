"""The router's tenant quotas through Redis faults, against real redis-server processes:
releases made while Redis is down (data kept, as with AOF or a failover), charges a lagging
failover brings back, a Redis restarted empty, and shutdown with Redis gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis

from controlplane.contract import TenantQuota
from controlplane.router import QuotaSettings
from controlplane.router.errors import RouterError
from controlplane.router.quotas import QuotaGate
from controlplane.store import QuotaStore, RedisSettings, cancel_loops, connect
from tests.exposition import by_label
from tests.polling import until
from tests.router.conftest import MODEL, POOL, make_fleet
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis

BATCH = TenantQuota(name="batch", max_concurrency=8)
# Kept across a restart, as with AOF (every write synced) or a replica promoted in time.
AOF = ("--appendonly", "yes", "--appendfsync", "always")


def _settings(server: RedisServer) -> RedisSettings:
    """A client that gives up quickly while Redis is down (a few short retries)."""
    return RedisSettings(
        url=server.url, retries=2, backoff_cap_s=0.1, connect_timeout_s=0.5, command_timeout_s=2
    )


@contextlib.asynccontextmanager
async def _gate(server: RedisServer, lease_ttl_s: float = 30.0) -> AsyncIterator[QuotaGate]:
    client = connect(_settings(server))
    gate = QuotaGate(QuotaStore(client, POOL), (BATCH,), lease_ttl_s)
    try:
        await gate.publish()
        await gate.store.renew_holder(gate.holder, lease_ttl_s)  # as serve_router does
        yield gate
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _keeping_lease(gate: QuotaGate) -> AsyncIterator[None]:
    task = asyncio.create_task(gate.keep_lease())
    try:
        yield
    finally:
        await cancel_loops([task])


async def _held(gate: QuotaGate) -> set[str]:
    """The request ids the store holds charges for under the router's holder."""
    store = gate.store
    return {m.decode() for m in await store.redis.smembers(store.keys.held_by(gate.holder))}


async def _in_use(store: QuotaStore) -> int:
    return (await store.usage("batch")).concurrency


async def test_releases_made_while_redis_is_down_land_once_it_answers_again() -> None:
    """Eight streams end while Redis is down; their releases fail. Redis comes back with its
    data (the charges still there): the router sends the releases again and the tenant's
    slots come back, instead of staying at 8/8 (every request 429) for as long as the
    router lives. The lease outlives the outage, so no reaper returns them."""
    with RedisServer(extra_args=AOF) as server:
        async with _gate(server) as gate:
            store = gate.store
            for i in range(8):
                await gate.charge("batch", f"r{i}", 10, 100)
            with pytest.raises(RouterError) as full:
                await gate.charge("batch", "r-late", 10, 100)
            assert (full.value.status, full.value.reason) == (429, "concurrency")

            await asyncio.to_thread(server.stop)
            # Each release tries, fails and returns (the request is over for the client).
            await asyncio.gather(*(gate.release(f"r{i}", 10, 40) for i in range(8)))
            await asyncio.to_thread(server.start)
            assert await _in_use(store) == 8  # the data was kept: the charges are all there

            async with _keeping_lease(gate):

                async def returned() -> bool:
                    return await _in_use(store) == 0

                await until(returned, "the releases to land", 30, ignoring=(redis.RedisError,))
            assert await _held(gate) == set()
            await gate.charge("batch", "r-next", 10, 100)  # granted
            assert await _in_use(store) == 1


async def test_charges_a_lagging_failover_brings_back_are_reconciled_away() -> None:
    """A failover to a replica that had not yet received some releases brings their charges
    back, although this router released them. Once Redis answers again the router compares
    the store's charges of its holder with the requests it has in flight and releases the
    rest; the request still in flight keeps its charge."""
    with RedisServer() as server:
        async with _gate(server) as gate:
            store = gate.store
            for rid in ("live", "r1", "r2", "r3"):
                await gate.charge("batch", rid, 10, 100)
            sync = redis.Redis(port=server.port)
            try:
                sync.save()  # what the replica has: all four charges
            finally:
                sync.close()
            for rid in ("r1", "r2", "r3"):
                await gate.release(rid, 10, 40)  # taken by the old master only
            assert await _in_use(store) == 1

            await asyncio.to_thread(server.stop)  # no save at shutdown: the snapshot stays
            with pytest.raises(RouterError) as unavailable:  # a request during the failover
                await gate.charge("batch", "during", 10, 100)
            assert (unavailable.value.status, unavailable.value.reason) == (
                503, "quota_unavailable",
            )  # fmt: skip
            await asyncio.to_thread(server.start)
            assert await _in_use(store) == 4
            async with _keeping_lease(gate):

                async def reconciled() -> bool:
                    return await _in_use(store) == 1

                await until(
                    reconciled, "the stray charges to be released", 30, ignoring=(redis.RedisError,)
                )
            assert await _held(gate) == {"live"}
            await gate.release("live", 10, 100)
            assert await _in_use(store) == 0


async def test_the_first_charge_after_redis_restarted_empty_is_granted() -> None:
    """Redis restarted without persistence lost the quotas and the holder lease at once:
    the charge publishes the quotas again, renews the lease and is granted, as on a fresh
    control plane (it was refused with 400 exceeds_quota, for a holder_expired refusal)."""
    with RedisServer() as server:
        async with _gate(server) as gate:
            await gate.charge("batch", "before", 10, 100)
            await asyncio.to_thread(server.restart)  # all data lost
            await gate.charge("batch", "after", 10, 100)  # no keep_lease ran meanwhile
            assert await gate.store.get_quota("batch") == BATCH
            assert await _held(gate) == {"after"}
            assert await _in_use(gate.store) == 1


async def test_shutdown_with_redis_down_makes_one_bounded_attempt_at_waiting_releases() -> None:
    with RedisServer() as server:
        async with _gate(server) as gate:
            await gate.charge("batch", "r1", 10, 100)
            await asyncio.to_thread(server.stop)
            await gate.release("r1", 10, 40)
            assert gate.book.pending == 1
            # A hang guard, not a timing goal: close gives up after its own bound.
            async with asyncio.timeout(60):
                await gate.close(timeout_s=0.5)
            assert gate.book.pending == 1  # kept (and logged): the lease lapse returns it


async def test_streams_that_end_while_redis_is_down_give_their_slots_back() -> None:
    """The router end to end: a tenant's four streams end while Redis is down; once it is
    back with its data, the tenant is admitted again."""
    policy = (TenantQuota(name="batch", max_concurrency=4),)
    body = {"model": MODEL, "prompt": "long story", "stream": True, "max_tokens": 3000,
            "ignore_eos": True}  # fmt: skip
    headers = {"x-weir-tenant": "batch"}
    with RedisServer(extra_args=AOF) as server:
        async with (
            make_fleet(
                server.url,
                engines=1,
                speed_factor=1.0,
                quotas=QuotaSettings(enforce=True, tenants=policy),
            ) as fleet,
            aiohttp.ClientSession() as session,
        ):
            router = fleet.router.router
            streams = []
            for _ in range(4):
                reply = await session.post(
                    fleet.url + "/v1/completions", json=body, headers=headers
                )
                assert reply.status == 200, await reply.text()
                await reply.content.readline()
                streams.append(reply)
            short = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            async with session.post(
                fleet.url + "/v1/completions", json=short, headers=headers
            ) as refused:
                assert refused.status == 429

            await asyncio.to_thread(server.stop)
            for reply in streams:
                reply.close()  # the clients go away: the router releases, and Redis is down
            # The router has ended the four requests (counted once their releases are
            # under way), and its background work (aborts, quota releases) has ended:
            # every release has been tried against the stopped Redis.
            ended = (
                f'weir_router_requests_total{{pool="{POOL}",reason="cancelled",tenant="batch"}} 4.0'
            )

            def released() -> bool:
                return ended in router.metrics.exposition().decode() and not router._background

            await until(released, "the releases to be tried", 30, ignoring=(redis.RedisError,))
            assert await _pending(session, fleet.url) == 4.0  # an operator sees them wait
            await asyncio.to_thread(server.start)

            async def admitted() -> bool:
                async with session.post(
                    fleet.url + "/v1/completions", json=short, headers=headers
                ) as reply:
                    # 503 while the router's view of the pool catches up after the outage
                    assert reply.status in (200, 429, 503), await reply.text()
                    return reply.status == 200

            await until(admitted, "the tenant's slots to come back", timeout_s=30)

            # The renewal loop sends the outbox one release at a time: the first one taken
            # already admits the tenant, the others land on the same pass or the next.
            async def drained() -> bool:
                return await _pending(session, fleet.url) == 0.0

            await until(drained, "every waiting release to be taken", timeout_s=30)


async def _pending(session: aiohttp.ClientSession, url: str) -> float:
    """The router's quota releases waiting for Redis, as Prometheus scrapes them."""
    async with session.get(url + "/metrics") as reply:
        exposition = await reply.text()
    return by_label(exposition, "weir_router_quota_releases_pending", "pool")[POOL]
