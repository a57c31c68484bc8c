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
from typing import Any

import msgspec

from controlplane.contract import EngineAPI, FinishReason

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
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
    seg_ids: list[int] = field(default_factory=list)
    seg_text: str = ""
    _seg_text_parts: list[str] = field(default_factory=list)

    @property
    def resumed(self) -> bool:
        return self.offset_tokens > 0 or bool(self.prefix_text)

    @property
    def generated(self) -> int:
        return self.offset_tokens + self.seg_tokens

    def generated_ids(self) -> list[int]:
        return self.prefix_ids + self.seg_ids

    def generated_text(self) -> str:
        return self.prefix_text + self._text()

    def _text(self) -> str:
        if self._seg_text_parts:
            self.seg_text += "".join(self._seg_text_parts)
            self._seg_text_parts.clear()
        return self.seg_text

    def next_segment(self) -> None:
        """The current segment ended (preempted): its output becomes the prefix."""
        self.prefix_text = self.generated_text()
        self.prefix_ids = self.generated_ids()
        self.offset_tokens = self.generated
        self.seg_tokens, self.seg_ids, self.seg_text = 0, [], ""

    def read(self, raw: bytes, payload: dict[str, Any]) -> Step:
        if self.api is EngineAPI.GENERATE:
            return self._generate(raw, payload)
        return self._openai(raw, payload)

    def _generate(self, raw: bytes, payload: dict[str, Any]) -> Step:
        meta = payload.get("meta_info")
        if not isinstance(meta, dict):
            return Step(raw, self.generated, "")
        tokens = meta.get("completion_tokens")
        if isinstance(tokens, int) and tokens > self.seg_tokens:
            self.seg_tokens = tokens
        ids = payload.get("output_ids")
        text = payload.get("text")
        if isinstance(ids, list):
            if self.incremental_text:
                self.seg_ids.extend(ids)
            else:
                self.seg_ids = ids
        if isinstance(text, str):
            if self.incremental_text:
                self._seg_text_parts.append(text)
            else:
                self.seg_text = text
        if not self.client_id:
            self.client_id = str(meta.get("id") or "")
        finish = meta.get("finish_reason")
        kind = str(finish.get("type", "")) if isinstance(finish, dict) else ""
        prompt = meta.get("prompt_tokens")
        prompt_tokens = prompt if isinstance(prompt, int) and not self.resumed else 0
        if not self.resumed or kind == "abort":
            return Step(raw, self.generated, kind, prompt_tokens)
        # Resumed: the client expects one cumulative stream.
        out = dict(payload)
        if not self.incremental_text:
            if isinstance(text, str):
                out["text"] = self.prefix_text + text
            if isinstance(ids, list):
                out["output_ids"] = self.prefix_ids + ids
        new_meta = dict(meta)
        new_meta["completion_tokens"] = self.generated
        if kind == "length" and isinstance(finish, dict):
            new_meta["finish_reason"] = {**finish, "length": self.generated}
        if self.prompt_tokens:
            new_meta["prompt_tokens"] = self.prompt_tokens
        if self.client_id:
            new_meta["id"] = self.client_id
        out["meta_info"] = new_meta
        return Step(b"data: " + _encode(out) + b"\n\n", self.generated, kind)

    def _openai(self, raw: bytes, payload: dict[str, Any]) -> Step:
        choices = payload.get("choices")
        usage = payload.get("usage")
        finish = ""
        content = ""
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            if self.api is EngineAPI.CHAT:
                delta = choice.get("delta")
                content = (delta.get("content") or "") if isinstance(delta, dict) else ""
            else:
                content = choice.get("text") or ""
            finish = str(choice.get("finish_reason") or "")
            if not isinstance(content, str):
                content = ""
        counted = False
        if isinstance(usage, dict):
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int) and tokens >= self.seg_tokens:
                self.seg_tokens, counted = tokens, True
        if content:
            self._seg_text_parts.append(content)
            if not counted:
                self.seg_tokens += 1
        if not choices and not self.client_usage:
            return Step(None, self.generated, finish)  # usage the sidecar asked for
        if not self.resumed:
            return Step(raw, self.generated, finish)
        if not content and not finish and not isinstance(usage, dict):
            return Step(None, self.generated, "")  # the resumed segment's role chunk
        if isinstance(usage, dict) and not choices:
            out = dict(payload)
            new_usage = dict(usage)
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
