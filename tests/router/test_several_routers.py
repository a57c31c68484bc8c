"""Several routers on one pool behave like one (the chart scales routers with an HPA).

Three `weir router` processes follow one pool of real sidecars and reference engines in a
real Redis (`weir up --routers 3`'s fleet), and clients spread over them round-robin, as a
Service spreads connections. What must hold: a tenant's quota is exact across the three
(charged atomically in Redis: N streams, the N+1th refused on any router, every counter
back to zero after, each token charged once); requests sharing a prefix land on its owner
whichever router they enter (every router computes the same owners from the same
membership); and the same traffic leaves the endpoints as balanced as one router does,
give or take one request per router (each counts only its own dispatches until the
endpoints report them).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import aiohttp
import pytest

from controlplane.contract import TenantQuota
from controlplane.store import QuotaStore, RedisSettings, connect
from tests.polling import until
from weir.local.exposition import counter
from weir.local.fleet import DEMO_TENANTS, FleetConfig, LocalFleet

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROUTERS = 3
STREAMS = 4  # the capped tenant's concurrency
ANSWER = 300  # tokens per capped stream: its output budget is exactly STREAMS answers
CAPPED = TenantQuota(name="capped", max_concurrency=STREAMS, output_tokens_per_min=STREAMS * ANSWER)
_MODEL = FleetConfig().model


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalFleet]:
    config = FleetConfig(
        engines=3, routers=ROUTERS, router_port=0, tenants=(DEMO_TENANTS[0], CAPPED)
    )
    with LocalFleet(config) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


def _prompt(prefix: int, question: str) -> str:
    """A system prompt longer than the blocks ownership keys on, and a question."""
    return f"system prompt {prefix}: you answer questions about weirs. " * 6 + question


def _body(prompt: str, max_tokens: int) -> dict[str, object]:
    return {"model": _MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip


async def _open(
    http: aiohttp.ClientSession, router: str, body: dict[str, object], tenant: str = "default"
) -> aiohttp.ClientResponse:
    """A stream admitted and streaming (its first event read)."""
    reply = await http.post(
        router + "/v1/completions", json=body, headers={"x-weir-tenant": tenant}
    )
    assert reply.status == 200, await reply.text()
    while not (await reply.content.readline()).startswith(b"data: {"):
        pass
    return reply


async def _finish(reply: aiohttp.ClientResponse) -> str:
    """Read a stream to its end: its finish reason."""
    finish = ""
    async for line in reply.content:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or ():
                finish = choice.get("finish_reason") or finish
    reply.release()
    return finish


async def _refusal(http: aiohttp.ClientSession, router: str, tenant: str) -> tuple[int, str]:
    body = {"model": _MODEL, "prompt": "one more?", "max_tokens": ANSWER}
    headers = {"x-weir-tenant": tenant}
    async with http.post(router + "/v1/completions", json=body, headers=headers) as reply:
        return reply.status, (await reply.json()).get("error", {}).get("reason", "")


async def _pool(http: aiohttp.ClientSession, router: str) -> list[dict[str, int]]:
    async with http.get(router + "/weir/v1/pool") as reply:
        endpoints: list[dict[str, int]] = (await reply.json())["endpoints"]
        return endpoints


async def _settled(http: aiohttp.ClientSession, fleet: LocalFleet, held: int) -> None:
    """Until every router's view shows the `held` requests in the endpoints' reports and
    none of its own dispatches waiting for one: the routers agree on the pool's load."""

    async def agreed() -> bool:
        for router in fleet.router_urls:
            endpoints = await _pool(http, router)
            reported = sum(e["running_requests"] + e["queued_requests"] for e in endpoints)
            if reported != held or any(e["router_inflight"] for e in endpoints):
                return False
        return True

    await until(agreed, f"every router to see {held} requests reported")


async def _loads(http: aiohttp.ClientSession, fleet: LocalFleet) -> list[int]:
    """The requests each endpoint holds, as its sidecar counts them."""
    loads = []
    for sidecar in fleet.sidecar_urls:
        async with http.get(sidecar + "/weir/v1/state") as reply:
            loads.append(len((await reply.json())["requests"]))
    return loads


