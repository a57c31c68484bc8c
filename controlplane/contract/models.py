"""Records shared by the router, the sidecars, the operator and the simulator.

Every record carries `schema` (the contract's version) so a reader can refuse what it does
not understand instead of misreading it. Times are seconds; `*_at` fields written by a
client are informational only: liveness is decided by Redis server time (leases).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

SCHEMA_VERSION = 1


class Role(enum.StrEnum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Lifecycle(enum.StrEnum):
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"


class WatermarkState(enum.StrEnum):
    """KV pressure zones, mildest first. Ordered: compare with `.rank`."""

    NORMAL = "normal"
    PRESSURE = "pressure"
    CRITICAL = "critical"
    EXHAUSTED = "exhausted"

    @property
    def rank(self) -> int:
        return _WATERMARK_RANK[self]


_WATERMARK_RANK = {
    WatermarkState.NORMAL: 0,
    WatermarkState.PRESSURE: 1,
    WatermarkState.CRITICAL: 2,
    WatermarkState.EXHAUSTED: 3,
}


class FinishReason(enum.StrEnum):
    """Why a request ended. Capacity actions are never disguised as completions.

    `preempted` means state was saved and the request will resume: it is never final to a
    client. `overload` is a refusal before admission, retryable, with Retry-After.
    """

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    PREEMPTED = "preempted"
    OVERLOAD = "overload"
    ABORTED = "aborted"
    ERROR = "error"

    @property
    def is_final(self) -> bool:
        return self is not FinishReason.PREEMPTED


class CacheIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What must match for two requests to share KV: model, adapter, cache schema version
    and security domain (a tenant, when tenants must not share KV)."""

    model: str
    adapter: str = ""
    cache_schema: int = 1
    security_domain: str = ""

    def seed(self) -> bytes:
        """Stable bytes that seed the chained prompt-block hashes."""
        return f"{self.model}\x1f{self.adapter}\x1f{self.cache_schema}\x1f{self.security_domain}".encode()


# Host-tier prefixes an endpoint publishes at most: each heartbeat carries them.
MAX_HOST_PREFIXES = 32
_HostPrefixes = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_HOST_PREFIXES)]


