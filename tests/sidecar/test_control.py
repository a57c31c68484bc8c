"""The sidecar in the control plane: registration, heartbeats that publish its KV state,
drain (the preStop path) and deregistration, against a real Redis."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from controlplane.contract import Command, CommandKind, EndpointState, Lifecycle, TenantQuota
from controlplane.store import EndpointRegistry, PoolKeys, connect
from controlplane.store.commands import CommandChannel
from controlplane.store.connection import RedisSettings
from controlplane.store.quotas import QuotaStore
from engine_sidecar.policy import peer_rooms
from engine_sidecar.server import SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine, serve_engine
from tests.sidecar.conftest import MODEL, engine_config, pool_policy
from tests.sidecar.streams import read_sse
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_registers_publishes_drains_and_deregisters(redis_url: str) -> None:
    # An engine slow enough (~10 ms a token) that the stream outlasts the drain command's
    # start on a loaded machine: at the fixture's 200x it once ended before the deadline.
    async with serve_engine(engine_config(speed_factor=2.0)) as engine:
        await _registers_publishes_drains_and_deregisters(engine, redis_url)


async def _registers_publishes_drains_and_deregisters(
    engine: RunningEngine, redis_url: str
) -> None:
    redis = connect(RedisSettings(url=redis_url))
    registry = EndpointRegistry(redis, "p")
    config = SidecarConfig(
        engine_url=engine.url,
        redis_url=redis_url,
        pool="p",
        endpoint_id="pod-a",
        advertise_url="http://pod-a:8001",
        policy=pool_policy(),
        heartbeat_s=0.2,
        lease_ttl_s=2.0,
    )
    try:
        async with serve_sidecar(config) as sidecar:

            async def registered() -> bool:
                return "pod-a" in (await registry.snapshot()).endpoints

            async def draining() -> bool:
                return sidecar.service.draining

            await _until(registered)
            snap = await registry.snapshot()
            state = snap.endpoints["pod-a"]
            assert (state.address, state.model, state.kv_capacity_tokens) == (
                "http://pod-a:8001", MODEL, 8192,
            )  # fmt: skip
            assert state.epoch > 0
            assert snap.lease_valid("pod-a")
            body = {
                "text": "grow the cache",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True,
            }
            async with aiohttp.ClientSession() as http:
                async with http.post(sidecar.url + "/generate", json=body) as resp:
                    await read_sse(resp, stop_after=50)

                    async def published() -> bool:
                        now = (await registry.snapshot()).endpoints["pod-a"]
                        return now.kv_used_tokens > 0 and now.version > state.version

                    await _until(published)
                    # The preStop hook: `weir sidecar drain --url ...` in a subprocess.
                    drain = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "weir.cli", "sidecar", "drain",
                        "--url", sidecar.url, "--deadline-s", "0.2",
                        stdout=subprocess.PIPE,
                    )  # fmt: skip
                    await _until(draining)
                    rest = await read_sse(resp)
                out, _ = await drain.communicate()
                assert drain.returncode == 0
                assert b'"aborted": 1' in out
                assert rest.events
                assert "error" in rest.events[-1]
                async with http.post(sidecar.url + "/generate", json=body) as refused:
                    assert refused.status == 429
                    assert (await refused.json())["error"]["reason"] == "draining"
            snap = await registry.snapshot()
            assert snap.endpoints["pod-a"].lifecycle is Lifecycle.DRAINING
            assert "pod-a" not in snap.membership().members
            assert sidecar.service.ledger.own_used == 0
        snap = await registry.snapshot()
        assert "pod-a" not in snap.endpoints
        assert engine.engine.loads().num_running_reqs == 0
    finally:
        await redis.aclose()


async def test_runs_on_without_redis(engine: RunningEngine) -> None:
    """Soft on control: with Redis unreachable, the sidecar still serves and admits."""
    config = SidecarConfig(
        engine_url=engine.url,
        redis_url="redis://127.0.0.1:1/0",
        pool="p",
        endpoint_id="pod-b",
        policy=pool_policy(),
        heartbeat_s=0.2,
    )
    async with serve_sidecar(config) as sidecar:
        body = {"text": "still here", "sampling_params": {"max_new_tokens": 8}, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(sidecar.url + "/generate", json=body) as resp,
        ):
            assert resp.status == 200
            assert (await read_sse(resp)).done

        async def beat_failed() -> bool:
            return 'result="error"' in sidecar.service.metrics.exposition().decode()

        await _until(beat_failed, timeout_s=60.0)


async def test_kv_quota_is_charged_refused_and_released(
    engine: RunningEngine, redis_url: str
) -> None:
    redis = connect(RedisSettings(url=redis_url))
    quotas = QuotaStore(redis, "p")
    await quotas.set_quota(TenantQuota(name="acme", kv_token_seconds_per_min=10_000_000))
    await quotas.set_quota(TenantQuota(name="tiny", kv_token_seconds_per_min=1))
    config = SidecarConfig(
        engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-q",
        policy=pool_policy(), heartbeat_s=0.2,
    )  # fmt: skip
    held = PoolKeys("p").held_by("sidecar.pod-q")
    body = {
        "text": "charge me",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    try:
        async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
            async with http.post(
                sidecar.url + "/generate", json=body, headers={"x-weir-tenant": "tiny"}
            ) as refused:
                assert refused.status == 429
                assert (await refused.json())["error"]["reason"] == "tenant_kv_quota"
                assert int(refused.headers["Retry-After"]) >= 1
            resp = await http.post(
                sidecar.url + "/generate", json=body, headers={"x-weir-tenant": "acme"}
            )
            rid = resp.headers["x-weir-request-id"]
            await read_sse(resp, stop_after=5)
            assert await redis.smembers(held) == {rid.encode()}
            left = (await quotas.usage("acme")).kv_token_seconds_left
            assert left < 10_000_000
            resp.close()  # the client goes away
            assert await sidecar.service.ledger.wait_idle(10.0)
            await sidecar.service.settled()
            assert await redis.smembers(held) == set()
            assert await redis.hlen(PoolKeys("p").charges) == 0
            # The early end was refunded: most of the estimate came back.
            assert (await quotas.usage("acme")).kv_token_seconds_left > left
            assert sidecar.service.ledger.own_used == 0
            assert engine.engine.loads().num_running_reqs == 0
    finally:
        await redis.aclose()


async def test_a_request_whose_charge_fails_ends_rejected_and_leaves_nothing(
    engine: RunningEngine, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in the quota's charge (a single-call injection: no real failure raises
    there) answers 500 and ends the request as rejected: it never reached the engine, so
    nothing is aborted there, and the ledger holds nothing of it."""
    redis = connect(RedisSettings(url=redis_url))
    await QuotaStore(redis, "p").set_quota(TenantQuota(name="acme", kv_token_seconds_per_min=10**9))
    config = SidecarConfig(
        engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-f",
        policy=pool_policy(), heartbeat_s=0.2,
    )  # fmt: skip
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4}, "stream": True}
    try:
        async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
            quota = sidecar.service.quota
            assert quota is not None

            async def broken(*_: object) -> None:
                raise RuntimeError("injected")

            monkeypatch.setattr(quota, "charge", broken)
            async with http.post(
                sidecar.url + "/generate", json=body, headers={"x-weir-tenant": "acme"}
            ) as resp:
                assert resp.status == 500
            assert await sidecar.service.ledger.wait_idle(10.0)
            assert sidecar.service.ledger.own_used == 0
            assert engine.engine.loads().num_running_reqs == 0
    finally:
        await redis.aclose()


