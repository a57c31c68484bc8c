"""The HTTP client against upstreams that misbehave on cue (a loopback TCP server writing
raw bytes): every malformed response is a `ProtocolError` (never accepted, never a hang),
each way of failing is its own error type, and the connections to one origin are capped."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controlplane.transport import (
    TRANSPORT_REASONS,
    ClosedError,
    ConnectError,
    ConnectTimeoutError,
    HTTPClient,
    PoolTimeoutError,
    ProtocolError,
    ReadTimeoutError,
    TransportError,
)
from tests.transport.raw_server import (
    Handler,
    answering,
    free_port,
    hang_up,
    silent,
    tcp_server,
    unanswered_listener,
)

OK = b"HTTP/1.1 200 OK\r\n"
CHUNKED = OK + b"Transfer-Encoding: chunked\r\n\r\n"

MALFORMED = {
    # Content-Length: decimal digits, nothing else, within 64 bits, once.
    "length in hex": OK + b"Content-Length: 0x2\r\n\r\nok",
    "signed length": OK + b"Content-Length: +2\r\n\r\nok",
    "negative length": OK + b"Content-Length: -2\r\n\r\nok",
    "length with an underscore": OK + b"Content-Length: 1_0\r\n\r\n0123456789",
    "length with a space inside": OK + b"Content-Length: 1 0\r\n\r\n0123456789",
    "length as a list": OK + b"Content-Length: 2, 2\r\n\r\nok",
    "length past 64 bits": OK + b"Content-Length: 99999999999999999999999\r\n\r\nok",
    "two equal lengths": OK + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "two lengths": OK + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    "length then chunked": OK
    + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "chunked then length": OK
    + b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    # Transfer codings: chunked, once (no other was asked for).
    "gzip": OK + b"Transfer-Encoding: gzip\r\n\r\nabc",
    "chunked then gzip": OK + b"Transfer-Encoding: chunked, gzip\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "chunked twice": OK
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "an unknown coding": OK + b"Transfer-Encoding: xchunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    # Chunk sizes: hex digits, nothing else, within 64 bits.
    "chunk size with 0x": CHUNKED + b"0x2\r\nok\r\n0\r\n\r\n",
    "signed chunk size": CHUNKED + b"+2\r\nok\r\n0\r\n\r\n",
    "negative chunk size": CHUNKED + b"-2\r\nok\r\n0\r\n\r\n",
    "chunk size with an underscore": CHUNKED + b"1_0\r\n0123456789abcdef\r\n0\r\n\r\n",
    "chunk size after a space": CHUNKED + b" 2\r\nok\r\n0\r\n\r\n",
    "chunk size before a space": CHUNKED + b"2 \r\nok\r\n0\r\n\r\n",
    "chunk size past 64 bits": CHUNKED + b"f" * 17 + b"\r\nok\r\n0\r\n\r\n",
    "chunk longer than its size": CHUNKED + b"2\r\nokX\r\n0\r\n\r\n",
    # Line ends: CRLF, everywhere.
    "bare LF in the head": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "bare LF after a field": OK + b"Content-Length: 2\n\r\nok",
    "bare CR in a field": OK + b"X-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "bare LF after a chunk size": CHUNKED + b"2\nok\r\n0\r\n\r\n",
    "bare LF after chunk data": CHUNKED + b"2\r\nok\n0\r\n\r\n",
    # Fields.
    "obs-fold": OK + b"X-A: 1\r\n  2\r\nContent-Length: 2\r\n\r\nok",
    "a space before the colon": OK + b"Content-Length : 2\r\n\r\nok",
    "a field without a colon": OK + b"Content-Length 2\r\n\r\nok",
    "a NUL in a field": OK + b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "a head over 64 KiB": OK
    + b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 100) for i in range(700))
    + b"Content-Length: 2\r\n\r\nok",
    # Status lines.
    "a status that is not a number": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
    "a four-digit status": b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok",
    "not HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "HTTP/2 on an HTTP/1.1 connection": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "an upgrade nobody asked for": b"HTTP/1.1 101 Switching Protocols\r\n"
    b"Upgrade: websocket\r\nConnection: upgrade\r\n\r\n",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_response_is_a_protocol_error(raw: bytes) -> None:
    async with tcp_server(answering(raw)) as url, HTTPClient(read_timeout_s=60) as client:
        async with asyncio.timeout(10):  # a parser that waits for more would hang here
            with pytest.raises(ProtocolError, match="malformed HTTP response") as caught:
                async with await client.request("GET", url + "/x") as resp:
                    await resp.read()
        assert caught.value.reason == "protocol_error"
        assert not any(origin.idle for origin in client._origins.values())


def endless(prefix: bytes) -> Handler:
    """A server that answers with `prefix`, then filler for as long as the client reads
    (at most 4 MiB: a client that takes it all then waits, and the test times out)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(prefix)
        with contextlib.suppress(ConnectionError):
            for _ in range(1024):
                writer.write(b"a" * 4096)
                await writer.drain()
            await reader.read()

    return handle


