"""Server-sent event framing for engine streams.

`SSEFramer.feed(chunk)` returns the complete events of the bytes received so far; a
partial event waits for the next chunk. Frames are found by index, so a read's worth of
events costs one scan and one slice per event, and a one-line `data:` frame (what SGLang
and OpenAI servers write) is kept as it came, for a proxy to forward unchanged. The scan
looks for single newlines (a memchr), not for the blank line: a two-byte search runs
several times slower over the kilobytes of a cumulative `/generate` event.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.contract.vocabulary import DONE


@dataclass(slots=True)  # not frozen: built for every relayed event, and frozen costs 2×
class SSEEvent:
    """One event: its frame as received (ending in a blank line), its `event:` name (empty
    when none) and its data (the `data:` lines joined by newlines)."""

    raw: bytes
    data: bytes
    event: bytes = b""

    @property
    def done(self) -> bool:
        return self.data == DONE


class SSEFramer:
    """Cuts a byte stream into events. Frames without data or a name (comments,
    keep-alives) are dropped."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    @property
    def idle(self) -> bool:
        """No partial frame is waiting for more bytes."""
        return not self._pending

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._pending + chunk if self._pending else chunk
        events: list[SSEEvent] = []
        start = 0
        find = buf.find
        while (end := find(b"\n", start)) >= 0:
            if buf.startswith(b"\n", end + 1):  # a one-line frame
                if buf.startswith(b"data:", start):
                    events.append(_data_event(buf[start : end + 2]))
                    start = end + 2
                    continue
            else:
                end = find(b"\n\n", end)
                if end < 0:
                    break
            event = _parse(buf[start : end + 2])
            if event is not None:
                events.append(event)
            start = end + 2
        self._pending = buf[start:]
        return events


def one_data_event(frame: bytes) -> SSEEvent | None:
    """`frame` as an event when it is exactly one one-line `data:` frame, else None."""
    if frame.startswith(b"data:") and frame.find(b"\n") == len(frame) - 2 and frame[-1:] == b"\n":
        return _data_event(frame)
    return None


def _data_event(frame: bytes) -> SSEEvent:
    """A one-line `data:` frame (one space after the colon is not data)."""
    return SSEEvent(frame, frame[6 if frame.startswith(b" ", 5) else 5 : -2])


def _parse(raw: bytes) -> SSEEvent | None:
    name, data = b"", []
    for line in raw[:-2].split(b"\n"):
        if line.startswith(b"data:"):
            data.append(_value(line[5:]))
        elif line.startswith(b"event:"):
            name = _value(line[6:])
    if not data and not name:
        return None
    return SSEEvent(raw, b"\n".join(data), name)


def _value(field: bytes) -> bytes:
    """A field's value: what follows its colon, less one leading space (the SSE rule)."""
    return field[1:] if field.startswith(b" ") else field