class EndpointState(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's state as its sidecar reports it in every heartbeat.

    `epoch` is the fencing token handed out at registration; `version` increases with every
    heartbeat of that epoch. The store rejects a write with an older epoch or a
    non-increasing version.
    """

    schema: int = SCHEMA_VERSION
    pool: str
    endpoint_id: str
    address: str
    model: str
    adapters: tuple[str, ...] = ()
    role: Role = Role.MIXED
    # A prefill endpoint's engine bootstrap server (SGLang's --disaggregation-bootstrap-
    # port), on the host of `address`: where decode engines fetch its KV. 0: none.
    bootstrap_port: int = 0
    cache_schema: int = 1
    security_domain: str = ""
    epoch: int = 0
    version: int = 0
    lifecycle: Lifecycle = Lifecycle.READY
    watermark: WatermarkState = WatermarkState.NORMAL
    page_size: int = 1
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    kv_reserved_growth_tokens: int = 0
    kv_growth_tokens_per_s: float = 0.0
    waiting_prefill_tokens: int = 0
    running_requests: int = 0
    queued_requests: int = 0
    preemptions_per_s: float = 0.0
    # The sidecar's latency model (engine_sidecar.policy.latency): the wait before a new
    # request's own prefill starts, the prefill seconds per uncached prompt token (0: no
    # model — a sidecar older than it — so routers use their own calibration), and the
    # TPOT of a request admitted now. A router predicts a request's TTFT as
    # `predicted_ttft_s + uncached tokens * predicted_prefill_s_per_token`.
    predicted_ttft_s: float = 0.0
    predicted_tpot_s: float = 0.0
    predicted_prefill_s_per_token: float = 0.0
    # The prompts whose pages this engine holds in its host tier rather than on the
    # device (offloaded requests), each named by the last of its block hashes as routers
    # key it, most recent first, at most MAX_HOST_PREFIXES: routers credit them as
    # cached, below what is on the device.
    host_prefixes: _HostPrefixes = ()
    started_at: float = 0.0
    updated_at: float = 0.0

    @property
    def kv_free_tokens(self) -> int:
        return max(
            0, self.kv_capacity_tokens - self.kv_used_tokens - self.kv_reserved_growth_tokens
        )

    @property
    def kv_pressure(self) -> float:
        """Fraction of capacity committed, counting reserved growth; 1.0 when unknown."""
        if self.kv_capacity_tokens <= 0:
            return 1.0
        return (self.kv_used_tokens + self.kv_reserved_growth_tokens) / self.kv_capacity_tokens

    def cache_identity(self, adapter: str = "") -> CacheIdentity:
        return CacheIdentity(
            model=self.model,
            adapter=adapter,
            cache_schema=self.cache_schema,
            security_domain=self.security_domain,
        )


class CommandKind(enum.StrEnum):
    DRAIN = "drain"
    PAUSE_ADMISSION = "pause_admission"
    RESUME_ADMISSION = "resume_admission"
    PREEMPT_REQUEST = "preempt_request"
    PREEMPT_TENANT = "preempt_tenant"
    SET_PRIORITY = "set_priority"


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """An instruction to one endpoint's sidecar, delivered through its Redis stream.

    `command_id` makes delivery idempotent: a sidecar executes an id at most once and
    acknowledges it; unacknowledged commands are redelivered.
    """

    schema: int = SCHEMA_VERSION
    command_id: str
    pool: str
    endpoint_id: str
    kind: CommandKind
    request_id: str = ""
    tenant: str = ""
    priority: int = 0
    deadline_s: float = 0.0
    issued_at: float = 0.0


class TenantQuota(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits. Zero means unlimited for rate and size limits."""

    schema: int = SCHEMA_VERSION
    name: str
    priority_class: str = "standard"
    weight: float = 1.0
    max_concurrency: int = 0
    input_tokens_per_min: int = 0
    output_tokens_per_min: int = 0
    kv_token_seconds_per_min: int = 0
    reserved_fraction: float = 0.0


class HandoffCredit(msgspec.Struct, frozen=True, kw_only=True):
    """Decode capacity promised to one prefill: KV bytes on a decode class, until expiry."""

    schema: int = SCHEMA_VERSION
    credit_id: str
    pool: str
    decode_class: str
    kv_bytes: int
    expires_at: float


# The longest a migration target is asked to hold room (seconds).
MAX_RESERVATION_TTL_S = 60.0


class RoomReservation(msgspec.Struct, frozen=True, kw_only=True):
    """Room one endpoint holds for one request's continuation, a migration's target.

    A migrating sidecar asks for it (`POST /weir/v1/reserve` on the target, with the
    admin token) with `request_id`, `tokens` (the continuation's prompt, output so far and
    growth reserve) and `ttl_s`; the target answers the same record with its
    `reservation_id`, or 409 `no_room` with the room it has (`room_tokens`)."""

    schema: int = SCHEMA_VERSION
    request_id: str
    tokens: int
    ttl_s: float
    reservation_id: str = ""

    def __post_init__(self) -> None:
        if not 0 < len(self.request_id) <= 256:
            raise ValueError("request_id must be 1 to 256 characters")
        if not 0 < self.tokens < 2**31:
            raise ValueError(f"tokens must be a positive number of tokens, got {self.tokens}")
        if not 0 < self.ttl_s <= MAX_RESERVATION_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_RESERVATION_TTL_S:g}], got {self.ttl_s}")


class EngineAPI(enum.StrEnum):
    """Which engine surface a request entered through; a continuation resumes on the same."""

    GENERATE = "generate"
    COMPLETIONS = "completions"
    CHAT = "chat"


# Chat request fields that completions has not, or reads differently: dropped when a chat
# resumes through completions. Logprobs are among them (a bool there, a count here): a
# resumed chat segment reports none.
_CHAT_ONLY = frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "continue_final_message", "add_generation_prompt", "chat_template_kwargs",
    "reasoning_effort", "separate_reasoning", "stream_reasoning", "max_completion_tokens",
    "logprobs", "top_logprobs", "functions", "function_call", "return_prompt_token_ids",
    "return_input_ids_in_sglext", "return_output_ids_in_sglext", "return_meta_info",
})  # fmt: skip


