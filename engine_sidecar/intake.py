"""Checking a client's request before anything is admitted or reserved.

Each entry API (`/generate`, `/v1/completions`, `/v1/chat/completions`) is validated into
one `Intake`: the body the engine will get, the prompt size admission charges, the output
limit, and whether the request can be preempted and resumed. The rules are the router's too
(`controlplane.rules.request_checks`), so a body the router would refuse is refused here
with the same status and reason. Anything malformed, hostile or beyond the context raises
`RequestError` with the HTTP status to answer; nothing has been reserved at that point, so
nothing leaks.

The prompt size is exact for token ids and otherwise an upper bound — the UTF-8 byte
length (for chat, of each message's role and content, plus its template tokens): no
tokenizer produces more tokens than bytes, and over-counting fails closed. Only exact
counts are held against the context, and the engine's own count replaces the bound as soon
as a stream reports one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.contract import Continuation, EngineAPI
from controlplane.rules import request_checks as checks
from controlplane.rules.request_checks import RequestCheckError
from engine_sidecar.policy.prompt_size import PromptSizer

# What the engine's path is for each entry API.
ENGINE_PATH = {
    EngineAPI.GENERATE: "/generate",
    EngineAPI.COMPLETIONS: "/v1/completions",
    EngineAPI.CHAT: "/v1/chat/completions",
}

# Template tokens a chat message adds around its role and content.
_MESSAGE_TEMPLATE_TOKENS = 8


class RequestError(RequestCheckError):
    """A request the sidecar refuses before admission, with the error type (`kind`) its
    body names: a refusal of the shared checks (`refusing`), or one of the sidecar's own."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "invalid_request",
        reason: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        super().__init__(reason, message, param, status)
        self.kind = kind

    @classmethod
    def refusing(cls, exc: RequestCheckError) -> RequestError:
        kind = "model_not_found" if exc.status == 404 else "invalid_request"
        return cls(exc.message, exc.status, kind, exc.reason, exc.param)


@dataclass(slots=True)  # not frozen: a frozen init costs 1.3 us per request; none writes it
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
    # The API the first engine request goes to when it is not the client's: a continued
    # chat known by its token ids resumes through completions (Continuation.resume_api).
    engine_api: EngineAPI | None = None
    # A text prompt sized by estimate: its UTF-8 bytes and the tokens a chat template adds
    # (both 0 when its size is known, by ids or as a continuation). When the engine says
    # the real size, the sizer learns from it.
    prompt_bytes: int = 0
    template_tokens: int = 0


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    """What this endpoint can serve."""

    model: str
    context_length: int


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        return checks.decode_body(raw)
    except RequestCheckError as exc:
        raise RequestError.refusing(exc) from None


def parse_intake(
    api: EngineAPI, body: dict[str, Any], limits: IntakeLimits, sizer: PromptSizer | None = None
) -> Intake:
    """Validate a client body for `api`, a text prompt sized by `sizer` (a byte a token
    without one); raises RequestError."""
    sizer = sizer or PromptSizer()
    try:
        checked = checks.check(
            api, body, models=(limits.model,), default_model=limits.model,
            context_length=limits.context_length,
        )  # fmt: skip
        fields = checked.body
        exact = bool(checked.prompt_ids)
        text_bytes = template = 0
        if exact:
            prompt = len(checked.prompt_ids)
        else:
            text_bytes = len(checked.prompt_text.encode("utf-8"))
            if api is EngineAPI.CHAT:
                template = _MESSAGE_TEMPLATE_TOKENS * len(fields["messages"])
            prompt = sizer.tokens(text_bytes) + template
        max_new_tokens = checked.output_limit(prompt, limits.context_length, enforce=exact)
        priority = checks.priority(fields.pop("priority", None))
    except RequestCheckError as exc:
        raise RequestError.refusing(exc) from None
    return Intake(
        api=api,
        body=fields,
        model=checked.model,
        stream=checked.stream,
        prompt_tokens=prompt,
        prompt_ids=checked.prompt_ids,
        max_new_tokens=max_new_tokens,
        priority=priority,
        # OpenAI streams carry text, so a completion prompted by token ids cannot be
        # extended by what it generated.
        recomputable=not (exact and api is EngineAPI.COMPLETIONS),
        prompt_bytes=text_bytes,
        template_tokens=template,
    )


def from_continuation(
    cont: Continuation, limits: IntakeLimits, sizer: PromptSizer | None = None
) -> Intake:
    """The intake for a continuation arriving at `/weir/v1/continue`, its text sized by
    `sizer` where no ids say it. Raises RequestError."""
    sizer = sizer or PromptSizer()
    if cont.model != limits.model:
        raise RequestError(
            f"model {cont.model!r} is not served here", 404, "model_not_found", "unknown_model",
            "model",
        )  # fmt: skip
    if cont.remaining_tokens <= 0:
        raise RequestError(
            "the continuation has no tokens left to generate", reason="invalid_continuation"
        )
    base = parse_intake(cont.api, dict(cont.body) | {"stream": True}, limits, sizer)
    extra = len(cont.generated_ids) or sizer.tokens(len(cont.generated_text.encode("utf-8")))
    return Intake(
        api=base.api,
        engine_api=cont.resume_api,
        body=cont.engine_body(),
        model=base.model,
        stream=True,
        prompt_tokens=base.prompt_tokens + extra,
        prompt_ids=cont.prompt_ids + cont.generated_ids,
        max_new_tokens=cont.remaining_tokens,
        priority=cont.priority,
        recomputable=base.recomputable,
    )
