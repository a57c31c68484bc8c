"""Typed views of what an engine streams and answers: SGLang's `/generate` events and the
OpenAI (completions and chat) chunks, read for the fields a relay needs.

A `/generate` event is cumulative: it carries the whole text and every output token id
so far, so decoding each event whole costs time that grows with the output, per event
(half a millisecond at 4,000 tokens). A relay needs the counts on every event and the
output only when a request resumes. SGLang writes `meta_info` last, after the text and
ids, so `generate_meta` decodes it from its key on: a string's quotes are escaped, so the
key cannot occur inside the text. Anything else falls back to a full typed decode that
still skips the text and ids. OpenAI chunks are small; their views skip every field not
declared.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from controlplane.contract import FinishReason


class GenerateMeta(msgspec.Struct):
    """The `meta_info` of a `/generate` event; None where the engine did not say."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    id: str = ""
    finish_reason: dict[str, Any] | None = None

    @property
    def finish_type(self) -> str:
        """The finish reason's type ('' while running, 'abort' for an abort)."""
        kind = self.finish_reason.get("type") if self.finish_reason else None
        return kind if isinstance(kind, str) else ""


class _GenerateEvent(msgspec.Struct):
    meta_info: GenerateMeta | None = None


_event_decode = msgspec.json.Decoder(_GenerateEvent).decode
_meta_decode = msgspec.json.Decoder(GenerateMeta).decode
_META_KEY = b'"meta_info":'


def generate_meta(data: bytes) -> GenerateMeta | None:
    """The meta_info of a `/generate` event's JSON `data` (None when it has none).
    Raises msgspec.DecodeError or ValidationError for what is not such an event."""
    at = data.rfind(_META_KEY)
    if at >= 0 and data.endswith(b"}"):
        try:
            return _meta_decode(data[at + len(_META_KEY) : -1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return _event_decode(data).meta_info


class _Failure(msgspec.Struct):
    error: Any = None


_failure_decode = msgspec.json.Decoder(_Failure).decode


def is_failure(data: bytes) -> bool:
    """Whether an event says the stream failed (`{"error": ...}`, as engines and Weir's
    hops end a stream that cannot go on)."""
    return _failure_decode(data).error is not None


# OpenAI chunks.
class Delta(msgspec.Struct):
    content: str | None = None


class Choice(msgspec.Struct):
    delta: Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptDetails | None = None


class SglExt(msgspec.Struct):
    input_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None


class OpenAIChunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[Choice] = []
    usage: Usage | None = None
    sglext: SglExt | None = None
    error: Any = None


openai_chunk = msgspec.json.Decoder(OpenAIChunk).decode
_usage_decode = msgspec.json.Decoder(Usage).decode
_USAGE_KEY = b',"usage":'


def without_usage(data: bytes) -> bytes:
    """An OpenAI chunk's JSON less its `usage`. SGLang and the reference engine write
    `usage` as the chunk's last field (pydantic's order; `sglext`, after it, only when
    asked for), so it is cut from its key on, as `generate_meta` reads: a string's quotes
    are escaped, so the key cannot occur inside the text, and what follows it must decode
    as one usage object. Any other layout is decoded, changed and encoded again."""
    at = data.rfind(_USAGE_KEY)
    if at > 0 and data.endswith(b"}"):
        try:
            _usage_decode(data[at + len(_USAGE_KEY) : -1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            return data[:at] + b"}"
    chunk = msgspec.json.decode(data)
    chunk.pop("usage", None)
    return msgspec.json.encode(chunk)


class _Opening(msgspec.Struct):
    error: Any = None
    meta_info: GenerateMeta | None = None
    choices: list[Choice] = []


_opening_decode = msgspec.json.Decoder(_Opening).decode


def opens_answer(data: bytes) -> bool:
    """Whether a stream's first event begins an answer (its first token, or a chat's role)
    rather than saying it failed or was aborted, in either API."""
    try:
        event = _opening_decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    if event.error is not None:
        return False
    if event.meta_info is not None and event.meta_info.finish_type == "abort":
        return False
    return not (event.choices and event.choices[0].finish_reason == "abort")


class Answer(NamedTuple):
    """A whole (non-streamed) answer's finish type ('' when it names none) and counts."""

    finish: str
    completion_tokens: int
    prompt_tokens: int


def whole_answer(payload: bytes) -> Answer:
    """What a non-streamed `/generate` or OpenAI answer says of its finish and counts
    (nothing, for what is not such an answer)."""
    try:
        body = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return Answer("", 0, 0)
    if not isinstance(body, dict):
        return Answer("", 0, 0)
    meta = body.get("meta_info")
    if isinstance(meta, dict):
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        counts = meta
    else:
        choices = body.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        kind = first.get("finish_reason") if isinstance(first, dict) else None
        usage = body.get("usage")
        counts = usage if isinstance(usage, dict) else {}
    return Answer(
        kind if isinstance(kind, str) else "",
        _count(counts.get("completion_tokens")),
        _count(counts.get("prompt_tokens")),
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def finish_reason(engine_finish: str) -> FinishReason:
    """The Weir finish reason for an engine's (SGLang's) finish type."""
    if engine_finish == "length":
        return FinishReason.LENGTH
    if engine_finish == "abort":
        return FinishReason.ABORTED
    if engine_finish in ("stop", "tool_calls", "content_filter", "eos"):
        return FinishReason.STOP
    return FinishReason.ERROR
