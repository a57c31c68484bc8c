"""What the router reads from a client request, validated before anything is routed.

Three entry APIs share one shape (`ClientRequest`): SGLang's `/generate` and OpenAI's
`/v1/completions` and `/v1/chat/completions`, checked by the rules the sidecar checks them by
too (`controlplane.rules.request_checks`), so both refuse a body alike. Weir's own per-request fields come from
headers or, equivalently, body fields (a header wins when both are given):

| header                | body field          | meaning                                         |
|-----------------------|---------------------|-------------------------------------------------|
| `x-weir-priority`     | `priority`          | integer in [-1000, 1000], higher runs first     |
| `x-weir-deadline-ms`  | `weir_deadline_ms`  | time budget in milliseconds from arrival        |
| `x-weir-tenant`       | —                   | the tenant, on a router without API keys, when |
|                       |                     | the pool policy declares it (else 403)          |

Served replies carry `x-weir-endpoint`, the endpoint that served them (the first one, when
a stream was resumed elsewhere). `priority` is SGLang's own field and is forwarded;
`weir_deadline_ms` is removed before the body goes upstream. Prompt tokens are estimated
from UTF-8 bytes (`bytes_per_token`; the reference engine's tokens are bytes) for routing,
prefix hashing and the context check: the router never runs a tokenizer on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from controlplane.contract import Continuation, EngineAPI
from controlplane.contract import headers as wire
from controlplane.router.errors import refused, unavailable
from controlplane.rules import request_checks as checks
from controlplane.rules.request_checks import RequestCheckError

_T = TypeVar("_T")


@dataclass(slots=True)  # not frozen: a frozen init costs 1.5 us per request; none writes it
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
class RequestLimits:
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
        return checks.decode_body(raw)
    except RequestCheckError as exc:
        raise refused(exc) from None


def parse_client_request(
    api: EngineAPI,
    body: dict[str, Any],
    headers: Mapping[str, str],
    *,
    models: frozenset[str],
    default_model: str,
    limits: RequestLimits,
) -> ClientRequest:
    """Validate a decoded body by the shared rules (`controlplane.rules.request_checks`)
    and Weir's headers; raise `RouterError` (400, or 404 for an unknown model)."""
    try:
        checked = checks.check(
            api, body, models=models, default_model=default_model,
            context_length=limits.context_length,
        )  # fmt: skip
        fields = checked.body
        prompt_tokens = len(checked.prompt_ids) or math.ceil(
            len(checked.prompt_text.encode("utf-8")) / limits.bytes_per_token
        )
        max_new = checked.output_limit(prompt_tokens, limits.context_length)
        priority = _weir_value(
            headers, wire.PRIORITY, int, checks.priority, fields.get("priority"), "priority"
        )
        deadline_s = _weir_value(
            headers, wire.DEADLINE_MS, float, checks.deadline_s,
            fields.pop("weir_deadline_ms", None), "weir_deadline_ms",
        )  # fmt: skip
    except RequestCheckError as exc:
        raise refused(exc) from None
    if "priority" in fields or priority:
        fields["priority"] = priority
    return ClientRequest(
        api=api,
        model=checked.model,
        body=fields,
        stream=checked.stream,
        prompt_text=checked.prompt_text,
        prompt_ids=checked.prompt_ids,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new,
        priority=priority,
        deadline_s=deadline_s,
        adapter=fields.get("lora_path") or "",
    )


def resume_body(continuation: Continuation) -> dict[str, Any]:
    """The engine request that resumes `continuation`, at least one token long.

    A completion prompted by token ids has no such request: its prompt cannot be extended
    by the text the client received. That raises `RouterError` (503 `not_resumable`)
    rather than resume from a prompt that is not the client's."""
    if continuation.api is EngineAPI.COMPLETIONS and continuation.prompt_ids:
        raise unavailable(
            "not_resumable", "a completion prompted by token ids cannot resume from its text"
        )
    if continuation.remaining_tokens < 1:
        continuation = msgspec.structs.replace(
            continuation, max_new_tokens=continuation.generated + 1
        )
    return continuation.engine_body()


def _weir_value(
    headers: Mapping[str, str],
    header: str,
    convert: Callable[[str], float],
    rule: Callable[[object, str], _T],
    value: object,
    field: str,
) -> _T:
    """One of Weir's per-request values: a header wins over its body field, and either is
    checked by the same rule, which names the one it refuses."""
    raw = headers.get(header)
    if raw is None:
        return rule(value, field)
    try:
        number = convert(raw)
    except ValueError:
        return rule(raw, header)  # not a number: the rule refuses it
    return rule(number, header)
