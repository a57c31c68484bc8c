"""Reading an SGLang `/generate` stream event for its counts, not its output.

A `/generate` event is cumulative: it carries the whole text and every output token id
so far, so decoding each event whole costs time that grows with the output, per event
(half a millisecond at 4,000 tokens). A relay needs the counts on every event and the
output only when a request resumes. SGLang writes `meta_info` last, after the text and
ids, so `generate_meta` decodes it from its key on: a string's quotes are escaped, so the
key cannot occur inside the text. Anything else falls back to a full typed decode that
still skips the text and ids.
"""

from __future__ import annotations

from typing import Any

import msgspec


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
