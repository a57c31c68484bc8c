"""The rules a client's request body is checked by, shared by the router and the sidecar.

Both edges of Weir take the same three entry APIs (SGLang's `/generate`, OpenAI's
`/v1/completions` and `/v1/chat/completions`) and must refuse the same bodies with the same
status and reason, before anything is admitted, charged or reserved. `check` applies every
rule a body can be judged by on its own; what depends on where it runs stays with the
caller, which then asks `CheckedBody.output_limit` whether its prompt count fits the context:
the router estimates prompt tokens from UTF-8 bytes and enforces its estimate; the sidecar
counts an upper bound and enforces only exact counts (token ids).

Semantics are OpenAI's and SGLang's; where they differ, the stricter, because what passes
here is forwarded as it is to whichever engine serves it:

- the body is a JSON object; `stream` is a boolean; `rid` is the edge's own and dropped;
- `model` names a served model (404 otherwise); `/generate` may omit it;
- a prompt is one non-empty string or list of token ids in [0, 2**31); a batch of one is
  that one prompt, larger batches are refused; chat content is text (a string or text
  parts), since nothing else can be sized before the engine sees it;
- an integral float (`5.0`) counts as an integer, as SGLang's request models and the
  reference engine read it; a boolean or a string does not;
- `max_tokens` (chat: `max_completion_tokens` first; `/generate`: `max_new_tokens`) is in
  [1, context]; without one, OpenAI's completions default 16, SGLang's `/generate` 128, chat
  whatever the context leaves;
- `temperature` [0, 2], `top_p` [0, 1], presence and frequency penalties [-2, 2] (finite),
  `n` is 1; `priority` in [-1000, 1000]; `lora_path` is a string.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from controlplane.contract.models import EngineAPI

PRIORITY_RANGE = (-1000, 1000)
MAX_DEADLINE_MS = 24 * 3600 * 1000
TOKEN_ID_LIMIT = 2**31  # int32 in every engine; the engine checks its own vocabulary
# What an engine generates when the client names no limit; 0: what the context leaves.
DEFAULT_MAX_NEW_TOKENS = {EngineAPI.COMPLETIONS: 16, EngineAPI.GENERATE: 128, EngineAPI.CHAT: 0}
# Where each API names its output limit; the first one given wins.
_LIMIT_FIELDS = {
    EngineAPI.COMPLETIONS: ("max_tokens",),
    EngineAPI.GENERATE: ("max_new_tokens",),
    EngineAPI.CHAT: ("max_completion_tokens", "max_tokens"),
}
_SAMPLING_RANGES = (
    ("temperature", 0.0, 2.0),
    ("top_p", 0.0, 1.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
)
# Token ids checked in C: a list of 1,000 ids costs a tenth of a Python loop over it.
_TOKEN_IDS = tuple[Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)], ...]


class RequestCheckError(ValueError):
    """A body refused before admission: the HTTP status, a stable reason code, a message for
    people, and the parameter at fault (None when it is the body as a whole)."""

    def __init__(
        self, reason: str, message: str, param: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param


@dataclass(slots=True)
class CheckedBody:
    """A body that passed every rule of its API."""

    api: EngineAPI
    body: dict[str, Any]  # the client's fields but `stream` and `rid`; a batch of one unwrapped
    stream: bool
    model: str  # "" on a /generate that names none
    prompt_param: str  # where the prompt is: "text", "input_ids", "prompt" or "messages"
    prompt_text: str  # "" for token ids; chat messages as "role\ncontent\n" each
    prompt_ids: tuple[int, ...]
    max_new_tokens: int  # the explicit limit, else the API's default; 0: what context leaves

    def output_limit(self, prompt_tokens: int, context_length: int, *, enforce: bool = True) -> int:
        """The output limit beside a prompt of `prompt_tokens`. With `enforce`, a prompt and
        limit that together overflow the context are refused."""
        max_new = self.max_new_tokens or max(1, context_length - prompt_tokens)
        if enforce and prompt_tokens + max_new > context_length:
            raise RequestCheckError(
                "context_length_exceeded",
                f"the prompt in {self.prompt_param!r} (~{prompt_tokens} tokens) plus {max_new} "
                f"new tokens exceeds the context length of {context_length}",
                self.prompt_param,
            )
        return max_new


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestCheckError(
            "malformed_json", f"the request body is not valid JSON: {exc}"
        ) from exc
    except RecursionError:  # msgspec's guard against a stack overflow, not a bug here
        raise RequestCheckError(
            "malformed_json", "the request body nests too deeply to be a request"
        ) from None
    if not isinstance(body, dict):
        raise RequestCheckError("malformed_json", "the request body must be a JSON object")
    return body


def check(
    api: EngineAPI,
    body: Mapping[str, Any],
    *,
    models: Collection[str],
    default_model: str,
    context_length: int,
) -> CheckedBody:
    """Check a decoded body against every rule of `api`; raise `RequestCheckError`."""
    fields = dict(body)
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise RequestCheckError("invalid_stream", "'stream' must be true or false", "stream")
    fields.pop("rid", None)
    model = _model(fields.get("model"), api, models, default_model)
    prompt_ids: tuple[int, ...] = ()
    if api is EngineAPI.GENERATE:
        sampling = fields.get("sampling_params", {})
        if not isinstance(sampling, dict):
            raise RequestCheckError(
                "invalid_parameter", "'sampling_params' must be an object", "sampling_params"
            )
        if "input_ids" in fields:
            prompt_param, prompt_text = "input_ids", ""
            prompt_ids = _token_ids(fields["input_ids"], prompt_param)
        else:
            prompt_param, text = "text", fields.get("text")
            if not isinstance(text, str) or not text:
                raise RequestCheckError(
                    "missing_prompt", "/generate needs a non-empty 'text' or 'input_ids'", "text"
                )
            prompt_text = text
        prefix = "sampling_params."
    else:
        sampling, prefix = fields, ""
        if api is EngineAPI.COMPLETIONS:
            prompt_param = "prompt"
            prompt_text, prompt_ids = _completion_prompt(fields)
        else:
            prompt_param, prompt_text = "messages", _chat_prompt(fields.get("messages"))
    max_new = _max_tokens(sampling, api, prefix, context_length)
    _check_sampling(sampling, prefix)
    adapter = fields.get("lora_path")
    if adapter is not None and not isinstance(adapter, str):
        raise RequestCheckError("invalid_adapter", "'lora_path' must be a string", "lora_path")
    return CheckedBody(api, fields, stream, model, prompt_param, prompt_text, prompt_ids, max_new)


def _integer(value: object, name: str, low: int, high: int, reason: str) -> int:
    """`value` as an integer in [low, high] (an integral float counts; a boolean does not)."""
    if type(value) is int and low <= value <= high:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            raise RequestCheckError(reason, f"{name!r} must be an integer", name)
        value = int(value)
    if not low <= value <= high:
        raise RequestCheckError(reason, f"{name!r} must be an integer in [{low}, {high}]", name)
    return value


def priority(value: object, name: str = "priority") -> int:
    """A request's priority, 0 when absent."""
    if value is None:
        return 0
    return _integer(value, name, *PRIORITY_RANGE, "invalid_priority")