class Continuation(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to resume a request later or elsewhere, as a fresh engine request.

    `body` is the client's request body as the engine first received it (sampling
    parameters included, `stream` and `rid` excluded). The engine re-prefills the prompt
    plus what was generated (its prefix cache often makes this cheap) and generates at most
    `remaining_tokens` more; partial KV is never spliced across engines. How the prompt is
    extended depends on `api`:

    - known as token ids (`exact`: the prompt as the engine tokenized it, and every
      generated token): the prompt becomes `prompt_ids + generated_ids`, so the engine
      resumes token for token (`input_ids` on generate, a token-id `prompt` on
      completions; chat takes no token ids, so a chat resumes through completions,
      `resume_api`, its chat-only fields dropped);
    - known as text only: generate `text = body.text + generated_text`, completions
      `prompt = body.prompt + generated_text`, chat `messages + [{"role": "assistant",
      "content": generated_text}]` with `continue_final_message: true`. A tokenizer may
      cut the joined text differently from what was generated, so such a resume can
      diverge from the uninterrupted run (not with the reference engine's bytes).

    A migrating sidecar ends its response stream with an SSE event `weir.preempted` whose
    data is this record as JSON; the router then posts it to another endpoint's
    `/weir/v1/continue` and splices the client's stream. `preempted` is never final.
    Relief's migrations name the endpoint that holds room for it (`target`) and that
    room (`reservation`, see `RoomReservation`): the router tries that endpoint first,
    whose admission takes the held room.
    """

    schema: int = SCHEMA_VERSION
    request_id: str
    tenant: str = ""
    model: str
    api: EngineAPI
    body: dict[str, object] = msgspec.field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()
    generated_ids: tuple[int, ...] = ()
    generated_text: str = ""
    # Tokens the client received before this continuation: `len(generated_ids)` where the
    # ids are known, counted by the sender where only the text is (0: count the ids).
    generated_tokens: int = 0
    max_new_tokens: int  # the client's, over the whole request
    priority: int = 0
    deadline_at: float = 0.0
    preemptions: int = 0
    # What the client saw of the first segment, so that a resumed stream reads as its
    # continuation: the response id (and an OpenAI chunk's `created`), the prompt's
    # token count and its prefix-cache hit.
    response_id: str = ""
    created: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    target: str = ""
    reservation: str = ""

    @property
    def generated(self) -> int:
        """Tokens generated before this continuation, ids known or not."""
        return max(self.generated_tokens, len(self.generated_ids))

    @property
    def exact(self) -> bool:
        """Known as token ids throughout: the engine can resume it token for token."""
        return bool(self.prompt_ids) and (bool(self.generated_ids) or not self.generated_text)

    @property
    def resume_api(self) -> EngineAPI:
        """The engine API a resume goes to: a chat known by its ids resumes through
        completions, the other APIs through their own."""
        return EngineAPI.COMPLETIONS if self.api is EngineAPI.CHAT and self.exact else self.api

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_new_tokens - self.generated)

    def engine_body(self) -> dict[str, object]:
        """The engine request that resumes this continuation, its prompt extended as the
        class docstring says."""
        body: dict[str, object] = dict(self.body)
        remaining = self.remaining_tokens
        if self.api is EngineAPI.GENERATE:
            params = body.get("sampling_params")
            body["sampling_params"] = {
                **(params if isinstance(params, dict) else {}),
                "max_new_tokens": remaining,
            }
            if self.exact:
                body.pop("text", None)
                body["input_ids"] = [*self.prompt_ids, *self.generated_ids]
            else:
                body.pop("input_ids", None)
                body["text"] = str(body.get("text", "")) + self.generated_text
        elif self.exact:  # completions, and chat through completions
            if self.api is EngineAPI.CHAT:
                body = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
            body["prompt"] = [*self.prompt_ids, *self.generated_ids]
            body["max_tokens"] = remaining
        elif self.api is EngineAPI.COMPLETIONS:
            body["prompt"] = str(body.get("prompt", "")) + self.generated_text
            body["max_tokens"] = remaining
        else:
            messages = body.get("messages")
            body["messages"] = [
                *(messages if isinstance(messages, list) else []),
                {"role": "assistant", "content": self.generated_text},
            ]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = remaining
        return body
