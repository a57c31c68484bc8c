"""A lean HTTP/1.1 client for engine streams, on asyncio protocols.

The request path relays every streamed token; a general-purpose client (stream readers,
per-read timers, tracing hooks) costs more per chunk than the rest of the relay. This one
does only what engine traffic needs:

- a keep-alive pool of connections per origin (host, port), most recently used first,
  at most `max_connections_per_origin` open at once: past it a request waits for one to
  come free, within its connect timeout;
- one write per request (head and body together);
- responses parsed by llhttp (`httptools`, Node's parser) inside the protocol's
  `data_received`, so a consumer wakes once per network read with all the body bytes it
  carried; llhttp is strict where a hand-written parser tends not to be (see below);
- a push mode for relays (`Response.push_events`): each read's events are handed to a
  callback inside `data_received`, so relaying a token costs no task wake-up at all;
- a read timeout per connection, checked by one re-armed timer rather than one per read.

What is refused as a malformed response (`ProtocolError`), by llhttp or, where it leaves
the choice to its user, here: a Content-Length or chunk size that is not plain digits
(decimal, resp. hex: no sign, `0x`, underscore or inner whitespace) or overflows 64
bits; two Content-Length fields, or Content-Length with Transfer-Encoding; a transfer
coding other than `chunked` (none was asked for); obs-fold, a bare LF or CR, a space
before a field's colon, control characters in a field; an invalid status line, or a
version other than HTTP/1.x; a 101 nobody asked for; a head over 64 KiB, or 64 KiB with
no element of the message complete (an endless header, trailer or chunk-size line).
Chunk extensions and trailers are allowed and ignored; 1xx responses are skipped.

Errors (every one an `OSError`, so a caller's `except OSError` keeps working):

    TransportError              the request failed on the wire
    ├── ConnectError            no connection: refused, unreachable, unresolvable
    │   ├── ConnectTimeoutError     none within the connect timeout
    │   └── PoolTimeoutError        none came free at the cap within the connect timeout
    ├── ReadTimeoutError        connected and sent, then no byte for the read timeout
    ├── ProtocolError           a malformed response
    └── ClosedError             the peer closed the connection before or during the response

Each names itself in `reason` (`connect_error`, `connect_timeout`, ...): a metric label.
A `ConnectError` means the request never left this process. A request on a pooled
connection that the peer had already closed (nothing came back, so the request never
reached it) is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar, cast
from urllib.parse import urlsplit

import httptools

from controlplane.transport.sse import SSEEvent, SSEFramer, one_data_event

_MAX_HEAD = 64 * 1024  # a response head; also the most bytes with no element completed
# The most a whole (not streamed) response may hold: it is kept in memory at once. A reply
# of an engine, a sidecar or a status route is kilobytes; a peer past this is broken.
MAX_WHOLE_BODY = 64 * 1024 * 1024
_PAUSE_AT = 1 << 20  # unread body bytes at which reading from the socket pauses
_END_GRACE_S = 1.0  # how long a finished reader's connection waits for its body's end
# What a client opens to one origin by default: the router's own connection budget
# (`weir router --max-connections`), since each client connection has at most one
# request upstream in flight; so the cap binds only on what no client waits for
# (aborts, connections lingering for a body's end) piling up.
MAX_CONNECTIONS_PER_ORIGIN = 8192


class TransportError(OSError):
    """The request failed on the wire (see the module docstring for the kinds)."""

    reason: ClassVar[str] = "transport_error"


class ConnectError(TransportError):
    """No connection was made (refused, unreachable, unresolvable, not http://): the
    request never left."""

    reason = "connect_error"


class ConnectTimeoutError(ConnectError):
    reason = "connect_timeout"


class PoolTimeoutError(ConnectError):
    """Every connection the client may open to the origin stayed busy for the connect
    timeout."""

    reason = "pool_timeout"


class ReadTimeoutError(TransportError):
    """The request was sent (it may be running), then nothing came for the read timeout."""

    reason = "read_timeout"


class ProtocolError(TransportError):
    """The peer answered with something that is not a valid HTTP/1.x response."""

    reason = "protocol_error"


class ClosedError(TransportError):
    """The peer closed the connection before the response, or in the middle of it."""

    reason = "connection_closed"


# Every failure's `reason`, for metrics that start each label at zero.
TRANSPORT_REASONS = tuple(
    kind.reason
    for kind in (
        TransportError,
        ConnectError,
        ConnectTimeoutError,
        PoolTimeoutError,
        ReadTimeoutError,
        ProtocolError,
        ClosedError,
    )
)


class _MalformedError(Exception):
    """Raised inside a parser callback: what llhttp allows but this client does not."""


class _SurplusError(Exception):
    """Raised inside a parser callback: bytes after the response (nobody asked for them)."""


# Response states.
_HEAD, _BODY, _UNTIL_CLOSE, _DONE = range(4)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; parses one response at a time. llhttp calls the `on_*`
    methods from inside `feed_data`."""

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
        self._parser = httptools.HttpResponseParser(self)
        self._state = _HEAD
        self._head_bytes = 0
        self._marks = 0  # fields and heads completed
        self._quiet = 0  # bytes fed since an element (or body byte) last came out
        self._between = False  # the parser is between two chunks (or before the first)
        self._at_boundary = False  # ... and the last read ended there
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
            self.error = ClosedError(f"the connection closed {where}: {exc or 'EOF'}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes nobody asked for (a server's 408 on an idle connection)
            self._close()
            return
        self.received_any = True
        self._last_read = self._loop.time()
        if self._state == _DONE:
            self.keep_alive = False  # bytes after the response: the connection retires
        else:
            self._parse(data)
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

    def _parse(self, data: bytes) -> None:
        # Cut-through needs a read that starts and ends between chunks, the body so far
        # handed over: it is then whole chunks, which llhttp has checked.
        wire_sink = self._wire_sink if self._at_boundary and not self._body else None
        marks, body_bytes = self._marks, self._body_bytes
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            cause = exc.__context__
            if isinstance(cause, _SurplusError) or self._state == _DONE:
                self.keep_alive = False  # the response stands; what followed it retires it
            else:
                why = cause if isinstance(cause, _MalformedError) else exc
                self._fail(ProtocolError(f"malformed HTTP response: {why}"))
                return
        if self._body_bytes == body_bytes and self._marks == marks:
            self._quiet += len(data)
            if self._quiet > _MAX_HEAD:
                self._fail(
                    ProtocolError(
                        f"malformed HTTP response: {_MAX_HEAD} bytes and no element complete"
                    )
                )
                return
        elif self._quiet:
            self._quiet = 0
        self._at_boundary = self._between and data.endswith(b"\r\n")
        if wire_sink is not None and self._at_boundary and self._body and self._state != _DONE:
            self._cut_through(wire_sink, data)

    def _fail(self, error: TransportError) -> None:
        self.error = error
        self._close()

    def on_message_begin(self) -> None:
        if self._state == _DONE:
            raise _SurplusError

    def on_status(self, reason: bytes) -> None:
        # Called with each piece of the reason phrase as it comes.
        self._head_bytes += len(reason)
        if self._head_bytes > _MAX_HEAD:
            raise _MalformedError("response head too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._marks += 1
        if self._state != _HEAD:
            return  # a trailer: ignored
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > _MAX_HEAD:
            raise _MalformedError("response head too large")
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t")
        headers = self.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        self._marks += 1
        parser, headers = self._parser, self.headers
        if not parser.get_http_version().startswith("1."):
            raise _MalformedError(f"HTTP/{parser.get_http_version()} is not HTTP/1.x")
        self.status = status = parser.get_status_code()
        if status == 101:
            raise _MalformedError("101 Switching Protocols: no upgrade was asked for")
        self.keep_alive = parser.should_keep_alive()
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower() != "chunked":
                raise _MalformedError(f"transfer coding {coding!r}: only chunked was accepted")
            self._between = True
        elif "content-length" not in headers and status >= 200 and status not in (204, 304):
            self._state, self.keep_alive = _UNTIL_CLOSE, False
            return
        self._state = _BODY

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_bytes += len(body)

    # Chunk heads and ends are no marks: an endless chunk-size line stays quiet.
    def on_chunk_header(self) -> None:
        self._between = False

    def on_chunk_complete(self) -> None:
        self._between = True

    def on_message_complete(self) -> None:
        self._marks += 1
        if self.status >= 200:
            self._state = _DONE
            return
        # An informational (1xx) response: the real one follows.
        self._state, self._head_bytes, self.status = _HEAD, 0, 0
        self.headers = {}

    def _cut_through(
        self, wire_sink: Callable[[bytes, int, int], bool | None], data: bytes
    ) -> None:
        """Hand a read of whole chunks (none the last) to the wire sink as it came. The
        last chunk's payload ends before the read's final CRLF, and llhttp handed it over
        in one piece (a span within one buffer is one callback)."""
        body = self._body
        end = len(data) - 2
        start = end - len(body[-1])
        try:
            verdict = wire_sink(data, start, end)
        except Exception as exc:  # raised in the reader's task, by push
            self._stop_push(exc)
            verdict = False
        if verdict is None:
            return  # declined: the decoded body goes to the sink
        body.clear()
        self._body_bytes = 0
        if verdict:
            self._stop_push()

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
            self.error = ReadTimeoutError(f"no data for {self._read_timeout_s:g}s")
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

    async def read(self, limit: int = MAX_WHOLE_BODY) -> bytes:
        """The whole body; a `ProtocolError` past `limit` bytes (the connection is then
        dropped with the response, never reused)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"response body over {limit} bytes")
            parts.append(chunk)
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


@dataclass(slots=True, eq=False)
class _Origin:
    """The connections to one origin: the idle ones (most recently used last), how many
    are open or opening (what the cap counts), and the requests waiting for one."""

    idle: list[_Connection] = field(default_factory=list)
    open: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def wake(self) -> None:
        """A connection came free, or room for one: the first waiter looks again."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class HTTPClient:
    """Requests to any number of origins, over pooled keep-alive connections, at most
    `max_connections_per_origin` to each (see `MAX_CONNECTIONS_PER_ORIGIN`)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        idle_timeout_s: float = 30.0,
        max_idle_per_origin: int = 256,
        max_connections_per_origin: int = MAX_CONNECTIONS_PER_ORIGIN,
    ) -> None:
        if max_connections_per_origin < 1:
            raise ValueError("max_connections_per_origin must be at least 1")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.max_connections_per_origin = max_connections_per_origin
        self._origins: dict[tuple[str, int], _Origin] = {}
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
                raise ConnectError(f"not an http:// URL: {url!r}")
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
        conn, pooled = await self._acquire(origin, reuse=True)
        while True:
            conn.send(message)
            try:
                await conn.head()
            except ClosedError:
                conn.abort()
                if pooled and not conn.received_any:
                    # The peer closed the pooled connection while it idled: the request
                    # never arrived. Once more, on a fresh connection.
                    conn, pooled = await self._acquire(origin, reuse=False)
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return Response(self, origin, conn)

    async def _acquire(self, origin: tuple[str, int], reuse: bool) -> tuple[_Connection, bool]:
        """A connection to `origin`, and whether it is a pooled one: an idle one (if
        `reuse`), else a new one while fewer than the cap are open. At the cap it waits
        for either; the connect timeout bounds the wait and the connect together."""
        pool = self._origins.get(origin)
        if pool is None:
            pool = self._origins[origin] = _Origin()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        turns = 0
        while True:
            if self._closed:
                raise TransportError("the client is closed")
            if reuse and (conn := self._pooled(pool)) is not None:
                return conn, True
            if pool.open < self.max_connections_per_origin:
                break
            if not reuse and pool.idle:
                pool.idle.pop(0).abort()  # a fresh one takes the place of the oldest idle
            await self._wait_turn(origin, pool, deadline, again=turns > 0)
            turns += 1
        pool.open += 1
        try:
            conn = await self._connect(origin, pool, deadline - loop.time())
        except BaseException:
            pool.open -= 1
            pool.wake()
            raise
        return conn, False

    async def _wait_turn(
        self, origin: tuple[str, int], pool: _Origin, deadline: float, again: bool
    ) -> None:
        """Wait until a connection to `origin` comes free (or room for one); a waiter
        that looked and lost the race keeps its place at the front."""
        waiter = asyncio.get_running_loop().create_future()
        if again:
            pool.waiters.appendleft(waiter)
        else:
            pool.waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                pool.wake()  # woken as it gave up: the turn passes on
            elif waiter in pool.waiters:
                pool.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                host, port = origin
                raise PoolTimeoutError(
                    f"no connection to {host}:{port} came free within "
                    f"{self.connect_timeout_s:g}s ({self.max_connections_per_origin} open)"
                ) from None
            raise

    def _pooled(self, pool: _Origin) -> _Connection | None:
        idle = pool.idle
        if not idle:
            return None
        stale = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > stale:
                return conn
            conn.abort()
        return None

    async def _connect(
        self, origin: tuple[str, int], pool: _Origin, timeout_s: float
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = origin

        def lost(conn: _Connection) -> None:
            if conn in self._open:  # not one whose connect failed: that is not counted
                self._open.discard(conn)
                pool.open -= 1
                pool.wake()

        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self.read_timeout_s, lost), host, port
                ),
                max(0.0, timeout_s),
            )
        except TimeoutError:
            raise ConnectTimeoutError(
                f"connect to {host}:{port} timed out ({self.connect_timeout_s:g}s)"
            ) from None
        except OSError as exc:
            raise ConnectError(f"connect to {host}:{port}: {exc}") from exc
        self._open.add(conn)
        return conn

    def _release(self, origin: tuple[str, int], conn: _Connection) -> None:
        pool = self._origins.get(origin)
        if pool is None or self._closed or len(pool.idle) >= self.max_idle_per_origin:
            conn.abort()
            return
        conn.reuse()
        conn.idle_since = time.monotonic()
        pool.idle.append(conn)
        pool.wake()

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
        with TransportError), fail the requests waiting for one, and let their sockets
        close before returning."""
        self._closed = True
        for pool in self._origins.values():
            pool.idle.clear()
            while pool.waiters:
                pool.wake()
        for conn in list(self._open):
            conn.abort()
        await asyncio.sleep(0)  # the transports close their sockets on the next loop turn
