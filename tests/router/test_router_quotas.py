"""Tenant quotas hold across router replicas sharing one Redis: concurrency, token rates,
unknown tenants, and slots that come back when a request ends."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from controlplane.contract import KVPolicy, Role, TenantQuota, WatermarkState
from controlplane.router import (
    HandoffSettings,
    QuotaSettings,
    RouterConfig,
    RunningRouter,
    TenantKeys,
    serve_router,
)
from controlplane.store import CreditStore, QuotaStore
from tests.polling import until
from tests.router.conftest import MODEL, POOL, Fleet, make_fleet

pytestmark = pytest.mark.redis

KEYS = TenantKeys({"sk-a": "team-a", "sk-r": "team-rate", "sk-x": "team-unknown"})


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.asynccontextmanager
async def _two_routers(redis_url: str) -> AsyncIterator[tuple[Fleet, RunningRouter]]:
    async with make_fleet(
        redis_url, engines=2, speed_factor=1.0, keys=KEYS, quotas=QuotaSettings(enforce=True)
    ) as fleet:
        quotas = QuotaStore(fleet.registry.redis, POOL)
        await quotas.set_quota(TenantQuota(name="team-a", max_concurrency=2))
        await quotas.set_quota(TenantQuota(name="team-rate", input_tokens_per_min=100))
        second = await serve_router(
            RouterConfig(pool=POOL, model=MODEL, quotas=QuotaSettings(enforce=True)),
            redis_url=redis_url,
            keys=KEYS,
        )
        try:
            await until(lambda: len(second.router.view.snapshot.endpoints) == 2, "replica 2")
            yield fleet, second
        finally:
            await second.close()


async def _open_stream(
    session: aiohttp.ClientSession, url: str, key: str
) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "prompt": "long story", "stream": True, "max_tokens": 3000,
            "ignore_eos": True}  # fmt: skip
    reply = await session.post(url + "/v1/completions", json=body, headers=_auth(key))
    assert reply.status == 200, await reply.text()
    await reply.content.readline()  # admitted and streaming
    return reply


async def _short(
    session: aiohttp.ClientSession, url: str, key: str, prompt: str = "hi"
) -> tuple[int, dict[str, str], Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with session.post(url + "/v1/completions", json=body, headers=_auth(key)) as reply:
        return reply.status, dict(reply.headers), await reply.json()


async def test_concurrency_holds_across_two_router_replicas(redis_url: str) -> None:
    async with _two_routers(redis_url) as (fleet, second), aiohttp.ClientSession() as session:
        first = await _open_stream(session, fleet.url, "sk-a")
        other = await _open_stream(session, second.url, "sk-a")
        for url in (fleet.url, second.url):
            status, headers, body = await _short(session, url, "sk-a")
            assert status == 429
            assert body["error"]["reason"] == "concurrency"
            assert int(headers["Retry-After"]) >= 1
        first.close()  # the client goes away: its slot comes back once the release lands

        async def admitted() -> bool:
            status, _, _ = await _short(session, second.url, "sk-a")
            assert status in (200, 429)
            return bool(status == 200)

        await until(admitted, "the slot to come back")
        other.close()


async def test_token_rates_unknown_tenants_and_oversized_requests(redis_url: str) -> None:
    async with _two_routers(redis_url) as (fleet, second), aiohttp.ClientSession() as session:
        status, _, _ = await _short(session, fleet.url, "sk-r", "x" * 60)
        assert status == 200
        status, headers, body = await _short(session, second.url, "sk-r", "y" * 60)
        assert status == 429
        assert body["error"]["reason"] == "input_tokens"
        assert int(headers["Retry-After"]) >= 1
        status, _, body = await _short(session, fleet.url, "sk-r", "z" * 150)
        assert (status, body["error"]["reason"]) == (400, "exceeds_quota")
        status, _, body = await _short(session, fleet.url, "sk-x")
        assert (status, body["error"]["reason"]) == (403, "unknown_tenant")
        async with session.get(fleet.url + "/metrics") as reply:
            exposition = await reply.text()
        assert (
            'weir_router_quota_utilization_ratio{pool="router-test",resource="input_tokens",tenant="team-rate"}'
            in exposition
        )


async def test_a_decode_pools_router_publishes_the_handoff_budget_its_sidecars_would_admit(
    redis_url: str,
) -> None:
    """No one sets the budget by hand: the decode pool's router publishes it from its view
    (every endpoint's room, and the largest one's, which bounds one credit), and a prefill
    pool's router admits against it; a decode pool at critical promises nothing."""
    kv = KVPolicy(emergency_watermark=0.95)
    async with (
        make_fleet(redis_url, engines=2, pool="decode-a", role=Role.DECODE,
                   handoff=HandoffSettings(kv_bytes_per_token=1000, kv=kv)) as decode,
        make_fleet(redis_url, engines=1, role=Role.PREFILL,
                   handoff=HandoffSettings("decode-a", kv_bytes_per_token=1000)) as prefill,
        aiohttp.ClientSession() as session,
    ):  # fmt: skip
        redis = decode.registry.redis
        room = 200_000 - kv.safety_tokens(200_000)  # per endpoint, in tokens, when idle
        await decode.report("e1", kv_used_tokens=50_000)

        async def published() -> bool:
            budget = await redis.hgetall(CreditStore(redis, "decode-a").keys.credit_budget)
            return budget.get(b"cap:decode-a") == str((2 * room - 50_000) * 1000).encode() and (
                budget.get(b"max:decode-a") == str(room * 1000).encode()
            )

        await until(published, "the decode router to publish its budget")
        status, _, body = await _short(session, prefill.url, "")
        assert status == 200, body
        for endpoint_id in ("e0", "e1"):
            await decode.report(endpoint_id, watermark=WatermarkState.CRITICAL)

        async def refused() -> bool:
            status, headers, body = await _short(session, prefill.url, "")
            return (status, body.get("error", {}).get("reason")) == (429, "decode_credit") and (
                int(headers["Retry-After"]) >= 1
            )

        await until(refused, "a critical decode pool to promise nothing")