async def test_a_tenants_quota_is_exact_across_three_routers(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    redis = connect(RedisSettings(url=fleet.redis_url))
    store = QuotaStore(redis, fleet.config.pool)
    try:
        opened = time.monotonic()
        streams = await asyncio.gather(
            *(
                _open(http, fleet.router_urls[i % ROUTERS], _body(f"tell {i}", ANSWER), "capped")
                for i in range(STREAMS)
            )
        )
        window_s = time.monotonic() - opened  # every charge happened within it
        for router in fleet.router_urls:
            assert await _refusal(http, router, "capped") == (429, "concurrency")
        assert (await store.usage("capped")).concurrency == STREAMS
        assert await asyncio.gather(*(_finish(s) for s in streams)) == ["length"] * STREAMS

        keys = store.keys

        async def released() -> bool:  # the routers' charges, and the sidecars' (KV)
            return await redis.hlen(keys.charges) == 0

        await until(released, "every charge to be released")
        assert (await store.usage("capped")).concurrency == 0
        assert int(await redis.hget(keys.classes, f"u:{CAPPED.priority_class}") or 0) == 0
        for holder in await redis.zrange(keys.holders, 0, -1):
            assert await redis.scard(keys.held_by(holder.decode())) == 0
        # Each stream was charged its whole answer once and used all of it (no refund):
        # the bucket holds only what refilled while the charges were made.
        refill_per_s = CAPPED.output_tokens_per_min / 60
        left = (await store.usage("capped")).output_tokens_left
        assert 0 <= left <= refill_per_s * window_s + 1e-6
    finally:
        await redis.aclose()


async def test_requests_sharing_a_prefix_land_on_its_owner_through_any_router(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    prefixes = range(6)
    decisions = "weir_router_decisions_total"
    before = [await counter(http, r, decisions, reason="primary_owner") for r in fleet.router_urls]
    landed: dict[int, set[str]] = {p: set() for p in prefixes}
    for prefix in prefixes:
        for i, router in enumerate(fleet.router_urls):
            await _settled(http, fleet, 0)  # the same idle pool in every router's view
            reply = await _open(http, router, _body(_prompt(prefix, f"question {i}?"), 4))
            landed[prefix].add(reply.headers["x-weir-endpoint"])
            assert await _finish(reply) == "length"
    assert all(len(endpoints) == 1 for endpoints in landed.values()), landed
    assert len(set().union(*landed.values())) > 1  # the prefixes have different owners
    after = [await counter(http, r, decisions, reason="primary_owner") for r in fleet.router_urls]
    assert [b - a for a, b in zip(before, after, strict=True)] == [len(prefixes)] * ROUTERS


async def _held_bursts(
    http: aiohttp.ClientSession, fleet: LocalFleet, routers: Sequence[str]
) -> list[list[int]]:
    """Four bursts of six long streams (seeded prompts over eight shared system prompts),
    each sent at once round-robin over `routers` and held; after each, once every router
    agrees on the load, each endpoint's requests. Every stream is cancelled at the end."""
    rng = random.Random(11)
    held: list[aiohttp.ClientResponse] = []
    seen = []
    try:
        for burst in range(4):
            bodies = [
                _body(_prompt(rng.randrange(8), f"burst {burst} question {i}?"), 8000)
                for i in range(6)
            ]
            held += await asyncio.gather(
                *(_open(http, routers[i % len(routers)], b) for i, b in enumerate(bodies))
            )
            await _settled(http, fleet, len(held))
            seen.append(await _loads(http, fleet))
    finally:
        for reply in held:
            reply.close()  # the client goes away: the router aborts it upstream
    await _settled(http, fleet, 0)
    return seen


async def test_three_routers_balance_the_same_traffic_as_one_give_or_take_a_request_each(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    one = await _held_bursts(http, fleet, fleet.router_urls[:1])
    three = await _held_bursts(http, fleet, fleet.router_urls)
    for loads_one, loads_three in zip(one, three, strict=True):
        assert sum(loads_one) == sum(loads_three)
        # No endpoint takes more than one request per router while another is idle...
        for loads, routers in ((loads_one, 1), (loads_three, ROUTERS)):
            assert min(loads) > 0 or max(loads) <= routers, (one, three)
        # ...and the busiest holds at most one more per other router than with one router.
        assert max(loads_three) <= max(loads_one) + ROUTERS - 1, (one, three)
