"""The client side of a relayed event stream, on an aiohttp server response.

`EventStreamResponse` sends its headers with its first event: one packet and one wake-up
of the client on the way to the first token, instead of one for the headers and one for
the event. `DirectWriter` lets a relay write the stream from inside an upstream read
callback, where no coroutine can run: the first write goes through aiohttp (with the
headers); after it, the writer writes on the client's transport itself, framing chunks
as aiohttp would (aiohttp still frames the final chunk, at `write_eof`).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

_EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EventStreamResponse(web.StreamResponse):
    """A streamed reply whose headers leave with its first event."""

    # aiohttp's own `Response` buffers its headers the same way; a StreamResponse has no
    # public switch for it.
    _send_headers_immediately = False


class DirectWriter:
    """Writes a prepared stream's bytes on the client's transport, from a callback."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self.response = response
        self._transport: asyncio.Transport | None = None  # set once the headers are out
        self._protocol: web.RequestHandler | None = None
        self.chunked = False  # the response's body is chunked (HTTP/1.1)

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> DirectWriter:
        """Start an event stream (its headers, `headers` besides the stream's own, leave
        with its first event) and its writer."""
        response = EventStreamResponse(headers=_EVENT_STREAM | headers)
        await response.prepare(request)
        return cls(request, response)

    @property
    def direct(self) -> bool:
        """The headers are out: `write` may be called."""
        return self._transport is not None

    async def write_first(self, data: bytes) -> None:
        """The first bytes, through aiohttp, which sends the headers with them."""
        await self.response.write(data)
        self._transport = self._request.transport
        self._protocol = self._request.protocol
        self.chunked = self.response.headers.get("Transfer-Encoding") == "chunked"

    def write(self, data: bytes, *, framed: bool = False) -> None:
        """Bytes of the body, framed as a chunk when the body is chunked (`framed`: they
        are whole chunks already)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        if self.chunked and not framed:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        transport.write(data)

    @property
    def blocked(self) -> bool:
        """The client's socket buffer is full: stop reading upstream until it drains."""
        return self._protocol is not None and self._protocol.writing_paused

    async def drain(self) -> None:
        """Wait until the client's buffer has drained; ConnectionResetError if the client
        goes away meanwhile."""
        await self._request.writer.drain()
