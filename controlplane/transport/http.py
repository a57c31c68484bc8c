"""A lean HTTP/1.1 client for engine streams, on asyncio protocols.

The request path relays every streamed token; a general-purpose client (stream readers,
per-read timers, tracing hooks) costs more per chunk than the rest of the relay. This one
does only what engine traffic needs:

- a keep-alive pool of connections per origin (host, port), most recently used first;
- one write per request (head and body together);
- response framing by Content-Length, chunked transfer coding, or the connection's end,
  decoded inside the protocol's `data_received`, so a consumer wakes once per network read
  with all the body bytes it carried;
- a push mode for relays (`Response.push_events`): each read's events are handed to a
  callback inside `data_received`, so relaying a token costs no task wake-up at all;
- a read timeout per connection, checked by one re-armed timer rather than one per read.

Errors are `TransportError` (an `OSError`): connection refused or timed out, a connection
that broke or ended mid-response, a malformed response. A request on a pooled connection
that the peer had already closed (nothing came back, so the request never reached it) is
sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

from controlplane.transport.sse import SSEEvent, SSEFramer, one_data_event

_MAX_HEAD = 64 * 1024
_PAUSE_AT = 1 << 20  # unread body bytes at which reading from the socket pauses
_END_GRACE_S = 1.0  # how long a finished reader's connection waits for its body's end


class TransportError(OSError):
    """The request failed on the wire: no connection, a broken or malformed response."""


# Parser states.
_HEAD, _LENGTH, _UNTIL_CLOSE, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _DONE = range(8)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; parses one response at a time."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read_timeout_s: float,
        forget: Callable[[_Connection], None],
    ) -> None:
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self._forget = forget  # the client stops tracking a connection once it is lost
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.in_use = False  # a request was sent and its response is not read to the end
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self._state = _HEAD
        self._head = b""
        self._tail = b""  # an incomplete chunk-size line or chunk end
        self._remaining = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._on_end: Callable[[], None] | None = None  # see release_at_end
        # Push mode (see push): takes each read's body bytes, returns True to stop.
        self._sink: Callable[[bytes], bool] | None = None
        # Cut-through (see push): takes a read of whole chunks as it came, and where the
        # last chunk's payload lies in it; None declines (the read is then decoded).
        self._wire_sink: Callable[[bytes, int, int], bool | None] | None = None
        self._sink_error: Exception | None = None
        self.error: TransportError | None = None
        self.received_any = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True

    # -- protocol callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._forget(self)
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state != _DONE and self.error is None:
            where = "mid-response" if self.received_any else "before a response"
            self.error = TransportError(f"the connection closed {where}: {exc or 'EOF'}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes nobody asked for (a server's 408 on an idle connection)
            self._close()
            return
        self.received_any = True
        self._last_read = self._loop.time()
        try:
            if self._state == _HEAD:
                data = self._parse_head(data)
            if data and not (self._wire_sink is not None and self._cut_through(data)):
                self._feed_body(data)
        except (ValueError, IndexError) as exc:
            self.error = TransportError(f"malformed HTTP response: {exc}")
            self._close()
        if self._sink is not None:
            self._deliver()
        elif self._on_end is not None:
            self._ended()
        elif self._body_bytes > _PAUSE_AT:
            self.hold(True)
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost decides what the end means

    # -- parsing --------------------------------------------------------------------------

    def _parse_head(self, data: bytes) -> bytes:
        buf = self._head + data if self._head else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                raise ValueError("response head too large")
            self._head = buf
            return b""
        self._head = b""
        lines = buf[:end].decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(status)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (
            version == "HTTP/1.1" or "keep-alive" in connection
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _LENGTH if self._remaining else _DONE
        elif self.status in (204, 304) or self.status < 200:
            self._state = _DONE
        else:
            self._state, self.keep_alive = _UNTIL_CLOSE, False
        return buf[end + 4 :]

    def _feed_body(self, data: bytes) -> None:
        state = self._state
        if state == _LENGTH:
            if len(data) >= self._remaining:
                # Bytes past the end (nobody asked for them) retire the connection.
                self.keep_alive = self.keep_alive and len(data) == self._remaining
                data, self._state = data[: self._remaining], _DONE
            self._remaining -= len(data)
            self._take(data)
        elif state == _UNTIL_CLOSE:
            self._take(data)
        elif state != _DONE:
            self._feed_chunked(data)
        else:
            self.keep_alive = False

    def _feed_chunked(self, data: bytes) -> None:
        if self._tail:
            data, self._tail = self._tail + data, b""
        pos, size = 0, len(data)
        while pos < size:
            state = self._state
            if state == _CHUNK_DATA:
                take = min(self._remaining, size - pos)
                self._take(data[pos : pos + take] if take < size else data)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if size - pos < 2:
                    self._tail = data[pos:]
                    return
                if data[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _DONE:
                self.keep_alive = False  # bytes after the response: the connection retires
                return
            else:  # a chunk-size line, or a trailer line after the last chunk
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > _MAX_HEAD:
                        raise ValueError("chunk-size line too long")
                    self._tail = data[pos:]
                    return
                line = data[pos:end]
                pos = end + 2
                if state == _TRAILER:
                    if not line:
                        self._state = _DONE
                    continue
                chunk = int(line.split(b";", 1)[0], 16)
                if chunk < 0:
                    raise ValueError("negative chunk size")
                self._remaining = chunk
                self._state = _CHUNK_DATA if chunk else _TRAILER

    def _cut_through(self, data: bytes) -> bool:
        """Hand a read of whole chunks to the wire sink undecoded; False: decode it."""
        if self._state != _CHUNK_SIZE or self._tail or self._body:
            return False
        last = _last_payload(data)
        if last is None:
            return False
        try:
            verdict = self._wire_sink(data, *last) if self._wire_sink is not None else None
        except Exception as exc:  # raised in the reader's task, by push
            self._stop_push(exc)
            return True
        if verdict:
            self._stop_push()
        return verdict is not None

    def _take(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._body_bytes += len(data)

    # -- waiting ------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = waiter = self._loop.create_future()
        if self._timer is None:
            self._last_read = self._loop.time()
            self._timer = self._loop.call_at(self._last_read + self._read_timeout_s, self._check)
        await waiter
        if self.error is not None:
            raise self.error

    def _check(self) -> None:
        """The read timer: fails a wait that has seen no byte for the whole timeout (not
        counting time the reader held reading paused)."""
        self._timer = None
        if self._waiter is None or self._state == _DONE:
            return
        due = self._last_read + self._read_timeout_s
        if self._paused:
            self._last_read = self._loop.time()
            due = self._last_read + self._read_timeout_s
        if self._loop.time() >= due:
            self.error = TransportError(f"no data for {self._read_timeout_s:g}s")
            self._close()
            self._wake()
        else:
            self._timer = self._loop.call_at(due, self._check)

    async def head(self) -> None:
        while self._state == _HEAD:
            await self._wait()

    async def body_chunk(self) -> bytes:
        """The body bytes received since the last call; b"" at the end of the body."""
        while not self._body:
            if self._state == _DONE:
                return b""
            await self._wait()
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._body_bytes = 0
        self.hold(False)
        return data

    async def push(
        self,
        sink: Callable[[bytes], bool],
        wire_sink: Callable[[bytes, int, int], bool | None] | None = None,
    ) -> bool:
        """Hand the body to `sink` from inside `data_received`, a read's bytes per call
        (bytes that came before, at once), until the body ends or `sink` returns True.
        A chunked read that holds whole chunks, none the last, goes first to `wire_sink`
        as it came, with the bounds of its last chunk's payload; it returns None to have
        the read decoded for `sink` after all. Returns whether the whole body has been
        handed over (False: a sink stopped it). Raises what a sink raised, or the
        connection's TransportError."""
        self._sink, self._wire_sink, self._sink_error = sink, wire_sink, None
        try:
            self._deliver()
            self.hold(False)  # reading paused while nobody took the body
            while self._sink is not None and self._state != _DONE:
                await self._wait()
            if self._sink_error is not None:
                raise self._sink_error
            return self.complete
        finally:
            self._sink = self._wire_sink = None

    def _deliver(self) -> None:
        sink, body = self._sink, self._body
        if sink is not None and body:
            data = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            self._body_bytes = 0
            try:
                if sink(data):
                    self._stop_push()
            except Exception as exc:  # raised in the reader's task, by push
                self._stop_push(exc)
        if self._sink is None or self._state == _DONE or self.error is not None:
            self._wake()

    def _stop_push(self, error: Exception | None = None) -> None:
        """A sink stopped the push (or raised `error`, for push to raise)."""
        self._sink = self._wire_sink = None
        if error is not None:
            self._sink_error = error

    def hold(self, paused: bool) -> None:
        """Pause or resume reading from the socket."""
        if paused != self._paused and self.transport is not None:
            self._paused = paused
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    @property
    def complete(self) -> bool:
        return self._state == _DONE and not self._body

    # -- lifecycle ------------------------------------------------------------------------

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.in_use = True
        self.transport.write(request)

    def release_at_end(self, release: Callable[[], None]) -> None:
        """The reader is done, but the body's last bytes (a chunked body's terminator, say)
        are still on the way: `release` once they arrive, unless anything else comes or
        they take longer than a grace period."""
        self._on_end = release
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(_END_GRACE_S, self._close)
        self._ended()

    def _ended(self) -> None:
        if self._body or self.error is not None or self.closed:
            self._close()  # more than the end came: nobody will read it
        elif self._state == _DONE:
            release, self._on_end = self._on_end, None
            if release is not None:
                release()

    def reuse(self) -> None:
        """Ready for the next request (the last response was read to its end)."""
        if self._timer is not None:
            self._timer.cancel()
        self._reset()
        self.in_use = False

    def _close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self._close()


