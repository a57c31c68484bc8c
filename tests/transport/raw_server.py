"""A plain TCP server that answers HTTP requests with whatever bytes a test gives it: for
the HTTP client's (and the router's) handling of upstreams that misbehave on cue."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def tcp_server(handle: Handler) -> AsyncIterator[str]:
    """Serves `handle` per connection; at the end, waits for every handler to finish."""
    handlers: list[asyncio.Task[None]] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await asyncio.wait_for(asyncio.gather(*handlers), 5.0)
        server.close()
        await server.wait_closed()


def answering(raw: bytes) -> Handler:
    """A server that answers every request with `raw`, then nothing until the client
    gives up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        await reader.read()

    return handle


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the request, answers nothing, until the client gives up."""
    await reader.read()


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the request's head and closes the connection without an answer."""
    await reader.readuntil(b"\r\n\r\n")


def free_port() -> int:
    """A loopback port nothing listens on (a connect to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@asynccontextmanager
async def unanswered_listener() -> AsyncIterator[str]:
    """A listener that accepts nothing, its one-connection backlog already taken: a
    connect to it waits for an answer to its SYN until it times out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        _, filler = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            filler.close()
