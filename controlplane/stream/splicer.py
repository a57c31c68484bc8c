"""One request's stream as its client receives it, across the engine requests that make it.

A request's output may come from several engine requests ("segments"): the first, and one
more after each resume (in place at the sidecar, or elsewhere through the router); a
continuation arriving at a sidecar's `/weir/v1/continue` starts with an offset. The
router and the sidecar read every segment with a `Splicer`, for one entry API: it counts
the tokens the client has received, keeps the finish, what the client holds (text, and
token ids where the engine said them), and rewrites an event only where the client would
otherwise see a seam or something it did not ask for.

Tokens are counted from the engine's own counts, by one rule: a `/generate` event's
`meta_info.completion_tokens`; an OpenAI chunk's token ids where the engine sends them,
else its `usage.completion_tokens`. Every hop asks its upstream for those
(`ask_for_counts`): `continuous_usage_stats` puts a usage in every OpenAI chunk, and
SGLang 0.5.23 says ids (`return_token_ids` on completions; `return_{input,output}_ids_in_
sglext` on chat, in one chunk after the last, also after an abort). What the client did
not ask for is taken out of what it receives (`Asks`).

- `/generate` streams carry cumulative text; SGLang 0.5.23 sends cumulative `output_ids`,
  0.5.5 the ids of each event alone (`ids_delta`, learnt from the stream). A resumed
  segment's events get the earlier output prepended (ids only where they are cumulative)
  and the first segment's id, prompt and cached-token counts.
- OpenAI streams are deltas. A resumed segment's chunks get the first segment's id and
  timestamp, usage counted over the whole request, and no second role announcement. A
  segment resumed from ids is served by the completions API (`engine_api`): for a chat
  client its chunks are rewritten into chat chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from controlplane.contract import EngineAPI
from controlplane.stream.events import (
    Choice,
    SglExt,
    Usage,
    generate_meta,
    is_failure,
    openai_chunk,
    whole_answer,
    without_usage,
)

_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode
# Chat chunk fields a completions chunk has no counterpart for, or names differently.
_COMPLETION_ONLY = ("text", "token_ids", "prompt_token_ids")


class MalformedEventError(ValueError):
    """The upstream sent a stream event that cannot be read."""


@dataclass(frozen=True, slots=True)
class Asks:
    """What the client asked to see of the counts and ids a hop asks its upstream for."""

    usage: bool = True  # the usage chunk (OpenAI stream_options.include_usage)
    chunk_usage: bool = False  # usage in every chunk (continuous_usage_stats)
    token_ids: bool = False  # return_token_ids
    sglext: bool = False  # return_*_ids_in_sglext

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Asks:
        """What a client's request body asks for."""
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        return cls(
            usage=options.get("include_usage") is True,
            chunk_usage=options.get("continuous_usage_stats") is True,
            token_ids=body.get("return_token_ids") is True,
            sglext=any(
                body.get(key) is True
                for key in ("return_input_ids_in_sglext", "return_output_ids_in_sglext")
            ),
        )


def ask_for_counts(api: EngineAPI, body: dict[str, Any], *, token_ids: bool) -> None:
    """Ask the upstream of a streamed OpenAI request for its counts: a token count in
    every chunk, and with `token_ids` (an engine that says them: SGLang 0.5.23) the ids,
    from which a request resumes token for token. A `/generate` stream says both."""
    if api is EngineAPI.GENERATE:
        return
    options = body.get("stream_options")
    asked = dict(options) if isinstance(options, dict) else {}
    body["stream_options"] = asked | {"include_usage": True, "continuous_usage_stats": True}
    if not token_ids:
        return
    if api is EngineAPI.COMPLETIONS:
        body["return_token_ids"] = True  # in every chunk, and the prompt's in the first
    else:  # chat: in one chunk after the last
        body["return_input_ids_in_sglext"] = body["return_output_ids_in_sglext"] = True


