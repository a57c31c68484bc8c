"""What the router reads from clients is bounded (docs/security.md, "Limits on what clients
send"): a body over the limit is refused with 413 before it is read, bodies being read share
a budget of bytes (more wait, then 503) while small requests pass, a head or body sent too
slowly and an idle keep-alive connection are closed, and connections past the cap are
refused; none of it cuts a long event stream."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from controlplane.router import RequestLimits, RouterConfig, RunningRouter, serve_router
from controlplane.transport.guard import LARGE_BODY, LIMITS, ServerLimits, body_limit
from engine_sidecar.server import SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import serve_engine
from tests.exposition import by_label
from tests.polling import until
from tests.router.conftest import MODEL
from tests.transport.raw_client import RawConnection, chunk, request_head

CONTEXT = 1000
COMPLETIONS = "/v1/completions"


@contextlib.asynccontextmanager
async def router(limits: ServerLimits, speed_factor: float = 50.0) -> AsyncIterator[RunningRouter]:
    """A router with `limits` in front of one reference engine."""
    async with serve_engine(
        EngineConfig(model=MODEL, max_total_tokens=50_000, speed_factor=speed_factor)
    ) as engine:
        running = await serve_router(
            RouterConfig(model=MODEL, limits=RequestLimits(context_length=CONTEXT), server=limits),
            endpoints=[engine.url],
        )
        try:
            yield running
        finally:
            await running.close()


def completion(prompt: str | list[int] = "hi", **extra: object) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra})


async def test_the_body_limit_is_sized_to_the_context_and_a_larger_body_gets_413() -> None:
    limit = body_limit(CONTEXT)
    assert limit == (1 << 20) + CONTEXT * 40
    async with router(ServerLimits()) as running, aiohttp.ClientSession() as http:
        assert running.router.guard.limits.max_body_bytes == limit
        # Just under the limit, with a junk field: read, and served.
        pad = limit - len(completion(junk=""))
        async with http.post(
            running.url + COMPLETIONS, data=io.BytesIO(completion(junk="x" * pad))
        ) as r:
            assert r.status == 200, await r.text()
        # Over it, declared: refused before the body is read, in the router's error format.
        async with http.post(
            running.url + COMPLETIONS, data=io.BytesIO(completion(junk="x" * (pad + 1)))
        ) as r:
            assert r.status == 413
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["reason"] == "body_too_large"
        assert str(limit) in error["message"]

        # Over it, chunked (no length declared): refused once the body grows past it.
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(2 * limit // 65536):
                yield b"x" * 65536

        async with http.post(running.url + COMPLETIONS, data=chunks()) as r:
            assert r.status == 413
            assert (await r.json())["error"]["reason"] == "body_too_large"
        # And the router still serves.
        async with http.post(running.url + COMPLETIONS, data=completion()) as r:
            assert r.status == 200


async def test_a_body_of_many_small_containers_is_refused_a_long_prompt_is_not() -> None:
    """Under the size limit, `[[],[],...]` would still decode to ~22 times its size in
    Python objects: past one JSON value per 10 bytes of the limit it is refused."""
    async with router(ServerLimits()) as running, aiohttp.ClientSession() as http:
        guard = running.router.guard
        most = guard.limits.max_body_bytes // 10
        flood = msgspec.Raw(b"[" + b",".join([b"[]"] * (most // 2 + 1)) + b"]")
        async with http.post(running.url + COMPLETIONS, data=completion(junk=flood)) as r:
            assert r.status == 413
            error = (await r.json())["error"]
        assert error["reason"] == "body_too_complex"
        assert f"at most {most}" in error["message"]
        assert guard.refused["body_too_complex"] == 1
        # A prompt that fills the context, as token ids or as text full of commas and
        # brackets, in a large body (of a long field besides), is read and served.
        pad = "x" * (2 * LARGE_BODY)
        ids = [i % 256 for i in range(CONTEXT - 10)]
        for prompt in (ids, "[1,{2}]," * 120):
            async with http.post(running.url + COMPLETIONS, data=completion(prompt, pad=pad)) as r:
                assert r.status == 200, await r.text()
        assert guard.refused["body_too_complex"] == 1


async def test_a_declared_length_over_the_limit_is_refused_without_waiting_for_the_body() -> None:
    async with router(ServerLimits(body_timeout_s=60)) as running:
        conn = await RawConnection.open(running.url)
        # 100 MiB declared, 10 bytes sent: the answer cannot wait for the rest.
        await conn.send(request_head(COMPLETIONS, 100 << 20) + b'{"model": ')
        answer = await conn.answer(timeout_s=10)
        assert answer.status == 413
        assert answer.error()["reason"] == "body_too_large"
        await conn.close()
        # Chunked, on the wire: the same once past the limit.
        conn = await RawConnection.open(running.url)
        await conn.send(request_head(COMPLETIONS, None))
        limit = running.router.guard.limits.max_body_bytes
        for _ in range(limit // 65536 + 2):
            await conn.send(chunk(b"x" * 65536))
        answer = await conn.answer(timeout_s=10)
        assert answer.status == 413
        assert answer.error()["reason"] == "body_too_large"
        await conn.close()


async def test_bodies_past_the_in_flight_budget_wait_while_small_requests_pass() -> None:
    kib = 1024
    limits = ServerLimits(max_body_bytes=256 * kib, max_body_bytes_in_flight=512 * kib)
    async with router(limits) as running, aiohttp.ClientSession() as http:
        budget = running.router.guard.budget
        big = completion(junk="x" * (200 * kib))
        # Three large bodies, each half sent: two fit in the budget, the third waits.
        conns = [await RawConnection.open(running.url) for _ in range(3)]
        for i, conn in enumerate(conns):
            await conn.send(request_head(COMPLETIONS, len(big)) + big[:1000])
            held, waits = min(i + 1, 2) * len(big), i // 2

            def placed(held: int = held, waits: int = waits) -> bool:
                return budget.used == held and budget.waits == waits

            await until(placed, f"body {i} to hold its share or wait")
        # A small request fits beside them, and is served meanwhile.
        async with http.post(running.url + COMPLETIONS, data=completion()) as r:
            assert r.status == 200
        # The first body completes: its share passes to the third.
        for conn in conns:
            await conn.send(big[1000:])
        for conn in conns:
            answer = await conn.answer()
            assert answer.status == 200, answer
            await conn.close()
        assert budget.peak <= budget.capacity
        assert budget.used == 0


async def test_a_body_that_finds_the_budget_spent_too_long_gets_503() -> None:
    limits = ServerLimits(
        max_body_bytes=64 * 1024, max_body_bytes_in_flight=64 * 1024, body_wait_s=0.3
    )
    async with router(limits) as running:
        holder = await RawConnection.open(running.url)
        await holder.send(request_head(COMPLETIONS, 60_000) + b"{")
        budget = running.router.guard.budget
        await until(lambda: budget.used == 60_000, "the first body's reservation")
        late = await RawConnection.open(running.url)
        await late.send(request_head(COMPLETIONS, 10_000) + b"{")
        answer = await late.answer()
        assert answer.status == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.error()["reason"] == "body_budget"
        assert answer.error()["type"] == "unavailable"
        for conn in (holder, late):
            await conn.close()


async def test_a_head_sent_too_slowly_is_closed() -> None:
    async with router(ServerLimits(header_timeout_s=0.5, idle_timeout_s=60)) as running:
        conn = await RawConnection.open(running.url)
        await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for i in range(600):
                    await conn.send(b"x-slow-%d: 1\r\n" % i)
                    await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        assert await conn.closed_by_server(timeout_s=20)
        trickling.cancel()
        assert running.router.guard.closed["header_timeout"] == 1
        await conn.close()


async def test_a_body_sent_too_slowly_gets_408_and_the_connection_ends() -> None:
    async with router(ServerLimits(body_timeout_s=0.5, idle_timeout_s=60)) as running:
        conn = await RawConnection.open(running.url)
        body = completion()
        await conn.send(request_head(COMPLETIONS, len(body)) + body[:3])

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for byte in body[3:-1]:
                    await conn.send(bytes([byte]))
                    await asyncio.sleep(0.2)

        trickling = asyncio.create_task(trickle())
        answer = await conn.answer(timeout_s=20)
        assert answer.status == 408
        assert answer.headers["connection"] == "close"
        error = answer.error()
        assert error.pop("request_id")  # the id the router gave it
        assert error == {
            "type": "invalid_request_error",
            "reason": "body_timeout",
            "message": "the request body did not arrive within 0.5s",
        }
        assert await conn.closed_by_server(timeout_s=5)
        trickling.cancel()
        await conn.close()


async def test_idle_connections_are_closed_and_busy_ones_kept() -> None:
    async with router(ServerLimits(idle_timeout_s=0.5, header_timeout_s=30)) as running:
        silent = await RawConnection.open(running.url)  # never sends a byte
        kept_alive = await RawConnection.open(running.url)
        await kept_alive.send(request_head("/health", method="GET"))
        assert (await kept_alive.answer()).status == 200
        # Used again within the timeout: still open, and timed afresh after its request.
        await kept_alive.send(request_head("/health", method="GET"))
        assert (await kept_alive.answer()).status == 200
        assert await silent.closed_by_server(timeout_s=20)
        assert await kept_alive.closed_by_server(timeout_s=20)
        assert running.router.guard.closed["idle_timeout"] == 2
        assert running.router.guard.open == 0
        for conn in (silent, kept_alive):
            await conn.close()


async def test_connections_past_the_cap_are_refused_and_the_open_ones_keep_working() -> None:
    async with router(ServerLimits(max_connections=3)) as running:
        guard = running.router.guard
        conns = [await RawConnection.open(running.url) for _ in range(3)]
        await until(lambda: guard.open == 3, "three connections")
        extra = await RawConnection.open(running.url)
        answer = await extra.answer()
        assert answer.status == 503
        assert answer.error()["reason"] == "too_many_connections"
        assert await extra.closed_by_server()
        for conn in conns:  # every open connection still serves
            await conn.send(request_head("/health", method="GET"))
            assert (await conn.answer()).status == 200
        await conns.pop().close()
        await until(lambda: guard.open == 2, "a connection to close")
        again = await RawConnection.open(running.url)  # room again
        await again.send(request_head("/health", method="GET"))
        assert (await again.answer()).status == 200
        assert guard.closed["too_many_connections"] == 1
        hits = by_label(
            running.router.metrics.exposition(), "weir_router_client_limits_total", "limit"
        )
        assert hits == dict.fromkeys(LIMITS, 0.0) | {"too_many_connections": 1.0}
        for conn in [*conns, again, extra]:
            await conn.close()


async def test_a_long_stream_outlives_every_timeout_through_router_and_sidecar() -> None:
    limits = ServerLimits(header_timeout_s=0.3, body_timeout_s=0.3, idle_timeout_s=0.3)
    tokens = 120
    async with (
        serve_engine(
            EngineConfig(model=MODEL, max_total_tokens=50_000, speed_factor=0.5)
        ) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, server=limits)) as sidecar,
    ):
        running = await serve_router(
            RouterConfig(model=MODEL, server=limits), endpoints=[sidecar.url]
        )
        try:
            body = {
                "model": MODEL, "prompt": "a long one", "max_tokens": tokens,
                "ignore_eos": True, "stream": True,
            }  # fmt: skip
            loop = asyncio.get_running_loop()
            started = loop.time()
            events = []
            async with (
                aiohttp.ClientSession() as http,
                http.post(running.url + COMPLETIONS, json=body) as reply,
            ):
                assert reply.status == 200
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        events.append(msgspec.json.decode(line[6:]))
            elapsed = loop.time() - started
        finally:
            await running.close()
    # The stream ran far longer than any timeout, and ended as it should.
    assert elapsed > 3 * 0.3
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events if e["choices"][0]["text"]) == tokens
    assert running.router.guard.closed == {
        "header_timeout": 0, "idle_timeout": 0, "too_many_connections": 0,
    }  # fmt: skip


def test_limits_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one largest body"):
        ServerLimits(max_body_bytes=100, max_body_bytes_in_flight=50)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServerLimits(max_connections=0)