def deadline_s(value: object, name: str) -> float:
    """A deadline given in milliseconds, in seconds; 0.0 when absent."""
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_DEADLINE_MS
    ):
        raise RequestCheckError(
            "invalid_deadline", f"{name!r} must be in (0, {MAX_DEADLINE_MS}] milliseconds", name
        )
    return value / 1000.0


def _model(model: object, api: EngineAPI, models: Collection[str], default_model: str) -> str:
    if model is None and api is EngineAPI.GENERATE:
        return default_model
    if not isinstance(model, str) or not model:
        raise RequestCheckError("missing_model", "'model' must name a served model", "model")
    if model not in models:
        raise RequestCheckError(
            "unknown_model",
            f"model {model!r} is not served here; served: {', '.join(sorted(models)) or 'none'}",
            "model",
            status=404,
        )
    return model


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise RequestCheckError(
            "missing_prompt", f"{name!r} must be a non-empty list of token ids", name
        )
    try:
        return msgspec.convert(value, _TOKEN_IDS)
    except msgspec.ValidationError:
        token = next(t for t in value if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT)
        raise RequestCheckError(
            "invalid_prompt", f"{name!r} holds an invalid token id {token!r}", name
        ) from None


def _completion_prompt(fields: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = fields["prompt"] = prompt[0]  # a batch of one is its one prompt
    if isinstance(prompt, str) and prompt:
        return prompt, ()
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        return "", _token_ids(prompt, "prompt")
    raise RequestCheckError(
        "missing_prompt",
        "'prompt' must be one non-empty string or list of token ids (batches are not served)",
        "prompt",
    )


def _chat_prompt(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise RequestCheckError(
            "missing_messages", "'messages' must be a non-empty list", "messages"
        )
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestCheckError(
                "invalid_messages", f"'messages[{i}]' needs a string 'role'", "messages"
            )
        content = message.get("content")
        if not (content is None or isinstance(content, str)):
            content = _text_parts(content, i)
        parts.append(f"{message['role']}\n{content or ''}\n")
    return "".join(parts)


def _text_parts(content: object, i: int) -> str:
    """Content parts are read as text only: nothing else can be sized before the engine."""
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    raise RequestCheckError(
        "invalid_messages",
        f"'messages[{i}].content' must be a string or a list of text parts",
        "messages",
    )


def _max_tokens(params: Mapping[str, Any], api: EngineAPI, prefix: str, context_length: int) -> int:
    for name in _LIMIT_FIELDS[api]:
        value = params.get(name)
        if value is not None:
            return _integer(value, prefix + name, 1, context_length, "invalid_max_tokens")
    return DEFAULT_MAX_NEW_TOKENS[api]


def _check_sampling(params: Mapping[str, Any], prefix: str) -> None:
    get = params.get
    for name, low, high in _SAMPLING_RANGES:
        value = get(name)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high  # NaN compares false
        ):
            raise RequestCheckError(
                "invalid_parameter", f"{prefix + name!r} must be a number in [{low}, {high}]",
                prefix + name,
            )  # fmt: skip
    n = get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestCheckError(
            "invalid_parameter",
            f"{prefix + 'n'!r} must be 1 (one choice per request)",
            prefix + "n",
        )
