"""A prefill pool's router serves each request as a P/D pair over real reference engines
(each its own endpoint, on a real Redis): one request, two legs, one client stream, with a
decode credit taken before, consumed when the KV lands and released when the pair ends
first (controlplane/router/pd.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from controlplane.contract import Role
from controlplane.router import HandoffSettings
from controlplane.store import CreditStore
from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine
from tests.polling import until
from tests.router.conftest import MODEL, Fleet, make_fleet

pytestmark = pytest.mark.redis

DECODE = "decode-a"
KV_BYTES_PER_TOKEN = 1000  # both routers of the pair price a prompt's KV alike
PROMPT = "the river rises against the weir " * 12  # 396 byte tokens
SLOW_LINK = 2e6  # bytes/s: a 396-token prompt's KV (52 MB) takes 26 s, 1.3 s of wall time


@contextlib.asynccontextmanager
async def pd(
    redis_url: str, *, prefill: int = 1, decode: int = 1, **engine: object
) -> AsyncIterator[tuple[Fleet, Fleet]]:
    """A decode pool (its router publishes the handoff budget) and a prefill pool whose
    router serves the clients."""
    async with (
        make_fleet(redis_url, engines=decode, pool=DECODE, role=Role.DECODE, engine=engine,
                   handoff=HandoffSettings(kv_bytes_per_token=KV_BYTES_PER_TOKEN)) as decode_pool,
        make_fleet(redis_url, engines=prefill, role=Role.PREFILL, engine=engine,
                   handoff=HandoffSettings(DECODE, KV_BYTES_PER_TOKEN)) as prefill_pool,
    ):  # fmt: skip
        pairing = prefill_pool.router.router.pairing
        assert pairing is not None
        await until(lambda: len(pairing.view.snapshot.endpoints) == decode, "the decode pool")
        credits = CreditStore(decode_pool.registry.redis, DECODE)
        await until(lambda: _budget(credits), "the decode pool's budget")
        yield prefill_pool, decode_pool


async def _budget(credits: CreditStore) -> bool:
    return int(await credits.redis.hget(credits.keys.credit_budget, f"max:{DECODE}") or 0) > 0


def body(max_tokens: int = 24, stream: bool = True, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, **extra}  # fmt: skip


async def stream(session: aiohttp.ClientSession, url: str, payload: object) -> tuple[str, Any]:
    """The text a completions stream gave, and its last usage chunk."""
    text, usage = "", None
    async with session.post(url + "/v1/completions", json=payload) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice.get("text") or ""
    return text, usage


async def credit_counts(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
        text = await reply.text()
    counts = {}
    for line in text.splitlines():
        if line.startswith("weir_router_handoff_credits_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def idle(*engines: RunningEngine) -> bool:
    return all(not e.engine.requests and e.engine.kv.used_pages == 0 for e in engines)


async def test_a_pair_streams_what_one_engine_would_and_consumes_its_credit(
    redis_url: str,
) -> None:
    async with (
        pd(redis_url) as (prefill, decode),
        serve_engine(EngineConfig(model=MODEL, max_total_tokens=200_000, speed_factor=20.0))
        as mixed, aiohttp.ClientSession() as session,
    ):  # fmt: skip
        text, usage = await stream(
            session, prefill.url, body(stream_options={"include_usage": True})
        )
        async with session.post(mixed.url + "/v1/completions", json=body(stream=False)) as r:
            alone = (await r.json())["choices"][0]["text"]
        async with session.post(prefill.url + "/v1/completions", json=body(stream=False)) as r:
            unary = await r.json()
        p, d = prefill.engines["e0"], decode.engines["e0"]
        await until(lambda: idle(p, d), "both pools to free the KV")
        credits = CreditStore(prefill.registry.redis, DECODE)
        assert await credits.outstanding(DECODE) == 0
        counts = await credit_counts(prefill.url)
    assert text == alone
    assert unary["choices"][0]["text"] == alone
    counted = (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    assert counted == (len(PROMPT), 24, len(PROMPT) + 24)
    # The prompt was computed once, on the prefill side; the decode side imported it.
    assert p.engine.prompt_tokens_total == 2 * len(PROMPT)
    assert d.engine.imported_tokens_total == 2 * len(PROMPT)
    assert counts["taken"] == 2
    assert counts["consumed"] == 2
    assert counts.get("released", 0) == 0


@pytest.mark.parametrize("stage", ["prefill", "transfer"])
async def test_a_client_that_leaves_mid_prefill_or_mid_transfer_frees_both_pools_and_its_credit(
    redis_url: str, stage: str
) -> None:
    # A prefill in 13 chunks of 0.2 s each, or a transfer of a second.
    engine: dict[str, object] = {"kv_link_bytes_per_s": SLOW_LINK, "speed_factor": 20.0}
    if stage == "prefill":
        engine.update(speed_factor=0.02, chunked_prefill_size=32)
    async with pd(redis_url, **engine) as (prefill, decode), aiohttp.ClientSession() as session:
        p, d = prefill.engines["e0"], decode.engines["e0"]
        credits = CreditStore(prefill.registry.redis, DECODE)
        reply = asyncio.create_task(session.post(prefill.url + "/v1/completions", json=body()))
        if stage == "prefill":
            await until(lambda: bool(p.engine.prefilling), "the prefill to run")
        else:
            await until(lambda: bool(p.engine.inflight), "the KV to be on its way")
        # Both halves hold KV: the prompt on the prefill side, its pages on the decode side.
        assert d.engine.kv.used_pages > 0
        assert await credits.outstanding(DECODE) > 0
        reply.cancel()
        await until(lambda: idle(p, d), "both pools to free the KV")
        await until(lambda: _none_out(credits), "the credit to come back")
        counts = await credit_counts(prefill.url)
    assert counts["released"] == 1
    assert counts.get("consumed", 0) == 0


async def _none_out(credits: CreditStore) -> bool:
    return await credits.outstanding(DECODE) == 0


async def test_a_decode_pool_with_no_room_refuses_before_any_prefill(redis_url: str) -> None:
    """Decode full: the prefill waits for a credit (429 with Retry-After: the client's
    retry) instead of prefilling into a decode queue; room again, and it is served."""
    async with pd(redis_url) as (prefill, decode), aiohttp.ClientSession() as session:
        p = prefill.engines["e0"]
        for state in ("critical", "normal"):
            await decode.report("e0", watermark=state)
            if state == "critical":

                async def refused() -> bool:
                    async with session.post(
                        prefill.url + "/v1/completions", json=body(stream=False)
                    ) as reply:
                        return reply.status == 429 and int(reply.headers["Retry-After"]) >= 1

                await until(refused, "a full decode pool to promise nothing")
                assert p.engine.requests_total == 0  # nothing prefilled
        text, _ = await eventually_text(session, prefill.url)
    assert len(text) == 24
    assert p.engine.requests_total == 1


async def eventually_text(session: aiohttp.ClientSession, url: str) -> tuple[str, Any]:
    for _ in range(200):
        async with session.post(url + "/v1/completions", json=body(stream=False)) as reply:
            if reply.status == 200:
                answer = await reply.json()
                return answer["choices"][0]["text"], answer["usage"]
        await asyncio.sleep(0.05)
    raise AssertionError("never served")


async def test_a_decode_engine_killed_mid_stream_resumes_on_a_new_pair(redis_url: str) -> None:
    async with (
        pd(redis_url, decode=2) as (prefill, decode),
        serve_engine(EngineConfig(model=MODEL, max_total_tokens=200_000, speed_factor=5.0))
        as mixed, aiohttp.ClientSession() as session,
    ):  # fmt: skip
        for engine in decode.engines.values():
            engine.driver.speed_factor = 5.0
        long = body(max_tokens=200, stream_options={"include_usage": True})
        reading = asyncio.create_task(stream(session, prefill.url, long))
        await until(lambda: any(e.engine.decoding for e in decode.engines.values()), "decoding")
        victim = next(e for e in decode.engines.values() if e.engine.decoding)
        await victim.kill()
        text, usage = await reading
        async with session.post(
            mixed.url + "/v1/completions", json={**long, "stream": False}
        ) as reply:
            alone = (await reply.json())["choices"][0]["text"]
        counts = await credit_counts(prefill.url)
    assert text == alone
    assert usage["completion_tokens"] == 200
    assert counts["taken"] == counts["consumed"] == 2  # one per pair


async def test_a_prefill_engine_that_fails_before_the_handoff_moves_the_pair_to_another(
    redis_url: str,
) -> None:
    async with pd(redis_url, prefill=2) as (prefill, decode), aiohttp.ClientSession() as session:
        await prefill.engines["e0"].kill()
        texts = [(await eventually_text(session, prefill.url))[0] for _ in range(4)]
        d = decode.engines["e0"]
        await until(lambda: idle(d, prefill.engines["e1"]), "the pools to free the KV")
    assert all(len(t) == 24 for t in texts)
