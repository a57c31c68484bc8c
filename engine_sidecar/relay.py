"""Reading an engine's stream for one request: token counting and splicing segments.

A request's output may come from several engine requests ("segments"): the first, and one
more after each in-place recompute; a continuation arriving at `/weir/v1/continue` starts
with an offset. `StreamReader` reads each segment's events for one entry API, reports the
generated-token total, the finish, what the client has received (text, and the token ids
where the engine said them), and rewrites an event only where the client would otherwise
see a seam or something it did not ask for:

- `/generate` streams carry cumulative text; SGLang 0.5.23 sends cumulative `output_ids`,
  0.5.5 the ids of each event alone (`ids_delta`). A resumed segment's events get the
  earlier output prepended (ids only where they are cumulative) and the first segment's
  id, prompt and cached-token counts.
- OpenAI streams are deltas. To resume a request token for token the sidecar asks the
  engine for ids the client did not ask for: `return_token_ids` on completions (ids in
  every chunk, and the prompt's in the first), `return_{input,output}_ids_in_sglext` on
  chat (one `sglext` chunk after the last, also after an abort); and, where no ids come,
  `continuous_usage_stats` (a token count in every chunk). All of it is taken out of what
  the client receives unless it asked for it. A segment resumed from ids is served by
  the completions API (`engine_api`): for a chat client its chunks are rewritten into
  chat chunks, with the first segment's id and timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _SglExt(msgspec.Struct):
    input_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None


class _OpenAIEvent(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[_Choice] = []
    usage: _Usage | None = None
    sglext: _SglExt | None = None


_openai_decode = msgspec.json.Decoder(_OpenAIEvent).decode
# Chat chunk fields a completions chunk has no counterpart for, or names differently.
_COMPLETION_ONLY = ("text", "token_ids", "prompt_token_ids")


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
    # Whether /generate events carry their own ids only (SGLang 0.5.5) rather than every
    # id so far (0.5.23); None: not known yet, learnt from this stream's events.
    ids_delta: bool | None = None
    # The current segment's engine API, when it is not the client's (a chat request
    # resumed from token ids is served by the completions API).
    engine_api: EngineAPI | None = None
    # Output before the current segment (a resumed or continued request).
    offset_tokens: int = 0
    prefix_ids: list[int] = field(default_factory=list)
    prefix_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the engine saw it
    # What the client saw of the first segment and asked for.
    client_id: str = ""
    client_created: int = 0
    client_usage: bool = True  # the usage chunk (OpenAI stream_options.include_usage)
    client_chunk_usage: bool = False  # usage in every chunk (continuous_usage_stats)
    client_token_ids: bool = False  # return_token_ids
    client_sglext: bool = False  # return_*_ids_in_sglext
    prompt_tokens: int = 0  # the first segment's prompt, reported on resumed segments
    cached_tokens: int | None = None  # the first segment's prefix-cache hit, likewise
    # Within the current segment.
    seg_tokens: int = 0
    _last_data: bytes = b""  # the latest cumulative /generate event
    _seg_ids: list[int] = field(default_factory=list)  # where ids come piecewise
    _seg_text_parts: list[str] = field(default_factory=list)
    # (tokens, text appended, ids held) before the last event
    _undo: tuple[int, bool, int] = (0, False, 0)
    _preempted: bool = False  # the segment's abort was read: only its ids may follow

    @property
    def resumed(self) -> bool:
        return self.offset_tokens > 0 or bool(self.prefix_text)

    @property
    def skims(self) -> bool:
        """Events before the last of a read may be forwarded unread: in a fresh cumulative
        /generate stream the latest event says all the earlier ones did (the finish comes
        only in the stream's last event)."""
        return (
            self.api is EngineAPI.GENERATE
            and self.ids_delta is False
            and not self.incremental_text
            and not self.resumed
        )

    @property
    def generated(self) -> int:
        return self.offset_tokens + self.seg_tokens

    @property
    def _piecewise_ids(self) -> bool:
        return self.api is not EngineAPI.GENERATE or self.incremental_text or bool(self.ids_delta)

    def _cumulative(self) -> tuple[list[int], str]:
        """The current segment's ids and text from its latest /generate event."""
        if not self._last_data:
            return [], ""
        body = _decode_any(self._last_data)
        ids, text = body.get("output_ids"), body.get("text")
        return (ids if isinstance(ids, list) else []), (text if isinstance(text, str) else "")

    def generated_ids(self) -> list[int]:
        """Every token id the client has received, as far as the engine said them."""
        ids = self._seg_ids if self._piecewise_ids else self._cumulative()[0]
        return self.prefix_ids + ids

    def generated_text(self) -> str:
        if self.api is EngineAPI.GENERATE and not self.incremental_text:
            return self.prefix_text + self._cumulative()[1]
        return self.prefix_text + "".join(self._seg_text_parts)

    def next_segment(self, engine_api: EngineAPI | None = None) -> None:
        """The current segment ended (preempted): its output becomes the prefix. The next
        segment is served by `engine_api` (default: the client's API)."""
        self.prefix_text = self.generated_text()
        self.prefix_ids = self.generated_ids()
        self.offset_tokens = self.generated
        self.seg_tokens, self._last_data = 0, b""
        self._seg_ids, self._seg_text_parts = [], []
        self.engine_api = engine_api if engine_api is not self.api else None
        self._preempted = False

    def forget_last(self) -> None:
        """The last event will not reach the client (the abort that ends a preempted
        segment): its output must not count, or a delta stream would lose it. A
        cumulative /generate stream carries it into the next segment anyway."""
        self._preempted = True
        if self.api is EngineAPI.GENERATE:
            return
        tokens, appended, ids = self._undo
        self.seg_tokens = tokens
        if appended:
            self._seg_text_parts.pop()
        del self._seg_ids[ids:]
        self._undo = (tokens, False, ids)

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
        if not self.resumed and meta.cached_tokens is not None:
            self.cached_tokens = meta.cached_tokens
        body: dict[str, Any] | None = None
        if self.incremental_text or self.ids_delta is not False:
            body = _decode_any(data)
            ids = body.get("output_ids") or []
            if self.ids_delta is None and (meta.completion_tokens or 0) >= 2:
                self.ids_delta = len(ids) < (meta.completion_tokens or 0)
            self._seg_ids.extend(ids)
            if self.incremental_text:
                self._seg_text_parts.append(body.get("text") or "")
        if not self.incremental_text:
            self._last_data = data
        finish = meta.finish_reason
        kind = meta.finish_type
        if not self.resumed or kind == "abort":
            prompt = 0 if self.resumed else (meta.prompt_tokens or 0)
            return Step(raw, self.generated, kind, prompt)
        # Resumed: the client expects one cumulative stream.
        out = body if body is not None else _decode_any(data)
        if not self.incremental_text:
            out["text"] = self.prefix_text + str(out.get("text") or "")
            if self.ids_delta is False and isinstance(out.get("output_ids"), list):
                out["output_ids"] = self.prefix_ids + out["output_ids"]
        new_meta = dict(out["meta_info"])
        new_meta["completion_tokens"] = self.generated
        if kind == "length" and finish:
            new_meta["finish_reason"] = {**finish, "length": self.generated}
        if self.prompt_tokens:
            new_meta["prompt_tokens"] = self.prompt_tokens
        if self.cached_tokens is not None and "cached_tokens" in new_meta:
            new_meta["cached_tokens"] = self.cached_tokens
        if self.client_id:
            new_meta["id"] = self.client_id
        out["meta_info"] = new_meta
        return Step(b"data: " + _encode(out) + b"\n\n", self.generated, kind)

    def _openai(self, raw: bytes, data: bytes) -> Step:
        event = _openai_decode(data)
        if self._preempted:  # after the abort, only the ids of what the client has count
            if event.sglext is not None:
                self._take_sglext(event.sglext)
            return Step(None, self.generated, "")
        choice = event.choices[0] if event.choices else None
        content = finish = ""
        if choice is not None:
            content = (choice.delta.content or "") if choice.delta else (choice.text or "")
            finish = choice.finish_reason or ""
        self._undo = (self.seg_tokens, bool(content), len(self._seg_ids))
        usage = event.usage
        if not self.resumed:
            if not self.client_id:
                self.client_id, self.client_created = event.id, event.created
            if usage is not None and usage.prompt_tokens and not self.prompt_tokens:
                self.prompt_tokens = usage.prompt_tokens  # what a resumed usage reports
            details = usage.prompt_tokens_details if usage is not None else None
            if details is not None and details.cached_tokens is not None:
                self.cached_tokens = details.cached_tokens
        if choice is not None and choice.token_ids is not None:
            self._seg_ids.extend(choice.token_ids)
            self.seg_tokens = len(self._seg_ids)
            if choice.prompt_token_ids and not self.prompt_ids:
                self.prompt_ids = list(choice.prompt_token_ids)
        elif usage is not None and usage.completion_tokens >= self.seg_tokens:
            self.seg_tokens = usage.completion_tokens
        elif content:
            self.seg_tokens += 1
        if content:
            self._seg_text_parts.append(content)
        if choice is None and event.sglext is not None:  # chat's ids, after the last chunk
            self._take_sglext(event.sglext)
            return Step(raw if self.client_sglext else None, self.generated, finish)
        if choice is None and not self.client_usage:
            return Step(None, self.generated, finish)  # usage the sidecar asked for
        if not self.resumed:
            if not self._strips(choice, usage):
                return Step(raw, self.generated, finish)
        elif choice is not None and not content and not finish:
            return Step(None, self.generated, "")  # the resumed segment's role chunk
        return Step(self._rewrite(data, choice), self.generated, finish)

    def _take_sglext(self, ext: _SglExt) -> None:
        if ext.output_ids:
            # Only what the client received: an abort's last tokens were forgotten.
            self._seg_ids = list(ext.output_ids[0][: self.seg_tokens])
        if ext.input_ids and not self.prompt_ids:
            self.prompt_ids = list(ext.input_ids)

    def _strips(self, choice: _Choice | None, usage: _Usage | None) -> bool:
        """Whether an event carries something the sidecar asked for and the client not."""
        if choice is not None and (choice.token_ids is not None or choice.prompt_token_ids):
            return not self.client_token_ids
        return choice is not None and usage is not None and not self.client_chunk_usage

    def _rewrite(self, data: bytes, choice: _Choice | None) -> bytes:
        out = _decode_any(data)
        if self.engine_api is EngineAPI.COMPLETIONS and self.api is EngineAPI.CHAT:
            out = self._as_chat(out)
        for item in out.get("choices") or ():
            if not self.client_token_ids:
                item.pop("token_ids", None)
                item.pop("prompt_token_ids", None)
        usage = out.get("usage")
        if isinstance(usage, dict):
            if choice is not None and not self.client_chunk_usage:
                out.pop("usage")
            elif self.resumed:
                out["usage"] = self._usage(usage)
        if self.resumed and self.client_id:
            out["id"] = self.client_id
        if self.resumed and self.client_created and "created" in out:
            out["created"] = self.client_created
        return b"data: " + _encode(out) + b"\n\n"

    @staticmethod
    def _as_chat(completion: dict[str, Any]) -> dict[str, Any]:
        """A completions chunk as a chat chunk: SGLang's two differ only in `object` and in
        a choice's `text`, which is a chat choice's `delta.content`."""
        chunk = {**completion, "object": "chat.completion.chunk"}
        choices = []
        for item in completion.get("choices") or ():
            shaped = {k: v for k, v in item.items() if k not in _COMPLETION_ONLY}
            shaped["delta"] = {"content": item.get("text") or ""}
            choices.append(shaped)
        chunk["choices"] = choices
        return chunk

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage counted over the whole request, as the uninterrupted run reports it."""
        new = dict(usage)
        new["completion_tokens"] = self.generated
        if self.prompt_tokens:
            new["prompt_tokens"] = self.prompt_tokens
            new["total_tokens"] = self.prompt_tokens + self.generated
        details = new.get("prompt_tokens_details")
        if self.cached_tokens is not None and isinstance(details, dict):
            new["prompt_tokens_details"] = {**details, "cached_tokens": self.cached_tokens}
        return new


def finish_reason(engine_finish: str) -> FinishReason:
    """The Weir finish reason for an engine's (SGLang's) finish type."""
    if engine_finish == "length":
        return FinishReason.LENGTH
    if engine_finish == "abort":
        return FinishReason.ABORTED
    if engine_finish in ("stop", "tool_calls", "content_filter", "eos"):
        return FinishReason.STOP
    return FinishReason.ERROR