async def test_kv_quota_skips_unknown_tenants_and_applies_from_the_next_heartbeat(
    engine: RunningEngine, redis_url: str
) -> None:
    redis = connect(RedisSettings(url=redis_url))
    quotas = QuotaStore(redis, "p")
    config = SidecarConfig(
        engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-l",
        policy=pool_policy(), heartbeat_s=0.2,
    )  # fmt: skip
    held = PoolKeys("p").held_by("sidecar.pod-l")
    body = {
        "text": "charge me later",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    headers = {"x-weir-tenant": "late"}
    try:
        async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
            quota = sidecar.service.quota
            assert quota is not None

            async def unknown() -> bool:
                return not quota.charges("late")

            await _until(unknown)
            # No quota: the request streams without a charge (no Redis on its path).
            resp = await http.post(sidecar.url + "/generate", json=body, headers=headers)
            await read_sse(resp, stop_after=3)
            assert await redis.smembers(held) == set()
            resp.close()
            # A quota set while the sidecar runs applies once a heartbeat has read it.
            await quotas.set_quota(TenantQuota(name="late", kv_token_seconds_per_min=1))

            async def known() -> bool:
                return quota.charges("late")

            await _until(known)
            async with http.post(sidecar.url + "/generate", json=body, headers=headers) as r:
                assert r.status == 429
                assert (await r.json())["error"]["reason"] == "tenant_kv_quota"
            assert await sidecar.service.ledger.wait_idle(10.0)
    finally:
        await redis.aclose()


async def test_a_kv_charge_redis_missed_is_counted_and_releases_land_once_it_is_back() -> None:
    """Soft on control: with Redis down a request is admitted on local admission alone, and
    the skipped charge is counted (it was only logged). Releases made during the outage land
    once Redis is back with its data (AOF), so nothing stays charged."""
    async with serve_engine(engine_config(speed_factor=1.0)) as engine:
        with RedisServer(extra_args=("--appendonly", "yes", "--appendfsync", "always")) as server:
            redis = connect(RedisSettings(url=server.url, retries=1))
            quotas = QuotaStore(redis, "p")
            await quotas.set_quota(TenantQuota(name="acme", kv_token_seconds_per_min=10**9))
            config = SidecarConfig(
                engine_url=engine.url, redis_url=server.url, pool="p", endpoint_id="pod-o",
                policy=pool_policy(), heartbeat_s=0.2,
            )  # fmt: skip
            body = {
                "text": "charge me",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
                "stream": True,
            }
            headers = {"x-weir-tenant": "acme"}
            held = PoolKeys("p").held_by("sidecar.pod-o")
            unavailable = (
                'weir_sidecar_kv_quota_charges_total{endpoint="pod-o",pool="p",'
                'result="unavailable"} 1.0'
            )
            try:
                async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
                    service = sidecar.service
                    charged = await http.post(sidecar.url + "/generate", json=body, headers=headers)
                    rid = charged.headers["x-weir-request-id"]
                    await read_sse(charged, stop_after=3)
                    assert await redis.smembers(held) == {rid.encode()}
                    await asyncio.to_thread(server.stop)
                    uncharged = await http.post(
                        sidecar.url + "/generate", json=body, headers=headers
                    )
                    assert uncharged.status == 200
                    await read_sse(uncharged, stop_after=3)
                    assert unavailable in service.metrics.exposition().decode()
                    charged.close()
                    uncharged.close()
                    assert await service.ledger.wait_idle(10.0)
                    await service.settled()  # both releases tried against the stopped Redis
                    assert service.quota is not None
                    assert service.quota.held >= 1  # the charged one's release waits
                    # Back with its data (AOF): the waiting release lands (the sidecar may
                    # send it before this test could look at the charge it returns).
                    await asyncio.to_thread(server.start)

                    async def returned() -> bool:
                        assert service.quota is not None
                        return service.quota.held == 0 and not await redis.smembers(held)

                    await _until(returned, timeout_s=30.0)
                    assert await redis.hlen(PoolKeys("p").charges) == 0
            finally:
                await redis.aclose()


async def test_commands_are_executed_once_and_acknowledged(
    engine: RunningEngine, redis_url: str
) -> None:
    redis = connect(RedisSettings(url=redis_url))
    channel = CommandChannel(redis, "p")
    config = SidecarConfig(
        engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-c",
        policy=pool_policy(), heartbeat_s=0.2,
    )  # fmt: skip
    body = {
        "text": "preempt me",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    try:
        async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
            async with http.post(sidecar.url + "/generate", json=body) as resp:
                rid = resp.headers["x-weir-request-id"]
                await read_sse(resp, stop_after=5)
                command = Command(
                    command_id="c-1", pool="p", endpoint_id="pod-c",
                    kind=CommandKind.PREEMPT_REQUEST, request_id=rid,
                )  # fmt: skip
                assert await channel.send(command)
                assert not await channel.send(command)  # one id, one delivery
                rest = await read_sse(resp)
            assert rest.done
            assert rest.events[-1]["meta_info"]["completion_tokens"] == 3000
            assert sidecar.service.ledger.preemptions == 1

            async def acked() -> bool:
                return await channel.pending("pod-c") == 0

            await _until(acked)
            pause = Command(
                command_id="c-2", pool="p", endpoint_id="pod-c",
                kind=CommandKind.PAUSE_ADMISSION,
            )  # fmt: skip
            await channel.send(pause)

            async def paused() -> bool:
                return not sidecar.service.ledger.admission_open

            await _until(paused)
    finally:
        await redis.aclose()


async def test_relief_reads_the_room_its_peers_published(
    engine: RunningEngine, redis_url: str
) -> None:
    """Relief's room elsewhere comes from the pool in Redis: the ready peers' published
    headroom, not its own, and no peer at all when Redis cannot be read."""
    redis = connect(RedisSettings(url=redis_url))
    registry = EndpointRegistry(redis, "p")
    kv = pool_policy().kv

    def peer(endpoint_id: str, used: int, lifecycle: Lifecycle) -> EndpointState:
        return EndpointState(
            pool="p", endpoint_id=endpoint_id, address="http://127.0.0.1:9", model=MODEL,
            kv_capacity_tokens=10_000, kv_used_tokens=used, lifecycle=lifecycle,
        )  # fmt: skip

    try:
        await registry.register(peer("roomy", 1_000, Lifecycle.READY), 30.0)
        await registry.register(peer("full", 9_000, Lifecycle.READY), 30.0)
        await registry.register(peer("leaving", 0, Lifecycle.DRAINING), 30.0)
        config = SidecarConfig(
            engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-r",
            policy=pool_policy(), heartbeat_s=0.2,
        )  # fmt: skip
        async with serve_sidecar(config) as sidecar:
            assert sidecar.link is not None
            rooms = peer_rooms(await sidecar.link.peers(), kv)
            room = 10_000 - kv.safety_tokens(10_000)
            assert rooms == {"roomy": room - 1_000, "full": room - 9_000}
    finally:
        await redis.aclose()
    with RedisServer() as gone:
        url = gone.url
    unreachable = SidecarConfig(
        engine_url=engine.url, redis_url=url, pool="p", endpoint_id="pod-u", policy=pool_policy()
    )
    async with serve_sidecar(unreachable) as sidecar:
        assert sidecar.link is not None
        assert await sidecar.link.peers() == []
