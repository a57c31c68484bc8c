"""What a server reads from its clients, bounded: body size, body bytes in flight, time,
and connections. The router and the sidecar (aiohttp servers) both serve through a
`RequestGuard`.

- **Body size.** A body may be at most `max_body_bytes`, by default sized to what a valid
  request of the context can need (`body_limit`). A larger Content-Length is refused with
  413 before a byte of the body is read; a chunked body, once it grows past the limit. A
  body of 64 KiB or more may hold at most one JSON value per `BYTES_PER_VALUE` bytes of
  the limit (counted in C before decoding), else 413 too: what bounds a body's decoded
  size is its count of values, and `[[],[],...]` decodes to ~22 times its bytes.
- **Bytes in flight.** A request reserves its declared length (a chunked one: the limit)
  from one budget, `max_body_bytes_in_flight` (4 limits by default), while its body is read
  and decoded. When the budget is spent it waits, reading nothing (its bytes stay in the
  kernel's buffers: TCP pushes back on the client), up to `body_wait_s`, then gets 503
  with Retry-After. A small body passes a large one that waits.
- **Time.** A request's head must arrive within `header_timeout_s` of its first byte (the
  connection is closed otherwise), its body within `body_timeout_s` (408, and the
  connection is closed); a keep-alive connection idle for `idle_timeout_s` is closed.
  Responses are never timed: an event stream may run for hours.
- **Connections.** Beyond `max_connections` open at once, a new connection is answered 503
  (`too_many_connections`) and closed; the open ones are unaffected.

aiohttp (3.10-3.14) has no header or body timeout and no connection cap: its keep-alive
timer is the only one, and it closes a connection that is idle *or* still sending its
head, counted from the last response. So a guard wraps each connection's aiohttp protocol
in its own (`_Guarded`), which sees every read and arms one timer; a middleware tells it
when a request's handling starts and ends. Bodies are read by `RequestGuard.read`, with
the limits, the budget and the body timeout.

Decoding holds the event loop, and a thread does not help: msgspec decodes without
releasing the GIL (measured here: three 2.25 MiB bodies of empty arrays stalled a loop
ticker ~1 s in a thread, ~1.6 s inline). What bounds the stall is the size and value
limits; bodies of 64 KiB or more are also decoded one at a time with the loop run between
them (heartbeats and other I/O go on between two large decodes), and with the cyclic
garbage collector paused (a body of many small containers otherwise sets off collection
after collection: ~6x slower).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar, cast

from aiohttp import StreamReader, web

from controlplane.contract.vocabulary import error_body

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Room in a body for everything but the prompt: sampling settings, tools and their
# schemas, stop lists, logit biases.
BODY_OVERHEAD_BYTES = 1 << 20
# A prompt token as JSON text, generously: a long token of non-ASCII text escaped as
# \uXXXX takes 6 bytes a character.
TEXT_BYTES_PER_TOKEN = 32
# A prompt token as an id in a JSON array: up to 7 digits and a comma.
ID_BYTES_PER_TOKEN = 8
# Bodies from this size on are decoded one at a time, without the garbage collector,
# and their JSON values counted first.
LARGE_BODY = 64 * 1024
# Body bytes a JSON value (an array, an object, or an element or member after a comma)
# may take, on average over the body limit. A valid body is far sparser: its prompt's
# ids are bounded by the context (8 bytes each in `body_limit`), and text, whose brackets
# and commas count too, is tokens of several bytes. A body of small containers is not:
# `[[],[],...]` decodes to ~22 times its size in Python objects.
BYTES_PER_VALUE = 10
# How long a refused connection may keep reading (and dropping) what its client sends
# before it is closed, so that the client reads the 503 rather than a reset.
_REFUSED_LINGER_S = 1.0


def body_limit(context_length: int) -> int:
    """The largest body a request of `context_length` tokens can need: a prompt that fills
    the context as text or as token ids, and the rest of the request (2.25 MiB at 32K
    tokens, 6 MiB at 128K)."""
    return BODY_OVERHEAD_BYTES + context_length * (TEXT_BYTES_PER_TOKEN + ID_BYTES_PER_TOKEN)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """How much a server reads from its clients, for how long, and from how many.
    `max_body_bytes` 0: `body_limit` of the context; `max_body_bytes_in_flight` 0: four
    times the body limit."""

    max_body_bytes: int = 0
    max_body_bytes_in_flight: int = 0
    body_wait_s: float = 10.0
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if self.max_body_bytes < 0 or self.max_body_bytes_in_flight < 0:
            raise ValueError("body limits must not be negative (0: the default)")
        for name in ("body_wait_s", "header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) <= 86_400:
                raise ValueError(f"{name} must be in (0, 86400] seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if 0 < self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError("max_body_bytes_in_flight must hold at least one largest body")

    def for_context(self, context_length: int) -> ServerLimits:
        """These limits with the defaults filled in for a context of `context_length`."""
        body = self.max_body_bytes or body_limit(context_length)
        return replace(
            self,
            max_body_bytes=body,
            max_body_bytes_in_flight=max(self.max_body_bytes_in_flight or 4 * body, body),
        )


class BodyError(Exception):
    """A request body the guard refused: 413 (too large), 408 (too slow) or 503 (the
    budget of bytes in flight stayed spent); each server answers it in its own format."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