async def test_quotas_the_control_plane_lost_are_published_again_from_the_policy(
    redis_url: str,
) -> None:
    """A Redis restarted without persistence forgets the quotas; the router's policy still
    declares them, so the first charge against the empty store publishes them again
    (instead of refusing every tenant as unknown) and they hold from then on."""
    policy = (TenantQuota(name="team-a", max_concurrency=1),)
    async with (
        make_fleet(
            redis_url,
            engines=1,
            speed_factor=1.0,
            keys=KEYS,
            quotas=QuotaSettings(enforce=True, tenants=policy),
        ) as fleet,
        aiohttp.ClientSession() as session,
    ):
        store = QuotaStore(fleet.registry.redis, POOL)
        assert await store.get_quota("team-a") == policy[0]
        await fleet.registry.redis.delete(store.keys.quotas, store.keys.quota_records)
        assert await store.get_quota("team-a") is None
        stream = await _open_stream(session, fleet.url, "sk-a")
        assert await store.get_quota("team-a") == policy[0]
        status, _, body = await _short(session, fleet.url, "sk-a")
        assert (status, body["error"]["reason"]) == (429, "concurrency")
        stream.close()
        # A tenant the policy does not declare is still unknown.
        status, _, body = await _short(session, fleet.url, "sk-x")
        assert (status, body["error"]["reason"]) == (403, "unknown_tenant")


async def test_a_burst_of_concurrent_requests_waits_for_redis_connections_rather_than_failing(
    redis_url: str,
) -> None:
    """More requests at once than the Redis client has connections: each quota charge waits
    for a connection instead of failing with 503 quota_unavailable (redis-py's default
    pool refuses the 65th caller with "Too many connections")."""
    burst = 200
    policy = (TenantQuota(name="team-a", max_concurrency=burst),)
    async with (
        make_fleet(
            redis_url, engines=2, keys=KEYS, quotas=QuotaSettings(enforce=True, tenants=policy)
        ) as fleet,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        replies = await asyncio.gather(
            *(_short(session, fleet.url, "sk-a", f"burst {i}") for i in range(burst))
        )
        statuses = collections.Counter(status for status, _, _ in replies)
        assert statuses == {200: burst}, [body for status, _, body in replies if status != 200][:3]
        store = QuotaStore(fleet.registry.redis, POOL)

        async def released() -> bool:
            return (await store.usage("team-a")).concurrency == 0

        await until(released, "every charge to be released")
