"""Weir's promise where it matters: a live fleet (router, sidecars, reference engines,
real Redis) run into KV exhaustion, losing an engine or a sidecar for good, losing its
Redis primary to a Sentinel failover, or on a Redis Cluster seeing its pool's hash slot
move to another primary, keeps every admitted stream — each ends with its natural finish
and exactly the text an uninterrupted run gives, none ends `resume_failed`, and KV and the
router's reservations return to zero.

Bounded: small-KV engines at many times real speed, a few dozen streams, loopback only.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import redis

from controlplane.contract import EndpointState, KVPolicy, TenantQuota, WatermarkState
from controlplane.store import PoolKeys, QuotaStore, RedisSettings, connect
from engine_sidecar.ledger import Preemption
from engine_sidecar.policy.relief import continuation_tokens
from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine
from tests.controlplane.cluster_topology import ClusterTopology
from tests.controlplane.sentinel_topology import SentinelTopology
from tests.polling import until
from tests.router.conftest import MODEL
from tests.router.live_fleet import (
    POOL,
    LiveFleet,
    Stream,
    live_fleet,
    read_stream,
    request_body,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]
POOL_KV = KVPolicy()  # the live fleet's


async def _expected(bodies: list[dict[str, object]]) -> list[str]:
    """What each request gives uninterrupted, from an engine with room for all of them."""
    config = EngineConfig(model=MODEL, max_total_tokens=200_000, speed_factor=200.0, seed=7)
    async with serve_engine(config) as engine, aiohttp.ClientSession() as session:
        return [(await read_stream(session, engine.url, body)).text for body in bodies]


async def _settled(fleet: LiveFleet) -> None:
    router = fleet.router.router
    await until(lambda: router.dispatch.inflight.total == 0, "the router to release every endpoint")
    for sidecar in fleet.sidecars.values():
        await until(lambda s=sidecar: not s.service.ledger.flights, "the sidecars to empty")
        assert sidecar.service.ledger.own_used == 0
        assert sidecar.service.ledger.reserved == 0
    for engine in fleet.engines.values():
        if not engine._closed:
            await until(lambda e=engine: _idle(e), "the engines' KV to free")
        engine.engine.check()


def _idle(engine: RunningEngine) -> bool:
    loads = engine.engine.loads()
    return (loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens) == (0, 0, 0)


def _router_count(fleet: LiveFleet, name: str, **labels: str) -> float:
    registry = fleet.router.router.metrics.registry
    return registry.get_sample_value(name, {"pool": POOL, **labels}) or 0.0


def _assert_whole(streams: list[Stream], expected: list[str]) -> None:
    for i, stream in enumerate(streams):
        assert stream.error is None, (i, stream.error)
        assert stream.done, (i, stream)
        assert stream.finish == "length", (i, stream)
        assert stream.text == expected[i], i


async def test_a_kv_burst_keeps_every_admitted_stream(redis_url: str) -> None:
    """Twice the KV the fleet has, asked for at once: admission queues what does not fit,
    relief preempts and migrates as outputs grow, and every stream still ends whole. The
    pool lets a resume wait 1 s, far less than the streams ahead of it run: a resume
    queued behind them is not lost for it (with the router counting its wait from the
    hand-back, some were: 503 resume_failed). A longer wait only makes the test easier."""
    bodies = [request_body(i, 1500) for i in range(24)]
    expected = await _expected(bodies)
    async with (
        live_fleet(redis_url, resume_wait_s=1.0) as fleet,
        aiohttp.ClientSession() as session,
    ):
        streams = await asyncio.wait_for(
            asyncio.gather(*(read_stream(session, fleet.router.url, b) for b in bodies)), 120.0
        )
        preempted = sum(s.service.ledger.preemptions for s in fleet.sidecars.values())
        _assert_whole(streams, expected)
        assert preempted > 0, "the burst never ran into KV exhaustion"
        finished = {"tenant": "default", "reason": "length"}
        assert _router_count(fleet, "weir_router_requests_total", **finished) == len(bodies)
        await _settled(fleet)


def _sidecar_count(fleet: LiveFleet, endpoint_id: str, name: str, **labels: str) -> float:
    service = fleet.sidecars[endpoint_id].service
    registry = service.metrics.registry
    labels = {"pool": POOL, "endpoint": service.metrics.endpoint, **labels}
    return registry.get_sample_value(name, labels) or 0.0


async def test_two_sidecars_that_want_one_peer_s_room_do_not_both_move_into_it(
    redis_url: str,
) -> None:
    """Two sidecars run into exhaustion at the same moment, and the only peer with room
    has room for one of their continuations, not both. Each plans to migrate there and
    asks that peer to hold the room before it aborts its victim: the peer grants one;
    that one migrates into the held room (the router resumes it there, its admission
    takes the room), the other resumes its victim in place once its own room returns.
    Both streams end whole; every reservation is consumed or expires. (The test holds
    room itself to steer: the second stream away from the first's endpoint, and both
    endpoints into exhaustion at once.) The engines are slow enough (speed 10 grew the
    first stream past the steering hold on a fast machine) that the first stream neither
    outgrows the hold nor ends before the second is well along; it is the longer one."""
    kv = 20_000  # 1,000 tokens of safety, 2,000 between critical and exhausted
    bodies = [request_body(0, 3700), request_body(1, 3000)]
    expected = await _expected(bodies)
    async with (
        live_fleet(redis_url, kv_tokens=kv, speed_factor=3.0) as fleet,
        aiohttp.ClientSession() as session,
    ):
        view = fleet.router.router.view

        def published(endpoint_id: str) -> EndpointState:
            return view.snapshot.by_id[endpoint_id].state

        streams = [Stream(), Stream()]
        url = fleet.router.url
        first = asyncio.create_task(read_stream(session, url, bodies[0], streams[0]))
        await asyncio.wait_for(streams[0].progress.wait(), 30.0)
        x = streams[0].endpoint
        (y,) = set(fleet.sidecars) - {x}
        # x out of routing for a while (room held, critical, 1,900 tokens short of
        # exhausted; at most ~300 tokens a second at this pace, the first stream grows
        # ~900 in the hold's 3 s): the second stream goes to y.
        ledger_x = fleet.sidecars[x].service.ledger
        assert ledger_x.reserve("pin", ledger_x.room_tokens() - 1_900, ttl_s=3.0) is not None
        await until(lambda: published(x).watermark is WatermarkState.CRITICAL, "x critical")
        second = asyncio.create_task(read_stream(session, url, bodies[1], streams[1]))
        await asyncio.wait_for(streams[1].progress.wait(), 30.0)
        assert streams[1].endpoint == y
        await until(lambda: ledger_x.held_tokens == 0, "x's room back", timeout_s=30.0)
        ledgers = [fleet.sidecars[e].service.ledger for e in (x, y)]
        await until(
            # Each ledger holds its stream (a min over both could pass on one alone).
            lambda: all(
                (held := lg.candidates()) and held[0].generated_tokens >= 1_500 for lg in ledgers
            ),
            "both streams well along",
            timeout_s=60.0,
        )
        # A third endpoint with room for either continuation, not for both.
        sizes = [continuation_tokens(lg.candidates()[0], POOL_KV) for lg in ledgers]
        await fleet.add("s2", int((sum(sizes) - 2) / 0.95), 10.0)
        room = fleet.sidecars["s2"].service.ledger.room_tokens()
        assert max(sizes) <= room < sum(sizes)
        await until(lambda: "s2" in view.snapshot.by_id, "s2 registered")
        # Both exhausted at once (all their room held): both relieve, both want s2.
        for ledger in ledgers:
            assert ledger.reserve("exhaust", ledger.room_tokens(), ttl_s=1.5) is not None
        await asyncio.wait_for(asyncio.gather(first, second), 180.0)
        _assert_whole(streams, expected)
        moved = {
            mode: sum(
                _sidecar_count(fleet, e, "weir_sidecar_preemptions_total", mode=mode)
                for e in (x, y)
            )
            for mode in ("migrate", "recompute")
        }
        assert moved == {"migrate": 1, "recompute": 1}
        held = {
            outcome: _sidecar_count(
                fleet, "s2", "weir_sidecar_migration_reservations_total", outcome=outcome
            )
            for outcome in ("taken", "consumed", "refused")
        }
        # The other asked too and was refused (or, slower, saw the room already gone).
        assert held["taken"] == held["consumed"] == 1
        assert held["refused"] <= 1
        assert _router_count(fleet, "weir_router_resumes_total", reason="preempted") == 1
        await until(
            lambda: all(s.service.ledger.held_tokens == 0 for s in fleet.sidecars.values()),
            "every reservation consumed or expired",
        )
        await _settled(fleet)


async def test_a_drain_holds_room_for_each_continuation_and_spreads_them_by_it(
    redis_url: str,
) -> None:
    """An endpoint drained with two streams running migrates both, as relief does: room
    is held for each at a peer before its engine segment is aborted, the first at the
    peer with the most room, the second, that peer's room now counted smaller, at the
    other. The router resumes each where its room is held, and each peer's admission
    takes it: both streams end whole, one on each peer, every hold consumed."""
    bodies = [request_body(0, 3000), request_body(1, 3000)]
    expected = await _expected(bodies)
    async with (
        live_fleet(redis_url, size=1, kv_tokens=20_000, speed_factor=3.0) as fleet,
        aiohttp.ClientSession() as session,
    ):
        streams = [Stream(), Stream()]
        reading = [
            asyncio.create_task(read_stream(session, fleet.router.url, body, stream))
            for body, stream in zip(bodies, streams, strict=True)
        ]
        for stream in streams:
            await asyncio.wait_for(stream.progress.wait(), 30.0)
        for peer in ("s1", "s2"):
            await fleet.add(peer, 20_000, 3.0)
        view = fleet.router.router.view
        await until(lambda: {"s1", "s2"} <= set(view.snapshot.by_id), "the peers registered")
        drained = await fleet.sidecars["s0"].service.drain(0.0)
        assert drained["migrated"] == 2, drained
        await asyncio.wait_for(asyncio.gather(*reading), 180.0)
        _assert_whole(streams, expected)
        for peer in ("s1", "s2"):
            held = {
                outcome: _sidecar_count(
                    fleet, peer, "weir_sidecar_migration_reservations_total", outcome=outcome
                )
                for outcome in ("taken", "consumed", "refused", "expired")
            }
            assert held == {"taken": 1, "consumed": 1, "refused": 0, "expired": 0}, (peer, held)
        assert _router_count(fleet, "weir_router_resumes_total", reason="preempted") == 2
        resumed_there = sum(
            _router_count(
                fleet, "weir_router_decisions_total", reason="reserved_target", owner_hit=hit
            )
            for hit in ("true", "false")
        )
        assert resumed_there == 2
        await _settled(fleet)


async def test_a_stream_that_cannot_resume_in_place_in_time_goes_back_to_its_router(
    redis_url: str,
) -> None:
    """Preempted to recompute in place on an endpoint that then has no room (the test
    holds it, critical, for someone else): the stream waits there as long as the pool
    lets a resume wait, and then, rather than end with an error, its sidecar hands it
    back and the router resumes it on the other endpoint, whole."""
    body = request_body(0, 1500)
    (expected,) = await _expected([body])
    async with (
        live_fleet(redis_url, kv_tokens=20_000, speed_factor=10.0, resume_wait_s=1.0) as fleet,
        aiohttp.ClientSession() as session,
    ):
        stream = Stream()
        running = asyncio.create_task(read_stream(session, fleet.router.url, body, stream))
        await asyncio.wait_for(stream.progress.wait(), 30.0)
        service = fleet.sidecars[stream.endpoint].service
        ledger = service.ledger
        (rid,) = ledger.flights
        # Critical (no new work, the resume included) but not exhausted (no relief).
        held = ledger.reserve("someone-else", ledger.room_tokens() - 1_200, ttl_s=5.0)
        assert held is not None
        assert ledger.watermark is WatermarkState.CRITICAL
        assert await service.preempt(rid, Preemption.RECOMPUTE, "ordered by the test")
        await asyncio.wait_for(running, 60.0)
        _assert_whole([stream], [expected])
        assert _router_count(fleet, "weir_router_resumes_total", reason="preempted") == 1
        story = service.trail.story(stream.request_id)
        assert story is not None
        events = [e["event"] for e in story["events"]]
        assert events[-3:] == ["refused", "handed_back", "end"], events
        await until(lambda: ledger.held_tokens == 0, "the held room to expire")
        await _settled(fleet)


async def _kill_mid_stream(
    fleet: LiveFleet,
    session: aiohttp.ClientSession,
    bodies: list[dict[str, object]],
    kill: Callable[[], Awaitable[None]],
) -> list[Stream]:
    """Start every stream, `kill` once each has had a few chunks, wait for them all."""
    streams = [Stream() for _ in bodies]
    running = asyncio.gather(
        *(
            read_stream(session, fleet.router.url, b, s)
            for b, s in zip(bodies, streams, strict=True)
        )
    )
    await asyncio.wait_for(asyncio.gather(*(s.progress.wait() for s in streams)), 60.0)
    await kill()
    await asyncio.wait_for(running, 60.0)
    return streams


async def test_an_engine_lost_for_good_hands_its_streams_back_at_once(redis_url: str) -> None:
    """An engine dies mid-stream and does not come back: its sidecar does not wait for it
    but hands each stream back to the router with its continuation, and the router resumes
    them on the other endpoint, token for token."""
    bodies = [request_body(i, 400) for i in range(8)]
    expected = await _expected(bodies)
    # Room for every stream on one engine: no relief muddles the count of resumes.
    async with (
        live_fleet(redis_url, kv_tokens=20_000) as fleet,
        aiohttp.ClientSession() as session,
    ):
        streams = await _kill_mid_stream(fleet, session, bodies, fleet.engines["s0"].kill)
        _assert_whole(streams, expected)
        lost = sum(s.endpoint == "s0" for s in streams)
        assert lost > 0
        resumed = _router_count(fleet, "weir_router_resumes_total", reason="preempted")
        assert resumed == lost  # each handed back by its sidecar, none found broken
        assert _router_count(fleet, "weir_router_resumes_total", reason="broken") == 0
        await _settled(fleet)


async def test_a_sidecar_killed_mid_stream_loses_no_stream(redis_url: str, tmp_path: Path) -> None:
    """A sidecar (as a pod's would be) is SIGKILLed while it streams: the router resumes
    each of its streams on the other endpoint from what the client holds, exactly."""
    bodies = [request_body(i, 400) for i in range(8)]
    expected = await _expected(bodies)
    async with (
        live_fleet(
            redis_url, kv_tokens=20_000, processes=frozenset({"s0"}), workdir=tmp_path
        ) as fleet,
        aiohttp.ClientSession() as session,
    ):

        async def kill() -> None:
            fleet.processes["s0"].send_signal(signal.SIGKILL)

        streams = await _kill_mid_stream(fleet, session, bodies, kill)
        _assert_whole(streams, expected)
        lost = sum(s.endpoint == "s0" for s in streams)
        assert lost > 0
        assert _router_count(fleet, "weir_router_resumes_total", reason="broken") == lost
        await _settled(fleet)


async def test_a_redis_failover_loses_no_stream_and_leaks_no_quota() -> None:
    """The Redis primary dies mid-stream and Sentinel promotes its replica. Router and
    sidecars, given only a redis+sentinel:// URL (with AUTH), follow the new primary:
    every stream ends whole, the tenant's quota — exact while they run — is back to zero
    once they end (releases that fell in the outage land later), and new requests are
    admitted again. How long new requests were refused is printed, not asserted."""
    bodies = [request_body(i, 1000) for i in range(8)]
    expected = await _expected(bodies)
    probe = {"model": MODEL, "prompt": "probe", "max_tokens": 2}
    with SentinelTopology(password="weir-failover") as topology:
        settings = RedisSettings.from_url(topology.url, retries=10, backoff_cap_s=0.2)
        quotas = QuotaStore(connect(settings), POOL)
        async with (
            live_fleet(topology.url, kv_tokens=20_000, tenants=(TenantQuota(name="default",
                       max_concurrency=10),)) as fleet,
            aiohttp.ClientSession() as session,
        ):  # fmt: skip
            streams = [Stream() for _ in bodies]
            running = asyncio.gather(
                *(read_stream(session, fleet.router.url, b, s) for b, s in zip(bodies, streams,
                                                                          strict=True))
            )  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(s.progress.wait() for s in streams)), 60.0)
            assert (await quotas.usage("default")).concurrency == len(bodies)
            primary = redis.Redis(port=topology.master.port, password=topology.password)
            primary.wait(1, 5000)  # the replica has every charge
            primary.close()
            await asyncio.to_thread(topology.master.stop)
            died = asyncio.get_running_loop().time()
            answers: list[int] = []

            async def admitted() -> bool:
                async with session.post(fleet.router.url + "/v1/completions", json=probe) as r:
                    answers.append(r.status)
                    return r.status == 200

            await until(admitted, "a request admitted after the failover", timeout_s=60)
            refused_s = asyncio.get_running_loop().time() - died
            await asyncio.wait_for(running, 60.0)
            _assert_whole(streams, expected)
            assert set(answers) <= {200, 503}, answers  # refused while no primary, then served
            print(f"\nredis failover: new requests refused for {refused_s:.2f}s "
                  f"({len(answers) - 1} probes answered 503)")  # fmt: skip
            await _settled(fleet)

            async def released() -> bool:
                return (await quotas.usage("default")).concurrency == 0

            await until(released, "every quota slot to come back", timeout_s=30)
        await quotas.redis.aclose()


async def test_a_fleet_on_a_redis_cluster_keeps_every_stream_while_the_pool_s_slot_moves(
    redis_cluster: ClusterTopology, redis_cluster_url: str
) -> None:
    """Router and sidecars given only a redis+cluster:// URL (with AUTH), the tenant's
    quota on: mid-stream, the pool's hash slot migrates to another primary key by key.
    Every stream ends whole, the quota is exact before and after the move and back to
    zero once the streams end, and new requests are admitted. (The streams are long and
    the engines slow so that they outlast the move on any machine: at speed 20 and 400
    tokens they ended before it on a fast one.)"""
    bodies = [request_body(i, 1500) for i in range(8)]
    expected = await _expected(bodies)
    quotas = QuotaStore(connect(RedisSettings.from_url(redis_cluster_url)), POOL)
    tenant = TenantQuota(name="default", max_concurrency=10)
    async with (
        live_fleet(
            redis_cluster_url, kv_tokens=20_000, speed_factor=5.0, tenants=(tenant,)
        ) as fleet,
        aiohttp.ClientSession() as session,
    ):
        streams = [Stream() for _ in bodies]
        running = asyncio.gather(
            *(
                read_stream(session, fleet.router.url, b, s)
                for b, s in zip(bodies, streams, strict=True)
            )
        )
        await asyncio.wait_for(asyncio.gather(*(s.progress.wait() for s in streams)), 60.0)
        assert (await quotas.usage("default")).concurrency == len(bodies)
        key = PoolKeys(POOL).state
        target = next(n for n in redis_cluster.primaries() if n is not redis_cluster.owner(key))
        moved = await asyncio.to_thread(redis_cluster.migrate_slot, key, target,
                                        lambda: time.sleep(0.05))  # fmt: skip
        assert redis_cluster.owner(key) is target
        assert not running.done()  # the slot moved mid-stream
        assert (await quotas.usage("default")).concurrency == len(bodies)
        probe = {"model": MODEL, "prompt": "probe", "max_tokens": 2}

        async def admitted() -> bool:
            async with session.post(fleet.router.url + "/v1/completions", json=probe) as r:
                return r.status == 200

        await until(admitted, "a request admitted after the move", timeout_s=30)
        await asyncio.wait_for(running, 60.0)
        _assert_whole(streams, expected)
        print(f"\nslot migration under a fleet: {moved} keys moved mid-stream")
        await _settled(fleet)

        async def released() -> bool:
            return (await quotas.usage("default")).concurrency == 0

        await until(released, "every quota slot to come back", timeout_s=30)
    await quotas.redis.aclose()
