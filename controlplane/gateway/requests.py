"""What the gateway reads from a client request, validated before anything is routed.

Three entry APIs share one shape (`ClientRequest`): SGLang's `/generate` and OpenAI's
`/v1/completions` and `/v1/chat/completions`. Weir's own per-request fields come from
headers or, equivalently, body fields (a header wins when both are given):

| header                | body field          | meaning                                         |
|-----------------------|---------------------|-------------------------------------------------|
| `x-weir-priority`     | `priority`          | integer in [-1000, 1000], higher runs first     |
| `x-weir-deadline-ms`  | `weir_deadline_ms`  | time budget in milliseconds from arrival        |
| `x-weir-tenant`       | —                   | the tenant, on a gateway without API keys, when |
|                       |                     | the pool policy declares it (else 403)          |

Served replies carry `x-weir-endpoint`, the endpoint that served them (the first one, when
a stream was resumed elsewhere). `priority` is SGLang's own field and is forwarded;
`weir_deadline_ms` is removed before the body goes upstream. Prompt tokens are estimated from UTF-8 bytes (`bytes_per_token`; the
reference engine's tokens are bytes) for routing, prefix hashing and the context check:
the router never runs a tokenizer on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from controlplane.contract import Continuation, EngineAPI
from controlplane.contract import headers as wire
from controlplane.gateway.errors import GatewayError, bad_request

PRIORITY_RANGE = (-1000, 1000)
MAX_DEADLINE_MS = 24 * 3600 * 1000
# What an engine generates when the client names no limit (OpenAI's completions default is
# 16, SGLang's /generate default is 128; chat is bounded only by the context).
_DEFAULT_MAX = {EngineAPI.COMPLETIONS: 16, EngineAPI.GENERATE: 128}


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One validated request. `body` is what goes upstream (without `stream`, `rid` and
    Weir's own fields); `prompt_text` is what prefix hashing and token estimates see."""

    api: EngineAPI
    model: str
    body: dict[str, Any]
    stream: bool
    prompt_text: str
    prompt_ids: tuple[int, ...]
    prompt_tokens: int
    max_new_tokens: int
    priority: int
    deadline_s: float
    adapter: str = ""


