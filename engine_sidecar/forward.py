"""Relaying one engine segment to the client, from inside the engine connection's read
callback.

The sidecar sits on every token's path, so the per-token work is kept to what the
relay must do: cut the read into events, read the token total from the last of them
(`StreamReader`), write the read's events to the client in one send, and tell the ledger.
`Forwarder.feed` does all of it within the engine connection's `data_received`: no task
wakes, no coroutine runs per read. The request's task takes over only where it must
await: the first write, which aiohttp sends together with the response headers; a client
whose socket buffer is full (the engine's bytes wait in the connection meanwhile, and it
stops reading past a limit); and the segment's end.
"""

from __future__ import annotations

from collections.abc import Callable

from controlplane.transport.event_stream import DirectWriter
from engine_sidecar.engine import EngineStream, StreamEvent
from engine_sidecar.ledger import Flight, Ledger
from engine_sidecar.relay import Step, StreamReader


class Forwarder:
    """One segment of one streamed request: engine events in, client bytes out."""

    def __init__(
        self,
        reader: StreamReader,
        flight: Flight,
        ledger: Ledger,
        note_tokens: Callable[[Flight, int], None],
        base: int,
    ) -> None:
        self._reader = reader
        self._flight = flight
        self._ledger = ledger
        self._note_tokens = note_tokens
        self._base = base  # tokens the request had before this endpoint took it over
        self._skims = reader.skims
        self._deadline = flight.record.deadline_at
        self._out: DirectWriter | None = None
        self.finish = ""  # the engine's finish; "deadline" when the deadline passed
        self.ended = False  # the segment is over (its [DONE], or a passed deadline)
        self.pending = b""  # bytes the task writes (the first, with the headers)
        self._new_prompt = 0  # the engine's prompt size, read but not yet accounted

    def feed_wire(self, wire: bytes, last: StreamEvent) -> bool | None:
        """Cut-through: a read of whole engine chunks, forwarded as it came (the client's
        response is chunked too), its token total read from its last event. Only a
        fresh cumulative /generate segment (whose events go out unchanged, the earlier
        ones of a read unread) takes it; a pending preemption or a passed deadline
        declines (None), to the decoding path."""
        out = self._out
        if self._flight.preempt_mode or (self._deadline and self._ledger.clock() >= self._deadline):
            return None
        assert out is not None  # offered only once the headers are out
        step = self._read(last)
        if step.finish:
            self.finish = step.finish
        out.write(wire, framed=True)
        self._account()
        return out.blocked

    def feed(self, batch: list[StreamEvent]) -> bool:
        """The events of one read; True stops the push (the segment ended, or the task
        must write or wait)."""
        if self._deadline and self._ledger.clock() >= self._deadline:
            self.finish, self.ended = "deadline", True
            return True
        data: list[bytes] = []
        last = len(batch) - 1
        for i, event in enumerate(batch):
            if event.done:
                self.ended = True
                break
            if self.finish == "abort":
                # Preempted: nothing more reaches the client, but what follows the abort
                # is read to the stream's end (a chat's token ids come after its last chunk).
                self._read(event)
                continue
            if self._skims and i < last and not batch[i + 1].done:
                data.append(event.raw)  # the read's last event has the totals
                continue
            step = self._read(event)
            if step.finish == "abort" and self._flight.preempt_mode:
                self._reader.forget_last()
                self.finish = "abort"
                continue
            if step.forward is not None:
                data.append(step.forward)
            if step.finish:
                self.finish = step.finish
        out = self._out
        if out is None or not out.direct:
            self.pending += b"".join(data)
            return True
        if data:
            out.write(data[0] if len(data) == 1 else b"".join(data))
        self._account()
        return self.ended or out.blocked

    def _read(self, event: StreamEvent) -> Step:
        reader = self._reader
        step = reader.read(event.raw, event.data)
        if step.prompt_tokens and not reader.prompt_tokens and self._base == 0:
            reader.prompt_tokens = self._new_prompt = step.prompt_tokens
        return step

    def _account(self) -> None:
        """The events of one read arrived together: the ledger takes their total (and the
        engine's prompt size, when it first shows) once, after the client has them."""
        if self._new_prompt:
            self._ledger.set_prompt_tokens(self._flight, self._new_prompt)
            self._new_prompt = 0
        self._note_tokens(self._flight, self._reader.generated - self._base)

    async def run(self, stream: EngineStream, out: DirectWriter) -> str:
        """Relay the segment to `out`; returns the engine's finish: '' when the stream
        ended without one, 'abort' (not forwarded, the rest of the stream read) when it
        ended for this request's preemption, 'deadline' when the request's deadline
        passed."""
        self._out = out
        while True:
            cut_through = self._skims and out.direct and out.chunked
            body_ended = await stream.push(self.feed, self.feed_wire if cut_through else None)
            if self.pending:
                data, self.pending = self.pending, b""
                await out.write_first(data)
                self._account()
            if self.ended or body_ended:
                return self.finish
            await out.drain()  # stopped for a full client buffer (or the first write)