class ByteBudget:
    """Bytes that may be held at once. A request that fits takes its share at once, even
    past others that wait (first fit); the rest wait in order of arrival."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0  # the most ever held at once
        self.waits = 0  # takes that had to wait
        self.timeouts = 0  # takes that waited in vain
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def try_take(self, n: int) -> bool:
        if self.used + n > self.capacity:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def take(self, n: int, timeout_s: float) -> bool:
        """Take `n` bytes, waiting up to `timeout_s` for them; False when they stayed spent."""
        if self.try_take(n):
            return True
        self.waits += 1
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        granted = False
        try:
            async with asyncio.timeout(timeout_s):
                await entry[1]
            granted = True
        except TimeoutError:
            self.timeouts += 1
        finally:
            if not granted:
                if entry[1].done() and not entry[1].cancelled():
                    self.release(n)  # granted just as the wait ended
                else:
                    entry[1].cancel()
                    if entry in self._waiters:
                        self._waiters.remove(entry)
        return granted

    def release(self, n: int) -> None:
        self.used -= n
        for entry in list(self._waiters):
            wanted, future = entry
            if future.done():
                self._waiters.remove(entry)
            elif self.try_take(wanted):
                self._waiters.remove(entry)
                future.set_result(None)


# A connection's states: between requests, reading a head, handling a request.
_IDLE, _HEAD, _BUSY = range(3)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's timers: idle (no request
    since the last one ended) and head (a request begun and its handling not yet)."""

    __slots__ = ("_deadline", "_guard", "_inner", "_loop", "_state", "_timer", "transport")

    def __init__(self, guard: RequestGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._loop = asyncio.get_running_loop()
        self._state = _IDLE
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._guard._conns[transport] = self
        self.idle()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE:  # the first bytes of a request: its head is timed
            self._state = _HEAD
            self._arm(self._loop.time() + self._guard.limits.header_timeout_s)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard._conns.pop(self.transport, None)  # type: ignore[arg-type]
        self._guard.open -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def busy(self) -> None:
        """A request is being handled: nothing is timed here (its body read is, by `read`)."""
        self._state = _BUSY

    def idle(self) -> None:
        if self.transport is None:
            return
        self._state = _IDLE
        self._arm(self._loop.time() + self._guard.limits.idle_timeout_s)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _arm(self, deadline: float) -> None:
        """One timer a connection: re-armed later when it fires early, moved only when a
        deadline comes sooner than it."""
        self._deadline = deadline
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return
            timer.cancel()
        self._timer = self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        transport = self.transport
        if self._state == _BUSY or transport is None:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._expire)
            return
        if self._state == _IDLE and transport.get_write_buffer_size():
            self.idle()  # still sending the last response to a slow reader
            return
        self._guard.stopped("header_timeout" if self._state == _HEAD else "idle_timeout")
        transport.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, then closed."""

    def __init__(self, guard: RequestGuard) -> None:
        self._guard = guard
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio's classes: no isinstance check here.
        transport = cast(asyncio.Transport, transport)
        guard = self._guard
        guard.stopped("too_many_connections")
        if guard.refusing > guard.limits.max_connections:  # a flood: no courtesy
            transport.abort()
            return
        transport.write(guard.refusal)
        if transport.can_write_eof():
            # The answer, then the end of our side; what the client sent meanwhile is
            # read and dropped, so that closing does not reset the answer away.
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.refusing -= 1
        if self._timer is not None:
            self._timer.cancel()


class GuardedSite(web.BaseSite):
    """A site whose connections are guarded: on `host`/`port`, or on a bound `sock`."""

    __slots__ = ("_guard", "_host", "_port", "_sock")

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: RequestGuard,
        *,
        host: str | None = None,
        port: int = 0,
        sock: socket.socket | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self._host, self._port, self._sock = host, port, sock

    @property
    def name(self) -> str:
        sockets = getattr(self._server, "sockets", None)
        if sockets:
            host, port = sockets[0].getsockname()[:2]
        else:
            host, port = self._host or "0.0.0.0", self._port
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory = self._guard.protocol_factory(server)
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
        else:
            self._server = await loop.create_server(
                factory, self._host, self._port, backlog=self._backlog
            )


# The limits a guard enforces, by name: those that close a connection, those that refuse
# a request's body.
_CLOSING_LIMITS = ("header_timeout", "idle_timeout", "too_many_connections")
_REFUSING_LIMITS = ("body_too_large", "body_too_complex", "body_timeout", "body_budget")
LIMITS = _CLOSING_LIMITS + _REFUSING_LIMITS


class RequestGuard:
    """One server's limits in force: its connections' timers and cap (`start`), the
    middleware that tells them when requests are handled, and body reads (`read`).
    `refuse` answers a `BodyError` in the server's own error format; `on_stop`, if given,
    hears each connection closed (`closed`) or body refused (`refused`) by a limit, by its
    name (`LIMITS`), for the server's metrics."""

    def __init__(
        self,
        limits: ServerLimits,
        refuse: Callable[[BodyError], web.Response],
        on_stop: Callable[[str], None] | None = None,
    ) -> None:
        if not limits.max_body_bytes or not limits.max_body_bytes_in_flight:
            raise ValueError("give the guard resolved limits (ServerLimits.for_context)")
        self.limits = limits
        self.budget = ByteBudget(limits.max_body_bytes_in_flight)
        self.open = 0  # guarded connections
        self.refusing = 0  # connections over the cap, being answered
        self.closed = dict.fromkeys(_CLOSING_LIMITS, 0)
        self.refused = dict.fromkeys(_REFUSING_LIMITS, 0)
        self._on_stop = on_stop
        self._refuse = refuse
        self._conns: dict[asyncio.BaseTransport, _Guarded] = {}
        self._decoding = asyncio.Lock()
        message = (
            f"this server has {limits.max_connections} connections open, its most: "
            "retry shortly, or on another connection you keep open"
        )
        body = error_body("unavailable", message, reason="too_many_connections")
        self.refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b"
            % (len(body), body)
        )

        @web.middleware
        async def middleware(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            conn = self._conns.get(request.transport)  # type: ignore[arg-type]
            if conn is not None:
                conn.busy()
            try:
                response = await handler(request)
                if response.status == 408 and conn is not None:
                    # The client is too slow to wait for: answer, and end the connection
                    # rather than read (and drop) the rest of its body.
                    response.force_close()
                    await response.prepare(request)
                    await response.write_eof()
                    conn.close()
                return response
            except web.HTTPRequestEntityTooLarge:  # a route that read the body itself
                return self._refuse(self._too_large(self.limits.max_body_bytes, None))
            finally:
                if conn is not None:
                    conn.idle()

        self.middleware = middleware

    def stopped(self, limit: str) -> None:
        """A limit closed a connection or refused a body: counted, and told `on_stop`."""
        table = self.closed if limit in self.closed else self.refused
        table[limit] += 1
        if self._on_stop is not None:
            self._on_stop(limit)

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The server's protocol for each new connection, guarded; over the cap, one that
        answers 503 and closes."""

        def make() -> asyncio.Protocol:
            if self.open >= self.limits.max_connections:
                self.refusing += 1
                return _Refused(self)
            self.open += 1
            return _Guarded(self, server())

        return make

    async def start(
        self,
        runner: web.BaseRunner,
        *,
        host: str | None = None,
        port: int = 0,
        sock: socket.socket | None = None,
    ) -> GuardedSite:
        """Serve `runner` (set up) on `host`/`port` or `sock`, guarded."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.limits.max_connections > soft - 64:
            log.warning(
                "max_connections %d is near or over the open-file limit %d: connections "
                "past it fail to be accepted instead of being refused with 503",
                self.limits.max_connections, soft,
            )  # fmt: skip
        site = GuardedSite(runner, self, host=host, port=port, sock=sock)
        await site.start()
        return site

    async def read(self, request: web.Request, decode: Callable[[bytes], _T], limit: int = 0) -> _T:
        """The request's body, decoded by `decode` (whose own errors pass through), read
        within the body limit (`limit`, else the guard's), the budget and the body timeout;
        raises `BodyError`."""
        limit = limit or self.limits.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise self._too_large(limit, declared)
        reserved = limit if declared is None else declared
        budget = self.budget
        if not budget.try_take(reserved) and not await budget.take(
            reserved, self.limits.body_wait_s
        ):
            self.stopped("body_budget")
            raise BodyError(
                503, "body_budget",
                f"this server is reading as many request bodies as it may hold at once "
                f"({budget.capacity} bytes): retry shortly", retry_after_s=1.0,
            )  # fmt: skip
        try:
            content = request.content
            if content.is_eof():  # all here already, the common case: nothing to wait for
                raw = await self._read(content, limit)
            else:
                try:
                    async with asyncio.timeout(self.limits.body_timeout_s):
                        raw = await self._read(content, limit)
                except TimeoutError:
                    self.stopped("body_timeout")
                    raise BodyError(
                        408, "body_timeout",
                        f"the request body did not arrive within "
                        f"{self.limits.body_timeout_s:g}s",
                    ) from None  # fmt: skip
            if len(raw) < LARGE_BODY:
                return decode(raw)
            # An upper bound (brackets and commas inside strings count too), in C.
            values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
            if values > limit // BYTES_PER_VALUE:
                self.stopped("body_too_complex")
                raise BodyError(
                    413, "body_too_complex",
                    f"the request body holds up to {values} JSON values; this server "
                    f"takes at most {limit // BYTES_PER_VALUE} (one per {BYTES_PER_VALUE} "
                    f"bytes of its {limit}-byte body limit)",
                )  # fmt: skip
            async with self._decoding:
                value = _decode_large(decode, raw)
                await asyncio.sleep(0)  # the loop runs before the next large body decodes
                return value
        finally:
            budget.release(reserved)

    async def _read(self, content: StreamReader, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise self._too_large(limit, None)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self, limit: int, declared: int | None) -> BodyError:
        self.stopped("body_too_large")
        size = f"of {declared} bytes " if declared is not None else ""
        return BodyError(
            413, "body_too_large",
            f"the request body {size}exceeds this server's limit of {limit} bytes "
            f"({limit / 2**20:.2f} MiB)",
        )  # fmt: skip


def _decode_large(decode: Callable[[bytes], _T], raw: bytes) -> _T:
    """`decode(raw)` with the cyclic collector paused: a decoded body is a tree, and a body
    of many small containers would otherwise set off collection after collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return decode(raw)
    finally:
        if enabled:
            gc.enable()
