"""The engine-stream HTTP client against the real reference engine (and, where an engine
cannot be made to misbehave on cue, a plain TCP server that does exactly one wrong thing)."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.transport import (
    ClosedError,
    ConnectError,
    HTTPClient,
    ProtocolError,
    ReadTimeoutError,
    Response,
    SSEEvent,
    TransportError,
)
from controlplane.transport.http import _Connection
from fleetsim.engine import EngineConfig
from fleetsim.server import serve_engine
from tests.transport.raw_server import answering, tcp_server

CONFIG = EngineConfig(model="m", max_total_tokens=8192, context_length=4096, speed_factor=200.0)
JSON = {"Content-Type": "application/json"}


def generate(tokens: int, rid: str = "") -> bytes:
    body: dict[str, object] = {
        "text": "transport",
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        "stream": True,
    }
    if rid:
        body["rid"] = rid
    return msgspec.json.encode(body)


async def raw_exchange(host: str, port: int, request: bytes) -> bytes:
    """The engine's whole answer as bytes on the wire (it closes after `Connection: close`)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    return data


def parse(pieces: list[bytes]) -> tuple[int, bytes, bool]:
    """(status, body, complete) of a response fed to the parser in `pieces`."""
    conn = _Connection(asyncio.get_running_loop(), 10.0, forget=lambda _: None)
    conn.in_use = True  # as if its request had been sent
    for piece in pieces:
        conn.data_received(piece)
    assert conn.error is None
    body = b"".join(conn._body)
    conn._body.clear()
    return conn.status, body, conn.complete


async def test_a_chunked_stream_parses_the_same_however_its_bytes_are_cut() -> None:
    async with serve_engine(CONFIG) as engine:
        host, port = engine.url.removeprefix("http://").split(":")
        body = generate(6)
        request = (
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        wire = await raw_exchange(host, int(port), request)
    assert b"transfer-encoding: chunked" in wire.lower()
    status, whole, complete = parse([wire])
    assert status == 200
    assert complete
    assert whole.endswith(b"data: [DONE]\n\n")
    assert b"\r\n" not in whole
    for cut in range(1, len(wire)):
        assert parse([wire[:cut], wire[cut:]]) == (200, whole, True), cut
    assert parse([wire[i : i + 1] for i in range(len(wire))]) == (200, whole, True)


async def test_streams_and_plain_answers_reuse_one_connection() -> None:
    async with serve_engine(CONFIG) as engine, HTTPClient() as client:
        for _ in range(3):
            async with await client.request(
                "POST", engine.url + "/generate", generate(5), JSON
            ) as resp:
                assert resp.status == 200
                events = [e async for batch in resp.events() for e in batch]
            assert events[-1].done
            last = msgspec.json.decode(events[-2].data)
            assert last["meta_info"]["completion_tokens"] == 5
            async with await client.request("GET", engine.url + "/server_info") as resp:
                info = msgspec.json.decode(await resp.read())
            assert resp.status == 200
            assert info["max_total_num_tokens"] == 8192
        idle = [conn for origin in client._origins.values() for conn in origin.idle]
        assert len(idle) == 1  # six requests, one after the other, on one connection


async def test_a_response_left_unread_closes_its_connection() -> None:
    async with serve_engine(CONFIG) as engine, HTTPClient() as client:
        async with await client.request(
            "POST", engine.url + "/generate", generate(500, "transport-unread-rid-000001"), JSON
        ) as resp:
            await anext(resp.events())
        assert not any(origin.idle for origin in client._origins.values())
        async with await client.request("POST", engine.url + "/generate", generate(2), JSON) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"[DONE]\n\n")


async def test_an_engine_killed_mid_stream_is_a_transport_error() -> None:
    async with serve_engine(CONFIG) as engine, HTTPClient() as client:
        async with await client.request(
            "POST", engine.url + "/generate", generate(3000), JSON
        ) as resp:
            assert resp.status == 200
            events = resp.events()
            assert await anext(events)
            await engine.kill()
            with pytest.raises(ClosedError, match="mid-response"):
                async for _ in events:
                    pass
        with pytest.raises(ConnectError, match="connect"):
            await client.request("GET", engine.url + "/server_info")


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("cap", [1, 8])
async def test_a_pooled_connection_the_peer_closed_is_retried_once_on_a_fresh_one(
    cap: int,
) -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await writer.drain()
        if first:  # keep-alive promised, but the next request finds it closing
            await reader.readuntil(b"\r\n\r\n")

    async with tcp_server(handle) as url, HTTPClient(max_connections_per_origin=cap) as client:
        for _ in range(2):
            async with await client.request("GET", url + "/x") as resp:
                assert (resp.status, await resp.read()) == (200, b"ok")
        assert connections == 2


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n"