@dataclass(frozen=True, slots=True)
class Limits:
    """The pool's context length, and how many UTF-8 prompt bytes make a token in the
    router's estimates: 1 for the reference engine (its tokens are bytes), about 4 for
    real tokenizers (`weir router --bytes-per-token`)."""

    context_length: int = 32768
    bytes_per_token: float = 1.0

    def __post_init__(self) -> None:
        if self.context_length < 2 or not 0.5 <= self.bytes_per_token <= 16:
            raise ValueError("context_length must be >= 2 and bytes_per_token in [0.5, 16]")


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request("malformed_json", f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("malformed_json", "the request body must be a JSON object")
    return body


def parse(
    api: EngineAPI,
    body: dict[str, Any],
    headers: Mapping[str, str],
    *,
    models: frozenset[str],
    default_model: str,
    limits: Limits,
) -> ClientRequest:
    """Validate a decoded body; raise `GatewayError` (400, or 404 for an unknown model)."""
    body = dict(body)
    stream = body.pop("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("invalid_stream", "'stream' must be true or false")
    body.pop("rid", None)
    deadline_field = body.pop("weir_deadline_ms", None)

    model = _model(api, body, models, default_model)
    prompt_ids: tuple[int, ...] = ()
    sampling: Mapping[str, Any]
    if api is EngineAPI.GENERATE:
        sampling = _object(body.get("sampling_params", {}), "sampling_params")
        prompt_text, prompt_ids = _generate_prompt(body)
        max_new = _max_tokens(sampling, ("max_new_tokens",), limits, api)
    elif api is EngineAPI.COMPLETIONS:
        sampling = body
        prompt_text = _completion_prompt(body)
        max_new = _max_tokens(body, ("max_tokens",), limits, api)
    else:
        sampling = body
        prompt_text = _chat_prompt(body)
        max_new = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits, api)
    _check_sampling(sampling)

    prompt_tokens = len(prompt_ids) or math.ceil(
        len(prompt_text.encode("utf-8")) / limits.bytes_per_token
    )
    if max_new == 0:  # no explicit limit: whatever the context leaves
        max_new = max(1, limits.context_length - prompt_tokens)
    if prompt_tokens + max_new > limits.context_length:
        raise bad_request(
            "context_length_exceeded",
            f"the prompt (~{prompt_tokens} tokens) plus {max_new} new tokens exceeds the "
            f"context length of {limits.context_length}",
        )
    priority = _priority(headers.get(wire.PRIORITY), body.get("priority"))
    if "priority" in body or priority:
        body["priority"] = priority
    adapter = body.get("lora_path", "")
    if not isinstance(adapter, str):
        raise bad_request("invalid_adapter", "'lora_path' must be a string")
    return ClientRequest(
        api=api,
        model=model,
        body=body,
        stream=stream,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new,
        priority=priority,
        deadline_s=_deadline(headers.get(wire.DEADLINE_MS), deadline_field),
        adapter=adapter,
    )


def resume_body(continuation: Continuation, generated_tokens: int) -> dict[str, Any]:
    """The engine request that resumes `continuation` after the client received
    `generated_tokens` (counted here because OpenAI streams carry text, not token ids)."""
    return continuation.engine_body(max(1, continuation.max_new_tokens - generated_tokens))


def _model(
    api: EngineAPI, body: Mapping[str, Any], models: frozenset[str], default_model: str
) -> str:
    model = body.get("model")
    if model is None and api is EngineAPI.GENERATE:
        return default_model
    if not isinstance(model, str) or not model:
        raise bad_request("missing_model", "'model' must name a served model")
    if model not in models:
        raise GatewayError(
            404,
            "not_found_error",
            "unknown_model",
            f"model {model!r} is not served here; served: {', '.join(sorted(models)) or 'none'}",
        )
    return model


def _object(value: object, name: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("invalid_parameter", f"{name!r} must be an object")
    return value


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("missing_prompt", f"{name!r} must be a non-empty list of token ids")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**31:
            raise bad_request("invalid_prompt", f"{name!r} holds an invalid token id {token!r}")
    return tuple(value)


def _generate_prompt(body: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    if "input_ids" in body:
        return "", _token_ids(body["input_ids"], "input_ids")
    text = body.get("text")
    if not isinstance(text, str) or not text:
        raise bad_request("missing_prompt", "/generate needs a non-empty 'text' or 'input_ids'")
    return text, ()


def _completion_prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request(
            "missing_prompt", "'prompt' must be one non-empty string (batches are not supported)"
        )
    return prompt


def _chat_prompt(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("missing_messages", "'messages' must be a non-empty list")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("invalid_messages", "each message needs a string 'role'")
        parts.append(f"{message['role']}\n{_content_text(message.get('content'))}\n")
    return "".join(parts)


def _content_text(content: object) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    raise bad_request(
        "invalid_messages", "message content must be a string or a list of text parts"
    )


def _max_tokens(
    params: Mapping[str, Any], names: tuple[str, ...], limits: Limits, api: EngineAPI
) -> int:
    """The explicit limit, the API's default, or 0 for 'whatever the context leaves'."""
    for name in names:
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_request("invalid_max_tokens", f"{name!r} must be an integer")
        if not 1 <= value <= limits.context_length:
            raise bad_request(
                "invalid_max_tokens",
                f"{name!r} must be between 1 and the context length {limits.context_length}",
            )
        return value
    return _DEFAULT_MAX.get(api, 0)


def _number(params: Mapping[str, Any], name: str, low: float, high: float) -> None:
    value = params.get(name)
    if value is None:
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise bad_request("invalid_parameter", f"{name!r} must be a number in [{low}, {high}]")


def _check_sampling(params: Mapping[str, Any]) -> None:
    _number(params, "temperature", 0.0, 2.0)
    _number(params, "top_p", 0.0, 1.0)
    _number(params, "presence_penalty", -2.0, 2.0)
    _number(params, "frequency_penalty", -2.0, 2.0)
    n = params.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise bad_request("invalid_parameter", "'n' must be 1 (one choice per request)")


def _priority(header: str | None, field: object) -> int:
    value: object = field
    if header is not None:
        try:
            value = int(header)
        except ValueError:
            raise bad_request("invalid_priority", "x-weir-priority must be an integer") from None
    if value is None:
        return 0
    low, high = PRIORITY_RANGE
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise bad_request("invalid_priority", f"priority must be an integer in [{low}, {high}]")
    return value


def _deadline(header: str | None, field: object) -> float:
    value: object = field
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise bad_request("invalid_deadline", "x-weir-deadline-ms must be a number") from None
    if value is None:
        return 0.0
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 < value <= MAX_DEADLINE_MS
    ):
        raise bad_request(
            "invalid_deadline", f"the deadline must be in (0, {MAX_DEADLINE_MS}] milliseconds"
        )
    return float(value) / 1000.0