@dataclass(slots=True)
class Splicer:
    """One streamed request's output as its client receives it (see the module's
    docstring): `read` each upstream event, `next_segment` when a resume starts another
    engine request."""

    api: EngineAPI  # the client's
    asks: Asks = Asks()
    incremental_text: bool = False  # SGLang's --incremental-streaming-output
    # Whether /generate events carry their own ids only (SGLang 0.5.5) rather than every
    # id so far (0.5.23); None: not known yet, learnt from the events (a hop keeps what
    # it learnt for its next streams).
    ids_delta: bool | None = None
    # The current segment's engine API, when it is not the client's (a chat request
    # resumed from token ids is served by the completions API).
    engine_api: EngineAPI | None = None
    # Output before the current segment (a resumed or continued request).
    offset_tokens: int = 0
    prefix_ids: list[int] = field(default_factory=list)
    prefix_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the engine saw it
    # What the client saw of the first segment: its id and timestamp, its prompt's size
    # (the caller's estimate until the engine says it) and prefix-cache hit, reported
    # again on resumed segments.
    client_id: str = ""
    client_created: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    engine_prompt_tokens: int = 0  # the prompt's size as the first segment's engine said
    # Within the current segment.
    seg_tokens: int = 0
    finish: str = ""  # the engine's finish type ('' while running; 'abort' for an abort)
    failed: bool = False  # an event said the stream failed (`{"error": ...}`)
    _last_data: bytes = b""  # the latest cumulative /generate event
    _seg_ids: list[int] = field(default_factory=list)  # where ids come piecewise
    _seg_text_parts: list[str] = field(default_factory=list)
    # (tokens, text appended, ids held) before the last event
    _undo: tuple[int, bool, int] = (0, False, 0)
    _preempted: bool = False  # the segment's abort was read: only its ids may follow
    # A segment after the first (of this hop's, or a continuation's): its events continue
    # the client's stream.
    resumed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.resumed = self.offset_tokens > 0 or bool(self.prefix_text)

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
        """Tokens the client has received."""
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

    def exact_ids(self) -> list[int]:
        """Every token id the client has received, when the engine said them all (a
        resume from them is token for token); else none."""
        ids = self.generated_ids()
        return ids if ids and len(ids) == self.generated else []

    def generated_text(self) -> str:
        if self.api is EngineAPI.GENERATE and not self.incremental_text:
            return self.prefix_text + self._cumulative()[1]
        return self.prefix_text + "".join(self._seg_text_parts)

    def next_segment(self, engine_api: EngineAPI | None = None) -> None:
        """The current segment ended: its output becomes the prefix of the next, which
        `engine_api` serves (default: the client's API)."""
        self.prefix_text = self.generated_text()
        self.prefix_ids = self.generated_ids()
        self.offset_tokens = self.generated
        self.seg_tokens, self._last_data, self.finish, self.failed = 0, b"", "", False
        self._seg_ids, self._seg_text_parts = [], []
        self.engine_api = engine_api if engine_api is not self.api else None
        self._preempted = False
        self.resumed = True

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

    def read(self, raw: bytes, data: bytes) -> bytes | None:
        """One event: `raw` is the SSE frame as received, `data` its JSON. Returns the
        frame to forward (`raw` itself when unchanged), or None to drop it."""
        try:
            if self.api is EngineAPI.GENERATE:
                return self._generate(raw, data)
            return self._openai(raw, data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedEventError(f"unreadable stream event {data[:200]!r}: {exc}") from exc

    def take_answer(self, payload: bytes) -> str:
        """A whole (non-streamed) answer instead of a stream: its counts, as a segment's;
        returns its finish type ('' when it names none)."""
        answer = whole_answer(payload)
        self.seg_tokens = answer.completion_tokens
        if answer.prompt_tokens and not self.resumed:
            self.prompt_tokens = self.engine_prompt_tokens = answer.prompt_tokens
        self.finish = answer.finish
        return answer.finish

    def _generate(self, raw: bytes, data: bytes) -> bytes | None:
        meta = generate_meta(data)
        if meta is None:  # not output: an engine's error event, say
            self.failed = self.failed or is_failure(data)
            return raw
        completion = meta.completion_tokens
        if completion is not None and completion > self.seg_tokens:
            self.seg_tokens = completion
        resumed = self.resumed
        if not resumed and not self.engine_prompt_tokens:  # what the first events say
            self.client_id = self.client_id or meta.id
            if meta.cached_tokens is not None:
                self.cached_tokens = meta.cached_tokens
            if meta.prompt_tokens:
                self.prompt_tokens = self.engine_prompt_tokens = meta.prompt_tokens
        body: dict[str, Any] | None = None
        if self.incremental_text or self.ids_delta is not False or completion is None:
            body = _decode_any(data)
            ids = body.get("output_ids") or []
            if self.ids_delta is None and (completion or 0) >= 2:
                self.ids_delta = len(ids) < (completion or 0)
            self._seg_ids.extend(ids)
            if self.incremental_text:
                self._seg_text_parts.append(body.get("text") or "")
            elif completion is None and not self.ids_delta:
                # An engine that left the count out: its cumulative ids count.
                self.seg_tokens = max(self.seg_tokens, len(ids))
        if not self.incremental_text:
            self._last_data = data
        kind = meta.finish_type if meta.finish_reason else ""
        if kind:
            self.finish = kind
        if not resumed or kind == "abort":
            return raw
        # Resumed: the client expects one cumulative stream.
        out = body if body is not None else _decode_any(data)
        if not self.incremental_text:
            out["text"] = self.prefix_text + str(out.get("text") or "")
            if self.ids_delta is False and isinstance(out.get("output_ids"), list):
                out["output_ids"] = self.prefix_ids + out["output_ids"]
        new_meta = dict(out["meta_info"])
        new_meta["completion_tokens"] = self.generated
        if kind == "length" and meta.finish_reason:
            new_meta["finish_reason"] = {**meta.finish_reason, "length": self.generated}
        if self.prompt_tokens:
            new_meta["prompt_tokens"] = self.prompt_tokens
        if self.cached_tokens is not None and "cached_tokens" in new_meta:
            new_meta["cached_tokens"] = self.cached_tokens
        if self.client_id:
            new_meta["id"] = self.client_id
        out["meta_info"] = new_meta
        return b"data: " + _encode(out) + b"\n\n"

    def _openai(self, raw: bytes, data: bytes) -> bytes | None:
        event = openai_chunk(data)
        if self._preempted:  # after the abort, only the ids of what the client has count
            if event.sglext is not None:
                self._take_sglext(event.sglext)
            return None
        if event.error is not None:
            self.failed = True
            return raw
        choice = event.choices[0] if event.choices else None
        content = finish = ""
        if choice is not None:
            delta = choice.delta
            content = (delta.content or "") if delta is not None else (choice.text or "")
            finish = choice.finish_reason or ""
            if finish:
                self.finish = finish
        self._undo = (self.seg_tokens, bool(content), len(self._seg_ids))
        usage = event.usage
        resumed = self.resumed
        if not resumed:
            if not self.client_id:
                self.client_id, self.client_created = event.id, event.created
            if usage is not None and not self.engine_prompt_tokens:  # said once, first
                self._first_usage(usage)
        token_ids = choice.token_ids if choice is not None else None
        if token_ids is not None:
            self._seg_ids.extend(token_ids)
            self.seg_tokens = len(self._seg_ids)
            if choice is not None and choice.prompt_token_ids and not self.prompt_ids:
                self.prompt_ids = list(choice.prompt_token_ids)
        elif usage is not None and usage.completion_tokens >= self.seg_tokens:
            self.seg_tokens = usage.completion_tokens
        elif content:
            # An upstream that says no count (it ignored continuous_usage_stats): a chunk
            # per decode step, one token each, is the closest count there is; the usage
            # chunk after the last, where it comes, corrects it.
            self.seg_tokens += 1
        if content:
            self._seg_text_parts.append(content)
        if choice is None:
            if event.sglext is not None:  # chat's ids, after the last chunk
                self._take_sglext(event.sglext)
                return raw if self.asks.sglext else None
            if not self.asks.usage:  # the usage chunk after the last
                return None
            if not resumed:
                return raw
        elif not resumed:
            # Fresh: forwarded as it came unless it carries what the client did not ask for.
            if token_ids is not None or choice.prompt_token_ids:
                if self.asks.token_ids and (usage is None or self.asks.chunk_usage):
                    return raw
            elif usage is None or self.asks.chunk_usage:
                return raw
            elif self.engine_api is None:
                return b"data: %b\n\n" % without_usage(data)
        elif not content and not finish:
            return None  # the resumed segment's role chunk: the client had it
        return self._rewrite(data, choice)

    def _first_usage(self, usage: Usage) -> None:
        """The prompt's size and prefix-cache hit, from the first segment's usage."""
        if usage.prompt_tokens:
            self.prompt_tokens = self.engine_prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            self.cached_tokens = details.cached_tokens

    def _take_sglext(self, ext: SglExt) -> None:
        if ext.output_ids:
            # Only what the client received: an abort's last tokens were forgotten.
            self._seg_ids = list(ext.output_ids[0][: self.seg_tokens])
        if ext.input_ids and not self.prompt_ids:
            self.prompt_ids = list(ext.input_ids)

    def _rewrite(self, data: bytes, choice: Choice | None) -> bytes:
        out = _decode_any(data)
        if self.engine_api is EngineAPI.COMPLETIONS and self.api is EngineAPI.CHAT:
            out = self._as_chat(out)
        for item in out.get("choices") or ():
            if not self.asks.token_ids:
                item.pop("token_ids", None)
                item.pop("prompt_token_ids", None)
        usage = out.get("usage")
        if isinstance(usage, dict):
            if choice is not None and not self.asks.chunk_usage:
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