@pytest.mark.parametrize(("after_done", "reused"), [(b"0\r\n\r\n", True), (b"3\r\nxyz\r\n", False)])
async def test_a_reader_that_stops_at_done_keeps_its_connection_for_the_body_end(
    after_done: bytes, reused: bool
) -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed the connection
            writer.write(SSE_HEAD + DONE_CHUNK)
            await writer.drain()
            await asyncio.sleep(0.05)  # the end comes in a write of its own, later
            writer.write(after_done)
            if not reused:
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with tcp_server(handle) as url, HTTPClient() as client:
        for _ in range(2):
            async with await client.request("GET", url + "/events") as resp:
                async for batch in resp.events():
                    if batch[-1].done:
                        break
            await asyncio.sleep(0.1)
        assert connections == (1 if reused else 2)


@pytest.mark.parametrize("gap_s", [0.0, 0.02])
async def test_bytes_after_a_response_retire_its_connection(gap_s: float) -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        if connections == 1:  # then, unasked, what some servers send before closing
            await asyncio.sleep(gap_s)
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with tcp_server(handle) as url, HTTPClient() as client:
        async with await client.request("GET", url + "/x") as resp:
            assert await resp.read() == b"ok"
        await asyncio.sleep(0.05)
        async with await client.request("GET", url + "/x") as resp:
            assert (resp.status, await resp.read()) == (200, b"ok")
        assert connections == 2


async def test_a_request_is_retried_once_only() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # then close without an answer

    async with tcp_server(handle) as url, HTTPClient() as client:
        async with await client.request("GET", url + "/x") as resp:
            assert await resp.read() == b"ok"
        with pytest.raises(ClosedError, match="before a response"):
            await client.request("GET", url + "/x")
        assert connections == 2  # the pooled one, then one fresh retry


async def test_a_fresh_connection_that_closes_before_answering_is_not_retried() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")

    async with tcp_server(handle) as url, HTTPClient() as client:
        with pytest.raises(ClosedError, match="before a response"):
            await client.request("GET", url + "/x")
        assert connections == 1


async def test_silence_past_the_read_timeout_is_a_transport_error() -> None:
    handle = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")

    async with (
        tcp_server(handle) as url,
        HTTPClient(read_timeout_s=0.2) as client,
        await client.request("GET", url + "/x") as resp,
    ):
        chunks = resp.chunks()
        assert await anext(chunks) == b"hello"
        with pytest.raises(ReadTimeoutError, match="no data"):
            await anext(chunks)


async def test_malformed_answers_and_requests_are_transport_errors() -> None:
    handle = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")

    async with tcp_server(handle) as url, HTTPClient() as client:
        with pytest.raises(ProtocolError, match="malformed"):
            async with await client.request("GET", url + "/x") as resp:
                await resp.read()
        with pytest.raises(TransportError, match="line break"):
            await client.request("GET", url + "/x", headers={"X-Evil": "a\r\nHost: b"})
        with pytest.raises(ConnectError, match="http://"):
            await client.request("GET", "https://127.0.0.1/x")


async def pushed(resp: Response, stop_every: int = 0) -> tuple[list[SSEEvent], int]:
    """(events, pushes) of a body read by push; the callback stops every `stop_every`
    batches (0: never), and reading goes on with the next push."""
    events: list[SSEEvent] = []
    batches = pushes = 0

    def take(batch: list[SSEEvent]) -> bool:
        nonlocal batches
        events.extend(batch)
        batches += 1
        return bool(stop_every) and batches % stop_every == 0

    while not (events and events[-1].done):
        pushes += 1
        await resp.push_events(take)
    return events, pushes


def outputs(events: list[SSEEvent]) -> list[object]:
    def output(event: SSEEvent) -> object:
        if event.done:
            return None
        body = msgspec.json.decode(event.data)
        return body["text"], body["output_ids"], body["meta_info"]["completion_tokens"]

    return [output(e) for e in events]


@pytest.mark.parametrize("stop_every", [0, 1, 3])
async def test_pushed_events_are_the_events_read_and_the_connection_is_reused(
    stop_every: int,
) -> None:
    async with serve_engine(CONFIG) as engine, HTTPClient() as client:
        async with await client.request(
            "POST", engine.url + "/generate", generate(40), JSON
        ) as resp:
            read = [e async for batch in resp.events() for e in batch]
        async with await client.request(
            "POST", engine.url + "/generate", generate(40), JSON
        ) as resp:
            events, pushes = await pushed(resp, stop_every)
        assert outputs(events) == outputs(read)  # a deterministic engine
        assert pushes > 1 if stop_every else pushes == 1
        async with await client.request("GET", engine.url + "/server_info") as resp:
            assert resp.status == 200
            await resp.read()
        assert len(client._open) == 1  # three requests, one connection


