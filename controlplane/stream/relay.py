"""Relaying one segment of a streamed request from its upstream to the client, from inside
the upstream connection's read callback. The router and the sidecar both run it.

Router and sidecar sit on every token's path, so the per-token work is kept to what the
relay must do: cut the read into events, read them (`Splicer`; in a fresh cumulative
`/generate` stream only the last of a read, which has the totals), write the read's events
to the client in one send, and tell the hop (`SegmentWatch.delivered`). `Relay.feed` does
all of it within the upstream connection's `data_received`: no task wakes, no coroutine
runs per read. A read of whole chunks of a fresh `/generate` stream onto a chunked
response goes to the client as it came, undecoded (`feed_wire`). The request's task takes
over only where it must await: the first write, which aiohttp sends together with the
response headers; a client whose socket buffer is full (the upstream's bytes wait in the
connection meanwhile, and it stops reading past a limit); and the segment's end.

Only whole events are forwarded, so a stream cut mid-event never leaves half an event.
The upstream's `[DONE]` ends the segment unforwarded: the hop writes its own when the
request, not just the segment, is over.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import ClassVar

from controlplane.contract.vocabulary import PREEMPTED_EVENT
from controlplane.stream.splicer import Splicer
from controlplane.transport.event_stream import DirectWriter
from controlplane.transport.sse import SSEEvent

EventSink = Callable[[list[SSEEvent]], bool]
WireSink = Callable[[bytes, SSEEvent], bool | None]
Push = Callable[[EventSink, WireSink | None], Awaitable[bool]]
"""An upstream's `push_events` (`controlplane.transport.Response`)."""


class Ending(enum.Enum):
    """How a segment's relay ended."""

    BROKEN = "broken"  # the upstream's body ended without `[DONE]`
    DONE = "done"  # `[DONE]` read
    PREEMPTED = "preempted"  # a sidecar handed the request back (`weir.preempted`)
    DEADLINE = "deadline"  # the request's deadline passed (the rest is not relayed)


class SegmentWatch:
    """What the hop running a relay adds to it; by default nothing."""

    # Whether `deadline_passed` or `preempting` can ever be true: a watch that sets it
    # is asked on every read, one that does not (the router's) never.
    guarded: ClassVar[bool] = False

    def deadline_passed(self) -> bool:
        """Whether to stop relaying, for the request's deadline passed."""
        return False

    def preempting(self) -> bool:
        """Whether an engine abort would be this hop's preemption of the request: the
        abort is then not forwarded, nor anything after it."""
        return False

    def delivered(self) -> None:
        """A read's events reached the client (their counts are in the splicer)."""


class Relay:
    """One segment of one streamed request: upstream events in, client bytes out."""

    def __init__(self, splicer: Splicer, watch: SegmentWatch) -> None:
        self._splicer = splicer
        self._watch = watch
        self._guarded = watch.guarded
        self._out: DirectWriter | None = None
        self._withheld = False  # this hop's preemption was read: nothing more goes out
        self.ending: Ending | None = None
        self.continuation = b""  # what a `weir.preempted` event carried
        self.pending = bytearray()  # bytes for the task to write (the first, with headers)

    async def run(
        self, push: Push, out: DirectWriter, first: list[SSEEvent] | None = None
    ) -> Ending:
        """Relay the segment to `out` until it ends; `first`: events read before the relay
        began (a P/D decode leg's first read), fed as if just read."""
        self._out = out
        splicer = self._splicer
        while True:
            if first:
                self.feed(first)
                first, body_ended = None, False
            else:
                cut_through = splicer.skims and out.direct and out.chunked
                body_ended = await push(self.feed, self.feed_wire if cut_through else None)
            if self.pending:
                data, self.pending = bytes(self.pending), bytearray()
                await out.write_first(data)
                self._watch.delivered()
            if self.ending is not None:
                return self.ending
            if body_ended:
                return Ending.BROKEN
            await out.drain()  # stopped for a full client buffer (or the first write)

    def feed(self, events: list[SSEEvent]) -> bool:
        """The events of one upstream read; True stops the push (the segment ended, or the
        task must write or wait)."""
        watch, splicer = self._watch, self._splicer
        if self._guarded and watch.deadline_passed():
            self.ending = Ending.DEADLINE
            return True
        data: list[bytes] = []
        skims = splicer.skims
        last = len(events) - 1
        for i, event in enumerate(events):
            if event.event == PREEMPTED_EVENT:
                self.ending, self.continuation = Ending.PREEMPTED, bytes(event.data)
                break
            if event.done:
                self.ending = Ending.DONE
                break
            if self._withheld:
                # Preempted: nothing more reaches the client, but what follows the abort
                # is read to the stream's end (a chat's token ids come after its last chunk).
                splicer.read(event.raw, event.data)
                continue
            if skims and i < last:
                after = events[i + 1]
                if not after.done and not after.event:
                    data.append(event.raw)  # the read's last event has the totals
                    continue
            forward = splicer.read(event.raw, event.data)
            if splicer.finish == "abort" and self._guarded and watch.preempting():
                splicer.forget_last()
                self._withheld = True
                continue
            if forward is not None:
                data.append(forward)
        out = self._out
        if out is None or not out.direct:
            self.pending += b"".join(data)
            return True
        if data:
            out.write(data[0] if len(data) == 1 else b"".join(data))
        watch.delivered()
        return self.ending is not None or out.blocked

    def feed_wire(self, wire: bytes, last: SSEEvent) -> bool | None:
        """Cut-through: a read of whole upstream chunks, forwarded as it came (the client's
        response is chunked too), its token total read from its last event (see
        `Splicer.skims`). A pending preemption or a passed deadline declines (None), to
        `feed`."""
        watch, out = self._watch, self._out
        if self._guarded and (watch.preempting() or watch.deadline_passed()):
            return None
        assert out is not None  # offered only once the headers are out
        self._splicer.read(last.raw, last.data)
        out.write(wire, framed=True)
        watch.delivered()
        return out.blocked