ENDLESS = {
    "status line": b"HTTP/1.1 200 ",
    "field": OK + b"X-Endless: ",
    "chunk extension": CHUNKED + b"5;ext=",
    "trailer": CHUNKED + b"5\r\nhello\r\n0\r\nX-Trailer: ",
}


@pytest.mark.parametrize("prefix", ENDLESS.values(), ids=ENDLESS.keys())
async def test_an_endless_line_is_a_protocol_error_within_64_kib(prefix: bytes) -> None:
    async with tcp_server(endless(prefix)) as url, HTTPClient() as client:
        async with asyncio.timeout(10):
            with pytest.raises(ProtocolError, match=r"no element complete|head too large"):
                async with await client.request("GET", url + "/x") as resp:
                    await resp.read()


ACCEPTED = {
    "chunk extensions": (
        CHUNKED + b'2;a=b\r\nok\r\n3;q="x y"\r\n!!!\r\n0;last\r\n\r\n',
        b"ok!!!",
    ),
    "trailers": (CHUNKED + b"2\r\nok\r\n0\r\nX-Trailer: t\r\n\r\n", b"ok"),
    "Chunked in capitals": (OK + b"Transfer-Encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", b"ok"),
    "whitespace around a length": (OK + b"Content-Length: \t2 \r\n\r\nok", b"ok"),
    "1xx responses first": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n"
        + OK
        + b"Content-Length: 2\r\n\r\nok",
        b"ok",
    ),
    "HTTP/1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    "no body for 204": (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
}


@pytest.mark.parametrize(("raw", "body"), ACCEPTED.values(), ids=ACCEPTED.keys())
async def test_what_http_allows_is_read(raw: bytes, body: bytes) -> None:
    async with tcp_server(answering(raw)) as url, HTTPClient() as client:
        async with asyncio.timeout(10), await client.request("GET", url + "/x") as resp:
            assert await resp.read() == body
        assert resp.status in (200, 204)
        assert "x-trailer" not in resp.headers  # trailers are not the head's
        assert "link" not in resp.headers  # nor are an informational response's fields


async def test_a_body_without_length_runs_to_the_connection_end() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK + b"Content-Type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        writer.write(b"the end")

    async with tcp_server(handle) as url, HTTPClient() as client:
        async with asyncio.timeout(10), await client.request("GET", url + "/x") as resp:
            assert await resp.read() == b"until the end"
        assert not any(origin.idle for origin in client._origins.values())


async def test_a_whole_body_past_its_limit_is_a_protocol_error() -> None:
    """A whole body is held in memory: one that runs past the limit is refused, and its
    connection is not kept (the rest of that body is still on it)."""
    async with tcp_server(endless(CHUNKED + b"100000\r\n")) as url, HTTPClient() as client:
        async with asyncio.timeout(10):
            with pytest.raises(ProtocolError, match="response body over 65536 bytes"):
                async with await client.request("GET", url + "/x") as resp:
                    await resp.read(limit=65536)
        assert not any(origin.idle for origin in client._origins.values())


# -- what went wrong, by type ----------------------------------------------------------


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with HTTPClient() as client:
        with pytest.raises(ConnectError) as caught:
            await client.request("GET", f"http://127.0.0.1:{free_port()}/x")
    assert type(caught.value) is ConnectError
    assert caught.value.reason == "connect_error"