async def test_what_the_callback_raises_reaches_the_reader_and_retires_the_connection() -> None:
    def fail(batch: list[SSEEvent]) -> bool:
        raise ValueError("unreadable")

    async with serve_engine(CONFIG) as engine, HTTPClient() as client:
        async with await client.request(
            "POST", engine.url + "/generate", generate(50), JSON
        ) as resp:
            with pytest.raises(ValueError, match="unreadable"):
                await resp.push_events(fail)
        assert not any(origin.idle for origin in client._origins.values())


async def test_an_engine_killed_mid_push_is_a_transport_error() -> None:
    async with (
        serve_engine(CONFIG) as engine,
        HTTPClient() as client,
        await client.request("POST", engine.url + "/generate", generate(3000), JSON) as resp,
    ):
        seen = asyncio.Event()

        def take(batch: list[SSEEvent]) -> bool:
            seen.set()
            return False

        push = asyncio.ensure_future(resp.push_events(take))
        await seen.wait()
        await engine.kill()
        with pytest.raises(ClosedError, match="mid-response"):
            await push


async def test_silence_past_the_read_timeout_fails_a_push() -> None:
    handle = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")

    got: list[bytes] = []

    def take(batch: list[SSEEvent]) -> bool:
        got.extend(e.data for e in batch)
        return False

    async with (
        tcp_server(handle) as url,
        HTTPClient(read_timeout_s=0.2) as client,
        await client.request("GET", url + "/x") as resp,
    ):
        with pytest.raises(ReadTimeoutError, match="no data"):
            await resp.push_events(take)
    assert got == [b"a"]


EVENTS = [b'data: {"n": %d, "pad": "%s"}\n\n' % (n, b"x" * (n * 7 % 40)) for n in range(12)]
CHUNKED = (
    b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in [*EVENTS, b"data: [DONE]\n\n"]) + b"0\r\n\r\n"
)
HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@given(st.lists(st.integers(min_value=1, max_value=len(CHUNKED) - 1), max_size=20), st.booleans())
def test_cut_through_and_decoding_together_lose_repeat_or_reorder_nothing(
    cuts: list[int], decline_odd: bool
) -> None:
    """However the wire is cut into reads, the reads the cut-through takes (whole chunks,
    forwarded as they came) and the events the decoder hands on make up the stream."""
    relayed, lasts = asyncio.run(relay_cut(cuts, decline_odd))
    assert relayed == [*EVENTS, b"data: [DONE]\n\n"]
    assert [n for n in lasts if n >= 0] == sorted(n for n in lasts if n >= 0)


def test_reads_of_whole_chunks_are_cut_through() -> None:
    bounds = list(itertools.accumulate(len(b"%x\r\n%b\r\n" % (len(e), e)) for e in EVENTS))
    relayed, lasts = asyncio.run(relay_cut(bounds, decline_odd=False))
    assert lasts == list(range(12))  # every event but [DONE] went through undecoded
    assert relayed == [*EVENTS, b"data: [DONE]\n\n"]


async def relay_cut(cuts: list[int], decline_odd: bool) -> tuple[list[bytes], list[int]]:
    """(relayed events, the `n` of each cut-through read's last event, -1 where declined)
    of the wire cut at `cuts`, read by push with cut-through."""
    loop = asyncio.get_running_loop()
    conn = _Connection(loop, 10.0, forget=lambda _: None)
    conn.in_use = True
    conn.data_received(HEAD)
    resp = Response(HTTPClient(), ("127.0.0.1", 1), conn)
    relayed: list[bytes] = []
    lasts: list[int] = []

    def on_events(batch: list[SSEEvent]) -> bool:
        relayed.extend(e.raw for e in batch)
        return False

    def on_wire(wire: bytes, last: SSEEvent) -> bool | None:
        if decline_odd and len(lasts) % 2:
            lasts.append(-1)
            return None
        frames = parse([HEAD, wire])[1]  # the chunks' payloads
        assert frames.endswith(last.raw)
        relayed.extend(f + b"\n\n" for f in frames.split(b"\n\n")[:-1])
        lasts.append(msgspec.json.decode(last.data)["n"])
        return False

    push = asyncio.ensure_future(resp.push_events(on_events, on_wire))
    bounds = [0, *sorted(set(cuts)), len(CHUNKED)]
    for start, end in itertools.pairwise(bounds):
        await asyncio.sleep(0)
        conn.data_received(CHUNKED[start:end])
    await push
    assert conn.complete
    return relayed, lasts
