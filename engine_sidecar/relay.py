"""Reading an engine's stream for one request: token counting and splicing segments.

A request's output may come from several engine requests ("segments"): the first, and one
more after each in-place recompute; a continuation arriving at `/weir/v1/continue` starts
with an offset. `StreamReader` reads each segment's events for one entry API, reports the
generated-token total, the finish, and what the client has received, and rewrites an event
only where the client would otherwise see a seam:

- `/generate` streams are cumulative (text, output_ids, completion_tokens): a resumed
  segment's events get the earlier output prepended and the first segment's id;
- OpenAI streams are deltas: they pass through untouched, except that a resumed segment's
  opening role-only chunk is dropped and its usage counts the earlier tokens too.

OpenAI chunks carry no token count unless `stream_options.continuous_usage_stats` is on,
and one chunk may carry several tokens, so the sidecar turns it on for every OpenAI stream
(chunks then carry a `usage` field; the final usage-only chunk is dropped unless the
client asked for it). Without usage, a chunk with content counts as one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from controlplane.contract import EngineAPI, FinishReason
from controlplane.contract.stream_events import generate_meta

_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode


# Typed views of an OpenAI event: msgspec skips every field not declared.
class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _OpenAIEvent(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_openai_decode = msgspec.json.Decoder(_OpenAIEvent).decode


class MalformedEventError(ValueError):
    """The engine sent a stream event the sidecar cannot read."""


@dataclass(slots=True)  # not frozen: one per relayed read, and frozen costs 2×
class Step:
    """What one event means: bytes to forward (None = drop), the generated-token total so
    far, and the engine's finish ('' while running; 'abort' for an abort)."""

    forward: bytes | None
    generated: int
    finish: str
    prompt_tokens: int = 0