async def test_a_connect_past_its_timeout_is_a_connect_timeout() -> None:
    async with unanswered_listener() as url, HTTPClient(connect_timeout_s=0.3) as client:
        with pytest.raises(ConnectTimeoutError, match="timed out") as caught:
            await client.request("GET", url + "/x")
    assert isinstance(caught.value, ConnectError)  # the request never left
    assert caught.value.reason == "connect_timeout"


async def test_silence_after_the_request_is_a_read_timeout() -> None:
    async with tcp_server(silent) as url, HTTPClient(read_timeout_s=0.3) as client:
        with pytest.raises(ReadTimeoutError, match=r"no data for 0\.3s") as caught:
            await client.request("GET", url + "/x")
    assert not isinstance(caught.value, ConnectError)  # the request did leave
    assert caught.value.reason == "read_timeout"


async def test_a_peer_that_closes_before_answering_is_a_closed_error() -> None:
    async with tcp_server(hang_up) as url, HTTPClient() as client:
        with pytest.raises(ClosedError, match="before a response") as caught:
            await client.request("GET", url + "/x")
    assert caught.value.reason == "connection_closed"


def test_every_kind_of_transport_error_has_a_reason_of_its_own() -> None:
    kinds: list[type[TransportError]] = [TransportError]
    for kind in kinds:
        kinds.extend(kind.__subclasses__())
    assert sorted(kind.reason for kind in kinds) == sorted(set(TRANSPORT_REASONS))


# -- the cap on connections per origin -------------------------------------------------


async def test_requests_past_the_cap_wait_for_a_connection_and_reuse_it() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            await asyncio.sleep(0.01)  # the others queue meanwhile
            writer.write(OK + b"Content-Length: 2\r\n\r\nok")
            await writer.drain()

    async def one(client: HTTPClient, url: str) -> bytes:
        async with await client.request("GET", url + "/x") as resp:
            return await resp.read()

    for cap, opened in ((2, 2), (100, 8)):
        connections = 0
        async with tcp_server(handle) as url, HTTPClient(max_connections_per_origin=cap) as c:
            assert await asyncio.gather(*(one(c, url) for _ in range(8))) == [b"ok"] * 8
        assert connections == opened  # without a cap that binds, one per request


async def test_a_request_waits_no_longer_than_the_connect_timeout_for_a_connection() -> None:
    unended = CHUNKED + b"5\r\nhello\r\n"
    async with (
        tcp_server(answering(unended)) as url,
        HTTPClient(max_connections_per_origin=1, connect_timeout_s=0.3) as client,
    ):
        first = await client.request("GET", url + "/stream")
        with pytest.raises(PoolTimeoutError, match="came free") as caught:
            await client.request("GET", url + "/x")
        assert isinstance(caught.value, ConnectError)  # the request never left
        assert caught.value.reason == "pool_timeout"
        origin = next(iter(client._origins.values()))
        assert not origin.waiters
        # A waiter gets the connection as soon as it comes free.
        client.connect_timeout_s = 30.0  # (and no sooner)
        waiting = asyncio.ensure_future(client.request("GET", url + "/x"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        first.close()  # unread: its connection closes, which makes room for a new one
        async with await waiting as resp:
            assert resp.status == 200


async def test_a_waiter_that_gives_up_leaves_its_turn_to_the_next() -> None:
    answer = OK + b"Content-Length: 2\r\n\r\nok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            writer.write(answer)
            await writer.drain()

    async with (
        tcp_server(handle) as url,
        HTTPClient(max_connections_per_origin=1, connect_timeout_s=5.0) as client,
    ):
        first = await client.request("GET", url + "/x")
        quitter = asyncio.ensure_future(client.request("GET", url + "/x"))
        patient = asyncio.ensure_future(client.request("GET", url + "/x"))
        await asyncio.sleep(0.05)  # both wait, the quitter first
        assert await first.read() == b"ok"
        first.close()  # back to the pool: the first waiter is woken ...
        quitter.cancel()  # ... and gives up before it runs: its turn passes on
        async with asyncio.timeout(2), await patient as resp:
            assert await resp.read() == b"ok"
        assert quitter.cancelled()
        assert len(client._open) == 1
