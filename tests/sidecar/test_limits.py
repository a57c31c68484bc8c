"""What the sidecar reads from routers is bounded as the router's is (docs/security.md,
"Limits on what clients send"): bodies by a limit sized to the context (a continuation gets
twice the room), refused with 413 in the sidecar's error format on every route that reads
one; heads and bodies sent too slowly, idle connections, and connections past the cap."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator

import aiohttp
import msgspec

from controlplane.contract import Continuation, EngineAPI, encode_json
from controlplane.transport.guard import LIMITS, ServerLimits, body_limit
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import serve_engine
from tests.exposition import by_label
from tests.sidecar.conftest import MODEL, engine_config, pool_policy
from tests.transport.raw_client import RawConnection, chunk, request_head

CONTEXT = 4096  # the pool policy's and the engine's


@contextlib.asynccontextmanager
async def sidecar(limits: ServerLimits) -> AsyncIterator[RunningSidecar]:
    async with (
        serve_engine(engine_config()) as engine,
        serve_sidecar(
            SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy(), server=limits)
        ) as running,
    ):
        yield running


def generate(**extra: object) -> bytes:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, **extra}
    return msgspec.json.encode(body)


async def test_a_body_over_the_limit_gets_413_on_every_route_that_reads_one() -> None:
    limit = body_limit(CONTEXT)
    async with sidecar(ServerLimits()) as sc, aiohttp.ClientSession() as http:
        assert sc.service.guard.limits.max_body_bytes == limit
        pad = limit - len(generate(junk=""))
        async with http.post(sc.url + "/generate", data=io.BytesIO(generate(junk="x" * pad))) as r:
            assert r.status == 200, await r.text()
        big = io.BytesIO(msgspec.json.encode({"rid": "r", "junk": "x" * limit}))
        for path in ("/generate", "/v1/completions", "/abort_request", "/weir/v1/drain"):
            big.seek(0)
            async with http.post(sc.url + path, data=big) as r:
                assert r.status == 413, path
                error = (await r.json())["error"]
            assert error["type"] == "invalid_request"
            assert error["reason"] == "body_too_large"
            assert str(limit) in error["message"]

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(2 * limit // 65536):
                yield b"x" * 65536

        async with http.post(sc.url + "/v1/chat/completions", data=chunks()) as r:
            assert r.status == 413
            assert (await r.json())["error"]["reason"] == "body_too_large"
        assert not sc.service.draining  # the refused drain did nothing
        async with http.post(sc.url + "/generate", data=generate()) as r:
            assert r.status == 200


async def test_a_continuation_gets_twice_the_room() -> None:
    limit = body_limit(CONTEXT)
    async with sidecar(ServerLimits()) as sc, aiohttp.ClientSession() as http:
        assert sc.service.continuation_limit == 2 * limit

        def continuation(padding: int) -> bytes:
            return encode_json(
                Continuation(
                    request_id="r-big", model=MODEL, api=EngineAPI.GENERATE,
                    body={"text": "hi", "sampling_params": {"max_new_tokens": 8},
                          "junk": "x" * padding},
                    generated_text="ab", generated_tokens=2, max_new_tokens=8,
                )
            )  # fmt: skip

        over_one = continuation(limit)
        assert limit < len(over_one) < 2 * limit
        async with http.post(sc.url + "/weir/v1/continue", data=io.BytesIO(over_one)) as r:
            assert r.status == 200
            await r.read()
        over_two = continuation(2 * limit)
        async with http.post(sc.url + "/weir/v1/continue", data=io.BytesIO(over_two)) as r:
            assert r.status == 413
            assert (await r.json())["error"]["reason"] == "body_too_large"


async def test_a_declared_length_over_the_limit_is_refused_before_the_body_arrives() -> None:
    async with sidecar(ServerLimits()) as sc:
        conn = await RawConnection.open(sc.url)
        await conn.send(request_head("/generate", 100 << 20) + b'{"text": ')
        answer = await conn.answer(timeout_s=10)
        assert answer.status == 413
        assert answer.error()["reason"] == "body_too_large"
        await conn.close()
        conn = await RawConnection.open(sc.url)  # chunked, on the wire
        await conn.send(request_head("/generate", None))
        for _ in range(sc.service.guard.limits.max_body_bytes // 65536 + 2):
            await conn.send(chunk(b"x" * 65536))
        answer = await conn.answer(timeout_s=10)
        assert answer.status == 413
        await conn.close()


async def test_slow_heads_slow_bodies_and_idle_connections_are_closed() -> None:
    limits = ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=1.0)
    async with sidecar(limits) as sc:
        guard = sc.service.guard
        slow_head = await RawConnection.open(sc.url)
        await slow_head.send(b"POST /generate HTTP/1.1\r\nHost: test\r\n")
        slow_body = await RawConnection.open(sc.url)
        body = generate()
        await slow_body.send(request_head("/generate", len(body)) + body[:2])
        idle = await RawConnection.open(sc.url)

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for i in range(300):
                    await slow_head.send(b"x-slow-%d: 1\r\n" % i)
                    await slow_body.send(b" ")
                    await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        answer = await slow_body.answer(timeout_s=20)
        assert answer.status == 408
        assert answer.error()["reason"] == "body_timeout"
        assert answer.error()["type"] == "invalid_request"
        for conn in (slow_head, slow_body, idle):
            assert await conn.closed_by_server(timeout_s=20)
        trickling.cancel()
        assert guard.closed["header_timeout"] == 1
        assert guard.closed["idle_timeout"] == 1
        assert guard.refused["body_timeout"] == 1
        hits = by_label(
            sc.service.metrics.exposition(), "weir_sidecar_client_limits_total", "limit"
        )
        assert hits == dict.fromkeys(LIMITS, 0.0) | {
            "header_timeout": 1.0, "idle_timeout": 1.0, "body_timeout": 1.0,
        }  # fmt: skip
        for conn in (slow_head, slow_body, idle):
            await conn.close()
        assert sc.service.ledger.flights == {}


async def test_connections_past_the_cap_are_refused() -> None:
    async with sidecar(ServerLimits(max_connections=2)) as sc:
        conns = [await RawConnection.open(sc.url) for _ in range(2)]
        extra = await RawConnection.open(sc.url)
        answer = await extra.answer()
        assert answer.status == 503
        assert answer.error()["reason"] == "too_many_connections"
        for conn in conns:
            await conn.send(request_head("/health", method="GET"))
            assert (await conn.answer()).status == 200
        for conn in [*conns, extra]:
            await conn.close()