@dataclass
class StreamReader:
    api: EngineAPI
    incremental_text: bool = False  # SGLang's --incremental-streaming-output
    # Output before the current segment (a resumed or continued request).
    offset_tokens: int = 0
    prefix_ids: list[int] = field(default_factory=list)
    prefix_text: str = ""
    client_id: str = ""  # the id the client saw in the first segment
    client_usage: bool = True  # the client asked for the usage chunk (OpenAI)
    prompt_tokens: int = 0  # the first segment's prompt, reported on resumed segments
    # Within the current segment.
    seg_tokens: int = 0
    _last_data: bytes = b""  # the latest cumulative /generate event
    _seg_ids: list[int] = field(default_factory=list)  # incremental /generate only
    _seg_text_parts: list[str] = field(default_factory=list)
    _undo: tuple[int, bool] = (0, False)  # (tokens before, text appended) of the last event

    @property
    def resumed(self) -> bool:
        return self.offset_tokens > 0 or bool(self.prefix_text)

    @property
    def skims(self) -> bool:
        """Events before the last of a read may be forwarded unread: in a fresh cumulative
        /generate stream the latest event says all the earlier ones did (the finish comes
        only in the stream's last event)."""
        return self.api is EngineAPI.GENERATE and not self.incremental_text and not self.resumed

    @property
    def generated(self) -> int:
        return self.offset_tokens + self.seg_tokens

    def _cumulative(self) -> tuple[list[int], str]:
        """The current segment's ids and text from its latest /generate event."""
        if not self._last_data:
            return [], ""
        body = _decode_any(self._last_data)
        ids, text = body.get("output_ids"), body.get("text")
        return (ids if isinstance(ids, list) else []), (text if isinstance(text, str) else "")

    def generated_ids(self) -> list[int]:
        if self.api is not EngineAPI.GENERATE:
            return []
        ids = self._seg_ids if self.incremental_text else self._cumulative()[0]
        return self.prefix_ids + ids

    def generated_text(self) -> str:
        if self.api is EngineAPI.GENERATE and not self.incremental_text:
            return self.prefix_text + self._cumulative()[1]
        return self.prefix_text + "".join(self._seg_text_parts)

    def next_segment(self) -> None:
        """The current segment ended (preempted): its output becomes the prefix."""
        self.prefix_text = self.generated_text()
        self.prefix_ids = self.generated_ids()
        self.offset_tokens = self.generated
        self.seg_tokens, self._last_data = 0, b""
        self._seg_ids, self._seg_text_parts = [], []

    def forget_last(self) -> None:
        """The last event will not reach the client (the abort that ends a preempted
        segment): its output must not count, or a delta stream would lose it. A
        cumulative /generate stream carries it into the next segment anyway."""
        if self.api is EngineAPI.GENERATE:
            return
        tokens, appended = self._undo
        self.seg_tokens = tokens
        if appended:
            self._seg_text_parts.pop()
        self._undo = (tokens, False)

    def read(self, raw: bytes, data: bytes) -> Step:
        """One event: `raw` is the SSE frame as received, `data` its JSON."""
        try:
            if self.api is EngineAPI.GENERATE:
                return self._generate(raw, data)
            return self._openai(raw, data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedEventError(f"unreadable engine event {data[:200]!r}: {exc}") from exc

    def _generate(self, raw: bytes, data: bytes) -> Step:
        meta = generate_meta(data)
        if meta is None:
            return Step(raw, self.generated, "")
        if meta.completion_tokens is not None and meta.completion_tokens > self.seg_tokens:
            self.seg_tokens = meta.completion_tokens
        if not self.client_id:
            self.client_id = meta.id
        if self.incremental_text:
            body = _decode_any(data)
            self._seg_ids.extend(body.get("output_ids") or ())
            self._seg_text_parts.append(body.get("text") or "")
        else:
            self._last_data = data
        finish = meta.finish_reason
        kind = meta.finish_type
        if not self.resumed or kind == "abort":
            prompt = 0 if self.resumed else (meta.prompt_tokens or 0)
            return Step(raw, self.generated, kind, prompt)
        # Resumed: the client expects one cumulative stream.
        out = _decode_any(data)
        if not self.incremental_text:
            out["text"] = self.prefix_text + str(out.get("text") or "")
            if isinstance(out.get("output_ids"), list):
                out["output_ids"] = self.prefix_ids + out["output_ids"]
        new_meta = dict(out["meta_info"])
        new_meta["completion_tokens"] = self.generated
        if kind == "length" and finish:
            new_meta["finish_reason"] = {**finish, "length": self.generated}
        if self.prompt_tokens:
            new_meta["prompt_tokens"] = self.prompt_tokens
        if self.client_id:
            new_meta["id"] = self.client_id
        out["meta_info"] = new_meta
        return Step(b"data: " + _encode(out) + b"\n\n", self.generated, kind)

    def _openai(self, raw: bytes, data: bytes) -> Step:
        event = _openai_decode(data)
        finish = ""
        content = ""
        if event.choices:
            choice = event.choices[0]
            if self.api is EngineAPI.CHAT:
                content = (choice.delta.content or "") if choice.delta else ""
            else:
                content = choice.text or ""
            finish = choice.finish_reason or ""
        counted = False
        usage = event.usage
        self._undo = (self.seg_tokens, bool(content))
        if usage is not None and usage.completion_tokens >= self.seg_tokens:
            self.seg_tokens, counted = usage.completion_tokens, True
        if content:
            self._seg_text_parts.append(content)
            if not counted:
                self.seg_tokens += 1
        if not event.choices and not self.client_usage:
            return Step(None, self.generated, finish)  # usage the sidecar asked for
        if not self.resumed:
            return Step(raw, self.generated, finish)
        if not content and not finish and usage is None:
            return Step(None, self.generated, "")  # the resumed segment's role chunk
        if usage is not None and not event.choices:
            out = _decode_any(data)
            new_usage = dict(out["usage"])
            new_usage["completion_tokens"] = self.generated
            if self.prompt_tokens:
                new_usage["prompt_tokens"] = self.prompt_tokens
                new_usage["total_tokens"] = self.prompt_tokens + self.generated
            out["usage"] = new_usage
            return Step(b"data: " + _encode(out) + b"\n\n", self.generated, finish)
        return Step(raw, self.generated, finish)


def finish_reason(engine_finish: str) -> FinishReason:
    """The Weir finish reason for an engine's (SGLang's) finish type."""
    if engine_finish == "length":
        return FinishReason.LENGTH
    if engine_finish == "abort":
        return FinishReason.ABORTED
    if engine_finish in ("stop", "tool_calls", "content_filter", "eos"):
        return FinishReason.STOP
    return FinishReason.ERROR
