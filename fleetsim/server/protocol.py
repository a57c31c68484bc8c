"""Request bodies of SGLang's native and OpenAI-compatible APIs, parsed into one shape.

Parsing is strict about what the engine needs (a prompt, sane token counts, the right
types) and lenient about what it does not use (temperature, top_p, logprobs…), as SGLang
is. Every refusal is a `BadRequestError` with SGLang's wording where SGLang has one.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleetsim.engine import chat_template
from fleetsim.engine.tokens import encode


class BadRequestError(ValueError):
    """The client's fault, answered 400. `schema` marks what SGLang's FastAPI layer
    refuses before its handler runs (malformed JSON, wrong types, missing fields), which
    it answers in its validation-error shape; the rest are its handlers' ValueErrors."""

    def __init__(self, message: str, *, schema: bool = False) -> None:
        super().__init__(message)
        self.schema = schema


# SGLang's FAKE_BOOTSTRAP_HOST: a P/D engine serves a request naming it alone, with no
# peer and no transfer (its warmup and health checks use it).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# --disaggregation-bootstrap-port's default, for a request that names no port.
DEFAULT_BOOTSTRAP_PORT = 8998
_MAX_ROOM = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The P/D fields a router adds to both halves of one request (SGLang's
    `PDRoutingFields`): the prefill engine's host and bootstrap port, and the room that
    names this handoff on both sides."""

    host: str
    port: int
    room: int

    @property
    def fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST


@dataclass(slots=True)
class GenerateSpec:
    """One generation as the engine sees it, whichever API it came through."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int | None
    stream: bool = False
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    priority: int | None = None
    cache_salt: str = ""
    include_usage: bool = False
    continuous_usage: bool = False
    model: str = ""
    bootstrap: Bootstrap | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise BadRequestError("Field required: the request body is empty.", schema=True)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"JSON decode error (json_invalid): {exc}", schema=True) from None
    except RecursionError:  # msgspec's guard against a stack overflow
        raise BadRequestError(
            "JSON decode error (json_invalid): nested too deeply", schema=True
        ) from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.", schema=True)
    return body


def _int(
    body: Mapping[str, Any], key: str, default: int | None, *, lo: int | None = None
) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"{key} must be an integer, got {type(value).__name__}.", schema=True)
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise BadRequestError(f"{key} must be an integer, got {value}.", schema=True)
        value = int(value)
    if lo is not None and value < lo:
        raise BadRequestError(f"{key} must be at least {lo}, got {value}.")
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"{key} must be a boolean.", schema=True)
    return value


def _stops(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise BadRequestError("stop must be a string or a list of strings.", schema=True)


def _token_ids(value: object, key: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadRequestError(f"{key} must be a list of integer token ids.", schema=True)
    return list(value)


def _rid(body: Mapping[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise BadRequestError("rid must be a non-empty string (batches are not supported).")
    return rid


def _priority(body: Mapping[str, Any]) -> int | None:
    """None when not given: SGLang then ranks it last under priority scheduling."""
    return _int(body, "priority", None)


def _salt(body: Mapping[str, Any]) -> str:
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise BadRequestError("cache_salt must be a string.", schema=True)
    return salt


def _bootstrap(body: Mapping[str, Any]) -> Bootstrap | None:
    """The P/D fields, all or none (a room without a host names no peer)."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is None and port is None and room is None:
        return None
    if any(isinstance(v, list) for v in (host, port, room)):
        raise BadRequestError("Batch requests are not supported by the reference engine.")
    if not isinstance(host, str) or not host:
        raise BadRequestError("bootstrap_host must be a non-empty string.", schema=True)
    number = _int(body, "bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
    if number is None or not 0 < number < 65536:
        raise BadRequestError(f"bootstrap_port must be a TCP port, got {port}.")
    named = _int(body, "bootstrap_room", None)
    if named is None or not 0 <= named <= _MAX_ROOM:
        raise BadRequestError(f"bootstrap_room must be an integer in [0, 2^63 - 1], got {room}.")
    return Bootstrap(host, number, named)


def parse_generate(body: Mapping[str, Any]) -> GenerateSpec:
    """SGLang's /generate: `text` or `input_ids`, `sampling_params`, `stream`, `rid`…"""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequestError("Either text, input_ids or input_embeds should be provided.")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise BadRequestError("Batch requests are not supported by the reference engine.")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequestError("text must be a string.", schema=True)
        input_ids = encode(text)
    else:
        input_ids = _token_ids(ids, "input_ids")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequestError("sampling_params must be an object.", schema=True)
    max_new = _int(params, "max_new_tokens", 128)
    if max_new is not None and max_new < 0:
        raise BadRequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    return GenerateSpec(
        rid=_rid(body),
        input_ids=input_ids,
        max_new_tokens=max_new,
        stream=_bool(body, "stream"),
        ignore_eos=_bool(params, "ignore_eos"),
        min_new_tokens=_int(params, "min_new_tokens", 0, lo=0) or 0,
        stop=_stops(params.get("stop")),
        stop_token_ids=_token_ids(params.get("stop_token_ids") or [], "stop_token_ids"),
        priority=_priority(body),
        cache_salt=_salt(body),
        bootstrap=_bootstrap(body),
    )


def _openai_common(body: Mapping[str, Any], spec: GenerateSpec) -> GenerateSpec:
    n = _int(body, "n", 1)
    if n != 1:
        raise BadRequestError("Only n=1 is supported.")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequestError("stream_options must be an object.", schema=True)
        spec.include_usage = _bool(options, "include_usage")
        spec.continuous_usage = _bool(options, "continuous_usage_stats")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequestError("model must be a string.", schema=True)
    spec.model = model
    return spec


def _openai_max_tokens(body: Mapping[str, Any], default: int | None) -> int | None:
    value = _int(body, "max_completion_tokens", None)
    if value is None:
        value = _int(body, "max_tokens", default)
    if value is not None and value < 0:
        raise BadRequestError(f"max_tokens must be at least 0, got {value}.")
    return value


def _openai_spec(
    body: Mapping[str, Any], input_ids: list[int], default_max: int | None
) -> GenerateSpec:
    spec = GenerateSpec(
        rid=_rid(body),
        input_ids=input_ids,
        max_new_tokens=_openai_max_tokens(body, default_max),
        stream=_bool(body, "stream"),
        ignore_eos=_bool(body, "ignore_eos"),
        min_new_tokens=_int(body, "min_tokens", 0, lo=0) or 0,
        stop=_stops(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        priority=_priority(body),
        cache_salt=_salt(body),
        bootstrap=_bootstrap(body),
    )
    return _openai_common(body, spec)


def parse_completion(body: Mapping[str, Any]) -> GenerateSpec:
    """/v1/completions: `prompt` is a string, a list of token ids, or a one-string list."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequestError("Field required: prompt.", schema=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
    else:
        raise BadRequestError(
            "prompt must be a string or a list of token ids (one prompt only).", schema=True
        )
    return _openai_spec(body, ids, 16)


def parse_chat(body: Mapping[str, Any]) -> GenerateSpec:
    """/v1/chat/completions: messages rendered with the engine's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequestError("Field required: messages, a list of message objects.", schema=True)
    try:
        text = chat_template.render(
            messages,
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message"),
        )
    except chat_template.ChatTemplateError as exc:
        raise BadRequestError(str(exc)) from None
    return _openai_spec(body, encode(text), None)
