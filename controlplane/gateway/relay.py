"""Relaying an engine's SSE stream to the client, and splicing a resumed one into it.

On the normal path every event goes to the client byte for byte as the engine wrote it;
the relay only reads each complete event to keep count of what the client has received
(text, token ids, token count). A `/generate` event is cumulative, so only its counts are
read as it passes; the latest one's text and ids are decoded when a resume needs them. That count is what makes resumption exact: when an engine
dies mid-stream, or its sidecar ends the stream with `weir.preempted` and a continuation,
the request resumes elsewhere from exactly what the client holds, and the resumed
stream's events are rewritten to continue the first one (the original id; cumulative text
and ids and usage counts for `/generate`) so the client sees one uninterrupted stream.
Only whole events are forwarded, so a stream cut mid-event never leaves half an event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from controlplane.contract import EngineAPI
from controlplane.contract.stream_events import generate_meta
from controlplane.transport import DONE, SSEEvent
from controlplane.transport.event_stream import DirectWriter

PREEMPTED_EVENT = b"weir.preempted"


@dataclass(slots=True)
class Received:
    """What the client has received so far."""

    api: EngineAPI
    text: str = ""
    ids: list[int] = field(default_factory=list)
    tokens: int = 0
    response_id: str = ""
    finish_reason: str = ""
    error: bool = False  # an event said the stream failed (`{"error": ...}`)
    prompt_tokens: int = 0
    text_bytes: int = 0  # len(text) in UTF-8, kept as text grows (OpenAI deltas)
    latest: bytes = b""  # a cumulative /generate event not yet folded into text and ids
    pieces: list[str] = field(default_factory=list)  # OpenAI deltas not yet in text

    def settle(self) -> None:
        """Fold what arrived since into `text` and `ids` (a resume needs them): the
        latest cumulative /generate event, of which the relay read only the counts, and
        OpenAI deltas (a string grown per event costs time linear in the output)."""
        if self.pieces:
            self.text += "".join(self.pieces)
            self.pieces.clear()
        if self.latest:
            try:
                chunk = msgspec.json.decode(self.latest)
            except msgspec.DecodeError:
                chunk = None
            self.latest = b""
            if isinstance(chunk, dict):
                self.fold(chunk)

    def fold(self, chunk: dict[str, Any]) -> None:
        """Take a cumulative /generate event's text and ids as what the client holds."""
        text, ids = chunk.get("text"), chunk.get("output_ids")
        if isinstance(text, str):
            self.text = text
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            self.ids = ids