def _last_payload(data: bytes) -> tuple[int, int] | None:
    """Where the last chunk's payload lies in `data`, when `data` is one or more whole
    chunks and none is the last (size 0); None otherwise."""
    pos, size, start, end = 0, len(data), 0, 0
    while pos < size:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            length = int(data[pos:eol], 16)
        except ValueError:
            return None  # extensions or garbage: the decoder says which
        start, end = eol + 2, eol + 2 + length
        if length <= 0 or not data.startswith(b"\r\n", end):
            return None
        pos = end + 2
    return start, end


class Response:
    """A response whose head has arrived. Read its body once — `read()`, `chunks()` or
    `events()` — and close it (`async with`): a fully read response returns its connection
    to the pool; one closed early closes its connection."""

    def __init__(self, client: HTTPClient, origin: tuple[str, int], conn: _Connection) -> None:
        self._client = client
        self._origin = origin
        self._conn: _Connection | None = conn
        self._saw_done = False  # the last event read was `[DONE]`
        self._framer = SSEFramer()
        self.status = conn.status
        self.headers = conn.headers

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";")[0]

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: every call gives all the bytes that came since."""
        conn = self._conn
        if conn is None:
            return
        while chunk := await conn.body_chunk():
            yield chunk

    async def events(self) -> AsyncIterator[list[SSEEvent]]:
        """The body as server-sent events, a network read's worth at a time."""
        conn = self._conn
        if conn is None:
            return
        while chunk := await conn.body_chunk():
            if batch := self._framer.feed(chunk):
                self._saw_done = batch[-1].done
                yield batch

    async def push_events(
        self,
        on_events: Callable[[list[SSEEvent]], bool],
        on_wire: Callable[[bytes, SSEEvent], bool | None] | None = None,
    ) -> bool:
        """The body as server-sent events, as `events()` reads them, but each read's batch
        is handed to `on_events` from inside the connection's read callback: no task
        wakes per read. Returns True once the whole body has been handed over, or False
        as soon as a callback returns True (call again to go on: the framing state is
        kept, and what arrives meanwhile is buffered as for `events()`); raises what a
        callback raised, or TransportError.

        `on_wire` is cut-through for a relay that forwards chunked bytes as they came:
        a read of whole chunks (the body's end not among them) whose last chunk is one
        one-line `data:` event, other than `[DONE]`, goes to it undecoded, with that
        event; the events of the read's earlier chunks are in the bytes, unread. It
        returns None to decline: the read then goes to `on_events` as usual."""
        conn = self._conn
        if conn is None:
            return True
        framer = self._framer

        def take(data: bytes) -> bool:
            batch = framer.feed(data)
            if not batch:
                return False
            self._saw_done = batch[-1].done
            return on_events(batch)

        def take_wire(data: bytes, start: int, end: int) -> bool | None:
            if on_wire is None or not framer.idle:
                return None
            event = one_data_event(data[start:end])
            return None if event is None or event.done else on_wire(data, event)

        return await conn.push(take, take_wire if on_wire is not None else None)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        healthy = conn.keep_alive and not conn.closed
        if healthy and conn.complete:
            self._client._release(self._origin, conn)
        elif healthy and self._saw_done:
            # A reader that stops at `[DONE]` often beats the chunked body's terminator,
            # which the server sends in a write of its own: keep the connection for that.
            origin = self._origin
            conn.release_at_end(lambda: self._client._release(origin, conn))
        else:
            conn.abort()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class HTTPClient:
    """Requests to any number of origins, over pooled keep-alive connections."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        idle_timeout_s: float = 30.0,
        max_idle_per_origin: int = 256,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._urls: dict[str, tuple[tuple[str, int], str, bytes]] = {}
        # Every connection not yet lost: idle, in use, or waiting for a body's last bytes.
        self._open: set[_Connection] = set()
        self._closed = False

    def _target(self, url: str) -> tuple[tuple[str, int], str, bytes]:
        """(origin, path, Host header line) of an http:// URL, cached per URL."""
        target = self._urls.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise TransportError(f"not an http:// URL: {url!r}")
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            target = (
                (parts.hostname, parts.port or 80),
                path,
                f"Host: {parts.netloc}\r\n".encode(),
            )
            if len(self._urls) < 4096:
                self._urls[url] = target
        return target

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """Send a request and wait for its response head."""
        if self._closed:
            raise TransportError("the client is closed")
        origin, path, host = self._target(url)
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), host]
        if headers:
            lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
                raise TransportError("a header name or value holds a line break")
            head.append(lines.encode("latin-1"))
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        head.append(body)
        message = b"".join(head)
        conn = self._pooled(origin)
        retry = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(origin)
            conn.send(message)
            try:
                await conn.head()
            except TransportError:
                conn.abort()
                if retry and not conn.received_any:
                    # The peer closed the pooled connection while it idled: the request
                    # never arrived. Once more, on a fresh connection.
                    conn, retry = None, False
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return Response(self, origin, conn)

    def _pooled(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        stale = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > stale:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = origin
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self.read_timeout_s, self._open.discard), host, port
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise TransportError(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"connect to {host}:{port}: {exc}") from exc
        self._open.add(conn)
        return conn

    def _release(self, origin: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self.max_idle_per_origin:
            conn.abort()
            return
        conn.reuse()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection, idle or not (a response still being read then ends
        with TransportError), and let their sockets close before returning."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._open):
            conn.abort()
        await asyncio.sleep(0)  # the transports close their sockets on the next loop turn
