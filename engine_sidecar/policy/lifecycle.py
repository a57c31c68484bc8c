"""The request state machine every sidecar request travels through.

WAITING_ADMISSION → PREFILL_READY → PREFILL_RUNNING ⇄ PREFILL_PAUSED → DECODE_READY →
DECODING ⇄ DECODE_PREEMPTED → FINISHED | CANCELLED | REJECTED | ABORTED.

A `RequestRecord` is immutable: each transition returns a new record, checked against the
table below, so an illegal move (say, resuming a cancelled request) raises at the point it
happens instead of silently corrupting the KV accounting. The record carries everything a
policy needs to judge the request — prompt progress, generated and maximum tokens, KV held,
deadline, priority, tenant, preemptions, accumulated service, whether it may be recomputed
or migrated, and whether its client is still connected.

A request that migrates away ends *here* as FINISHED with finish reason `preempted`: its
life continues on another endpoint as a continuation, and the client never sees that
reason as final.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controlplane.contract import FinishReason


class RequestState(enum.StrEnum):
    WAITING_ADMISSION = "waiting_admission"
    PREFILL_READY = "prefill_ready"
    PREFILL_RUNNING = "prefill_running"
    PREFILL_PAUSED = "prefill_paused"
    DECODE_READY = "decode_ready"
    DECODING = "decoding"
    DECODE_PREEMPTED = "decode_preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in _FINAL

    @property
    def holds_engine_kv(self) -> bool:
        """Whether the engine holds this request's KV in this state."""
        return self in _IN_ENGINE


_S = RequestState
_FINAL = frozenset({_S.FINISHED, _S.CANCELLED, _S.REJECTED, _S.ABORTED})
_IN_ENGINE = frozenset({_S.PREFILL_RUNNING, _S.DECODE_READY, _S.DECODING})
_ENDINGS = frozenset({_S.CANCELLED, _S.ABORTED})

TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING_ADMISSION: frozenset({_S.PREFILL_READY, _S.REJECTED, _S.CANCELLED}),
    _S.PREFILL_READY: frozenset({_S.PREFILL_RUNNING, *_ENDINGS}),
    _S.PREFILL_RUNNING: frozenset({_S.PREFILL_PAUSED, _S.DECODE_READY, _S.FINISHED, *_ENDINGS}),
    _S.PREFILL_PAUSED: frozenset({_S.PREFILL_RUNNING, _S.FINISHED, *_ENDINGS}),
    _S.DECODE_READY: frozenset({_S.DECODING, _S.DECODE_PREEMPTED, _S.FINISHED, *_ENDINGS}),
    _S.DECODING: frozenset({_S.DECODE_PREEMPTED, _S.FINISHED, *_ENDINGS}),
    _S.DECODE_PREEMPTED: frozenset({_S.DECODE_READY, _S.FINISHED, *_ENDINGS}),
    _S.FINISHED: frozenset(),
    _S.CANCELLED: frozenset(),
    _S.REJECTED: frozenset(),
    _S.ABORTED: frozenset(),
}

# The finish reasons each final state may carry.
_FINAL_REASONS: dict[RequestState, frozenset[FinishReason]] = {
    _S.FINISHED: frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.PREEMPTED}),
    _S.CANCELLED: frozenset({FinishReason.CANCELLED}),
    _S.REJECTED: frozenset({FinishReason.OVERLOAD, FinishReason.DEADLINE, FinishReason.ERROR}),
    _S.ABORTED: frozenset({FinishReason.ABORTED, FinishReason.DEADLINE, FinishReason.ERROR}),
}


class IllegalTransitionError(RuntimeError):
    """A state change the machine does not allow; the record is left as it was."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One request as the sidecar knows it, at one moment."""

    rid: str
    tenant: str
    model: str
    prompt_tokens: int
    max_new_tokens: int
    arrived_at: float
    state: RequestState = RequestState.WAITING_ADMISSION
    state_since: float = 0.0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    deadline_at: float = 0.0
    priority: int = 0
    preemptions: int = 0
    service_s: float = 0.0
    recomputable: bool = True
    migratable: bool = False
    client_connected: bool = True
    finish_reason: FinishReason | None = None

    @property
    def remaining_prompt_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.computed_prompt_tokens)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_new_tokens - self.generated_tokens)

    @property
    def kv_held_tokens(self) -> int:
        """KV the engine holds for this request: prompt plus generated while it runs."""
        if not self.state.holds_engine_kv:
            return 0
        return self.prompt_tokens + self.generated_tokens

    def transition(
        self, to: RequestState, now: float, finish_reason: FinishReason | None = None
    ) -> RequestRecord:
        """The record in state `to` at `now`; raises IllegalTransitionError if not allowed.

        Time spent in an engine-holding state is added to `service_s`; entering
        DECODE_PREEMPTED counts a preemption; a final state needs its finish reason."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(f"{self.rid}: {self.state} → {to} is not allowed")
        if to.is_final:
            if finish_reason is None or finish_reason not in _FINAL_REASONS[to]:
                raise IllegalTransitionError(
                    f"{self.rid}: {to} cannot end with finish reason {finish_reason}"
                )
        elif finish_reason is not None:
            raise IllegalTransitionError(f"{self.rid}: {to} is not final; no finish reason")
        service = self.service_s
        if self.state.holds_engine_kv:
            service += max(0.0, now - self.state_since)
        # A prefill yielding at a chunk boundary is fairness, not preemption: only a decode
        # preemption counts towards the per-request cap.
        preempted = to is _S.DECODE_PREEMPTED
        computed = self.computed_prompt_tokens
        if to is _S.DECODE_READY or to is _S.FINISHED:
            computed = self.prompt_tokens
        return self._evolve(
            to,
            now,
            service,
            self.preemptions + (1 if preempted else 0),
            computed,
            self.generated_tokens,
            finish_reason,
        )

    def with_generated(self, generated_tokens: int) -> RequestRecord:
        """The record after the stream reported `generated_tokens` in total."""
        if generated_tokens < self.generated_tokens:
            raise ValueError(
                f"{self.rid}: generated tokens cannot shrink ({self.generated_tokens} → "
                f"{generated_tokens})"
            )
        return self._evolve(
            self.state,
            self.state_since,
            self.service_s,
            self.preemptions,
            self.computed_prompt_tokens,
            generated_tokens,
            self.finish_reason,
        )

    def _evolve(
        self,
        state: RequestState,
        state_since: float,
        service_s: float,
        preemptions: int,
        computed_prompt_tokens: int,
        generated_tokens: int,
        finish_reason: FinishReason | None,
    ) -> RequestRecord:
        """A copy with the fields a request's life changes. Spelled out rather than
        `dataclasses.replace`, which inspects every field on each call: this runs on each
        transition, several times on every request's way to its first token."""
        return RequestRecord(
            rid=self.rid,
            tenant=self.tenant,
            model=self.model,
            prompt_tokens=self.prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            arrived_at=self.arrived_at,
            state=state,
            state_since=state_since,
            computed_prompt_tokens=computed_prompt_tokens,
            generated_tokens=generated_tokens,
            deadline_at=self.deadline_at,
            priority=self.priority,
            preemptions=preemptions,
            service_s=service_s,
            recomputable=self.recomputable,
            migratable=self.migratable,
            client_connected=self.client_connected,
            finish_reason=finish_reason,
        )