class Splicer:
    """Counts what an event gives the client and, after a resume, rewrites it so it
    continues what came before (`base`: what the client held when the resume began)."""

    def __init__(self, received: Received, bytes_per_token: float = 1.0) -> None:
        self.received = received
        self.bytes_per_token = bytes_per_token
        self.base: Received | None = None

    def resumed(self) -> None:
        r = self.received
        r.settle()
        self.base = Received(r.api, r.text, list(r.ids), r.tokens, r.response_id)

    def take(self, data: bytes) -> bytes | None:
        """Account for one data payload; return a rewritten payload, or None to forward
        the original bytes unchanged."""
        if self.base is None and self.received.api is EngineAPI.GENERATE and self._counts(data):
            return None
        try:
            chunk = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return None
        if not isinstance(chunk, dict):
            return None
        if "error" in chunk:
            self.received.error = True
        if self.received.api is EngineAPI.GENERATE:
            return self._generate(chunk)
        return self._openai(chunk)

    def _counts(self, data: bytes) -> bool:
        """Read a fresh /generate event for its counts alone; False when it does not
        carry them (it is then decoded whole)."""
        try:
            meta = generate_meta(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if meta is None or meta.completion_tokens is None:
            return False
        r = self.received
        r.latest = data
        if not r.response_id and meta.id:
            r.response_id = meta.id
        if meta.prompt_tokens is not None:
            r.prompt_tokens = meta.prompt_tokens
        r.tokens = meta.completion_tokens
        if meta.finish_type:
            r.finish_reason = meta.finish_type
        return True

    def _generate(self, chunk: dict[str, Any]) -> bytes | None:
        r, base = self.received, self.base
        r.latest = b""
        meta = chunk.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        text = chunk.get("text")
        ids = chunk.get("output_ids")
        completion = meta.get("completion_tokens")
        if base is not None:
            if isinstance(text, str):
                text = chunk["text"] = base.text + text
            if isinstance(ids, list):
                ids = chunk["output_ids"] = base.ids + ids
            if isinstance(completion, int):
                completion = meta["completion_tokens"] = base.tokens + completion
            if isinstance(meta.get("prompt_tokens"), int):
                meta["prompt_tokens"] = r.prompt_tokens
            if base.response_id and "id" in meta:
                meta["id"] = base.response_id
        else:
            if not r.response_id and isinstance(meta.get("id"), str):
                r.response_id = meta["id"]
            if isinstance(meta.get("prompt_tokens"), int):
                r.prompt_tokens = meta["prompt_tokens"]
        r.fold(chunk)
        if isinstance(completion, int):
            r.tokens = completion
        elif isinstance(ids, list):
            r.tokens = len(r.ids)
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and isinstance(finish.get("type"), str):
            r.finish_reason = finish["type"]
        return msgspec.json.encode(chunk) if base is not None else None

    def _openai(self, chunk: dict[str, Any]) -> bytes | None:
        r, base = self.received, self.base
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if base is None and not r.response_id and isinstance(chunk.get("id"), str):
            r.response_id = chunk["id"]
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str) and piece:
                # OpenAI chunks carry text, one or more tokens of it: count by bytes
                # (exact for byte-token engines, an estimate for real tokenizers).
                r.pieces.append(piece)
                r.text_bytes += len(piece.encode("utf-8"))
                r.tokens = round(r.text_bytes / self.bytes_per_token)
            if isinstance(choice.get("finish_reason"), str):
                r.finish_reason = choice["finish_reason"]
            if base is not None and isinstance(delta, dict):
                delta.pop("role", None)  # the role was announced by the first stream
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            if base is not None:
                usage["completion_tokens"] += base.tokens
                usage["prompt_tokens"] = r.prompt_tokens
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            else:
                r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            r.tokens = usage["completion_tokens"]
        if base is None:
            return None
        if base.response_id:
            chunk["id"] = base.response_id
        return msgspec.json.encode(chunk)


class SegmentRelay:
    """One upstream stream relayed to the client from inside the upstream connection's
    read callback (`feed`): no task wakes per read. `outcome` says how it ended:
    "done" (`[DONE]` forwarded), "preempted" (the sidecar's continuation event, not
    forwarded), or "" (the stream broke off)."""

    def __init__(
        self, splicer: Splicer, out: DirectWriter, on_first_token: Callable[[], None]
    ) -> None:
        self._splicer = splicer
        self._received = splicer.received
        self._out = out
        self._on_first_token = on_first_token
        self.outcome = ""
        self.continuation = b""  # the sidecar's continuation, when it ended "preempted"
        self.pending = bytearray()  # bytes for the task to write (the first, with headers)

    @property
    def cuts_through(self) -> bool:
        """Whole chunks may go to the client as they came: a fresh /generate stream,
        whose events are forwarded unchanged, onto a chunked response."""
        return (
            self._splicer.base is None
            and self._received.api is EngineAPI.GENERATE
            and self._out.direct
            and self._out.chunked
        )

    def feed(self, events: list[SSEEvent]) -> bool:
        """The events of one upstream read; True stops the push (the stream ended, or
        the task must write or wait)."""
        data = bytearray()  # the events of one upstream read go out in one write
        for event in events:
            if event.event == PREEMPTED_EVENT:
                self.outcome, self.continuation = "preempted", bytes(event.data)
                break
            if event.data == DONE:
                data += event.raw
                self.outcome = "done"
                break
            rewritten = self._take(event)
            data += event.raw if rewritten is None else sse(rewritten)
        out = self._out
        if not out.direct:
            self.pending += data
            return True
        if data:
            out.write(bytes(data))
        return bool(self.outcome) or out.blocked

    def feed_wire(self, wire: bytes, last: SSEEvent) -> bool:
        """Cut-through: whole chunks forwarded as they came, counted by their last
        event (see `cuts_through`)."""
        self._take(last)
        self._out.write(wire, framed=True)
        return self._out.blocked

    def _take(self, event: SSEEvent) -> bytes | None:
        before = self._received.tokens
        rewritten = self._splicer.take(event.data)
        if self._received.tokens > before and not before:
            self._on_first_token()
        return rewritten


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
