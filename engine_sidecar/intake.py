"""Checking a client's request before anything is admitted or reserved.

Each entry API (`/generate`, `/v1/completions`, `/v1/chat/completions`) is validated into
one `Intake`: the body the engine will get, the prompt size admission charges, the output
limit, and whether the request can be preempted and resumed. Anything malformed, hostile
or beyond the context raises `RequestError` with the HTTP status to answer; nothing has been
reserved at that point, so nothing leaks.

The prompt size is exact for token ids and otherwise an upper bound — the UTF-8 byte
length: no tokenizer produces more tokens than bytes, and over-counting fails closed.
The engine's own count replaces it as soon as a stream reports one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from controlplane.contract import Continuation, EngineAPI

_decode_json = msgspec.json.Decoder().decode

# What the engine's path is for each entry API.
ENGINE_PATH = {
    EngineAPI.GENERATE: "/generate",
    EngineAPI.COMPLETIONS: "/v1/completions",
    EngineAPI.CHAT: "/v1/chat/completions",
}

# Per-request fields a sidecar sets itself; a client's values are dropped.
_SIDECAR_FIELDS = ("rid", "stream")

MAX_PRIORITY = 1_000_000


class RequestError(ValueError):
    """A request the sidecar refuses before admission, with the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Intake:
    api: EngineAPI
    body: dict[str, Any]  # as the engine will get it, without `rid` and `stream`
    model: str
    stream: bool
    prompt_tokens: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    priority: int
    recomputable: bool  # the prompt can be extended with what was generated


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = _decode_json(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _count(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        else:
            raise RequestError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _number(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


def _text_tokens(text: str) -> int:
    return len(text.encode("utf-8"))


def _ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a non-empty list of token ids")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise RequestError(f"{name} must hold non-negative integer token ids")
    return tuple(value)


def _message_tokens(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    total = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("each message must be an object with a string role")
        content = message.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise RequestError("message content parts must be objects")
                text = part.get("text")
                if isinstance(text, str):
                    total += _text_tokens(text)
        elif content is not None:
            raise RequestError("message content must be a string, a list of parts or null")
        total += 8  # role and template tokens
    return total


@dataclass(frozen=True, slots=True)
class Limits:
    """What this endpoint can serve."""

    model: str
    context_length: int
    default_max_tokens: int = 256


def parse(api: EngineAPI, body: dict[str, Any], limits: Limits) -> Intake:
    """Validate a client body for `api`; raises RequestError."""
    body = {k: v for k, v in body.items() if k not in _SIDECAR_FIELDS} | {
        "stream": body.get("stream", False)
    }
    stream = body.pop("stream")
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}")
    prompt_ids: tuple[int, ...] = ()
    recomputable = True
    if api is EngineAPI.GENERATE:
        model = limits.model
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        if "input_ids" in body:
            prompt_ids = _ids("input_ids", body["input_ids"])
            prompt, exact = len(prompt_ids), True
        elif isinstance(body.get("text"), str) and body["text"]:
            prompt, exact = _text_tokens(body["text"]), False
        else:
            raise RequestError(
                "generate needs a non-empty text or input_ids (batches are not served)"
            )
        max_new = params.get("max_new_tokens", limits.default_max_tokens)
        for name in ("temperature", "top_p"):
            if name in params:
                _number(f"sampling_params.{name}", params[name], 0.0, 100.0)
    else:
        model_field = body.get("model")
        if not isinstance(model_field, str) or not model_field:
            raise RequestError("model is required")
        if model_field != limits.model:
            raise RequestError(
                f"model {model_field!r} is not served here (this endpoint serves {limits.model!r})",
                status=404,
                kind="model_not_found",
            )
        model = model_field
        if api is EngineAPI.CHAT:
            prompt, exact = _message_tokens(body.get("messages")), False
            max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            raw_prompt = body.get("prompt")
            if isinstance(raw_prompt, str) and raw_prompt:
                prompt, exact = _text_tokens(raw_prompt), False
            elif (
                isinstance(raw_prompt, list)
                and raw_prompt
                and all(isinstance(t, int) for t in raw_prompt)
            ):
                prompt_ids = _ids("prompt", raw_prompt)
                prompt, exact, recomputable = len(prompt_ids), True, False
            else:
                raise RequestError("prompt must be a non-empty string or list of token ids")
            max_new = body.get("max_tokens")
        if max_new is None:
            max_new = limits.default_max_tokens
        if _count("n", body.get("n", 1), 1, 1) != 1:
            raise RequestError("n must be 1")
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                _number(name, body[name], 0.0, 100.0)
    max_new_tokens = _count("max_tokens", max_new, 1, limits.context_length)
    if exact and prompt + max_new_tokens > limits.context_length:
        raise RequestError(
            f"prompt ({prompt} tokens) plus max_tokens ({max_new_tokens}) exceeds the context "
            f"length {limits.context_length}"
        )
    priority = _count("priority", body.get("priority", 0), -MAX_PRIORITY, MAX_PRIORITY)
    body.pop("priority", None)
    return Intake(
        api=api,
        body=body,
        model=model,
        stream=stream,
        prompt_tokens=prompt,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        priority=priority,
        recomputable=recomputable,
    )


def from_continuation(cont: Continuation, limits: Limits) -> Intake:
    """The intake for a continuation arriving at `/weir/v1/continue`. Raises RequestError."""
    if cont.model != limits.model:
        raise RequestError(
            f"model {cont.model!r} is not served here", status=404, kind="model_not_found"
        )
    if cont.remaining_tokens <= 0:
        raise RequestError("the continuation has no tokens left to generate")
    base = parse(cont.api, dict(cont.body) | {"stream": True}, limits)
    extra = len(cont.generated_ids) or _text_tokens(cont.generated_text)
    return Intake(
        api=base.api,
        body=cont.engine_body(),
        model=base.model,
        stream=True,
        prompt_tokens=base.prompt_tokens + extra,
        prompt_ids=cont.prompt_ids + cont.generated_ids,
        max_new_tokens=cont.remaining_tokens,
        priority=cont.priority,
        recomputable=base.recomputable,
    )
