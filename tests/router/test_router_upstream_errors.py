"""What the router counts when an endpoint fails before the first byte: each way of
failing under its own `weir_router_retries_total` reason (a refused connect is not a
timeout, and neither is a malformed answer), every one of them still retried elsewhere
(here there is nowhere else: 429 once the endpoints are spent)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import aiohttp
import msgspec
import pytest

from controlplane.router import RouterConfig, RunningRouter, UpstreamSettings, serve_router
from controlplane.router.metrics import RETRY_REASONS
from tests.router.conftest import MODEL
from tests.transport.raw_server import (
    answering,
    free_port,
    hang_up,
    silent,
    tcp_server,
    unanswered_listener,
)

COMPLETION = msgspec.json.encode({"model": MODEL, "prompt": "hi", "max_tokens": 4})


@contextlib.asynccontextmanager
async def refused_port() -> AsyncIterator[str]:
    yield f"http://127.0.0.1:{free_port()}"


@contextlib.asynccontextmanager
async def router(endpoint: str, upstream: UpstreamSettings) -> AsyncIterator[RunningRouter]:
    running = await serve_router(RouterConfig(model=MODEL, upstream=upstream), endpoints=[endpoint])
    try:
        yield running
    finally:
        await running.close()


def retries(running: RunningRouter) -> dict[str, float]:
    """Each retry reason's count, the ones at zero left out."""
    router = running.router
    counts = {
        reason: router.metrics.registry.get_sample_value(
            "weir_router_retries_total", {"pool": router.config.pool, "reason": reason}
        )
        for reason in RETRY_REASONS
    }
    return {reason: n for reason, n in counts.items() if n}


# Each failing endpoint, and the router settings that make it fail that way (short
# timeouts only where the failure is a timeout: elsewhere a busy machine could time out
# before the endpoint's answer arrives).
UPSTREAMS: dict[str, tuple[Callable[[], AbstractAsyncContextManager[str]], UpstreamSettings]] = {
    "connect_error": (refused_port, UpstreamSettings()),
    "connect_timeout": (unanswered_listener, UpstreamSettings(connect_timeout_s=0.3)),
    "read_timeout": (lambda: tcp_server(silent), UpstreamSettings(chunk_timeout_s=0.3)),
    "protocol_error": (
        lambda: tcp_server(answering(b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}")),
        UpstreamSettings(),
    ),
    "connection_closed": (lambda: tcp_server(hang_up), UpstreamSettings()),
}


@pytest.mark.parametrize("reason", UPSTREAMS)
async def test_a_failure_before_the_first_byte_is_counted_as_what_it_was(reason: str) -> None:
    upstream, settings = UPSTREAMS[reason]
    async with (
        upstream() as endpoint,
        router(endpoint, settings) as running,
        aiohttp.ClientSession() as http,
        http.post(running.url + "/v1/completions", data=COMPLETION) as reply,
    ):
        assert reply.status == 429  # retried, and no endpoint was left to retry on
        error = (await reply.json())["error"]
        assert error["reason"] == "endpoints_overloaded"
    assert retries(running) == {reason: 1}


async def test_an_endpoint_whose_connections_are_all_busy_is_a_pool_timeout() -> None:
    seen, release = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.set()
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\n\r\n{}")  # fmt: skip
        await writer.drain()
        await reader.read()

    async with (
        tcp_server(slow) as endpoint,
        router(endpoint, UpstreamSettings(max_connections=1, connect_timeout_s=0.5)) as running,
        aiohttp.ClientSession() as http,
    ):

        async def complete() -> int:
            async with http.post(running.url + "/v1/completions", data=COMPLETION) as reply:
                await reply.read()
                return reply.status

        first = asyncio.ensure_future(complete())
        await seen.wait()  # the one connection the router may open is taken
        assert await complete() == 429
        release.set()
        assert await first == 200
    assert retries(running) == {"pool_timeout": 1}
