"""One request's life in the simulator, across every engine it visits.

A `SimFlight` is the simulator's ledger for a request: when it arrived, was dispatched,
first streamed, finished and why; what it generated (kept across preemptions, so a
continuation resumes exactly where the stream stopped); and what capacity actions it
suffered. Reports are computed from flights alone.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.contract import FinishReason
from engine_sidecar.policy import LatencyForecast
from fleetsim.engine.tokens import HASH_SEED, TokenFunction, extend_hash, prefix_hash
from fleetsim.workloads import RequestSpec, prompt_token_bytes

# A decode run's tokens (EOS suppressed) do not depend on the EOS rate.
_TOKENS = TokenFunction()


class Stage(enum.StrEnum):
    NEW = "new"
    QUEUED = "queued"  # waits in a router or sidecar queue, holds no KV
    ENGINE = "engine"  # submitted to an engine (waiting there, prefilling or decoding)
    DONE = "done"


@dataclass(slots=True, eq=False)
class SimFlight:
    spec: RequestSpec
    stage: Stage = Stage.NEW
    engine: int = -1
    hop: int = 0
    accepted: bool = False
    dispatched_at: float = -1.0
    first_token_at: float = -1.0
    last_token_at: float = -1.0
    finished_at: float = -1.0
    reason: FinishReason | None = None
    detail: str = ""
    # What it streamed to its client so far: how many tokens, and their digest (the token
    # function's rolling hash over them, `fleetsim.engine.tokens.prefix_hash`): a test
    # compares digests for exact tokens, and a continuation regenerates the tokens from
    # the prompt (`continuation_ids`). A list of every token was half of a
    # million-request replay's memory.
    generated: int = 0
    stream_digest: int = HASH_SEED
    cached_tokens: int = 0
    visit_cached: int = -1
    preemptions: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    # A relief victim's history, until its continuation's first token says how much of it
    # a prefix cache gave back (the rest was recomputed).
    resume_tokens: int = 0
    queued_since: float = -1.0
    queue_time_s: float = 0.0
    # P/D: prompt tokens whose KV a prefill engine computed and handed off, waiting to be
    # imported by the decode engine this flight goes to next; and time spent moving KV.
    kv_ready: int = 0
    transfer_s: float = 0.0
    handoff_from: float = -1.0
    handoff_s: float = 0.0  # first token on prefill to the next one on decode
    # P/D (Weir): the decode endpoint picked when its pair started, where its handoff lands.
    decode_endpoint: str = ""
    # Refusals (429/503) a patient client retried after.
    retries: int = 0
    # A relief migration's target and the room held there for the continuation, until
    # the continuation reaches a sidecar.
    target: str = ""
    reservation: str = ""
    # Weir's sidecar latency forecast when the request first reached a sidecar, and when
    # that was; how far its TTFT and TPOT were off (absolute percentage errors), once
    # measured on a request undisturbed until then (-1: not measured).
    forecast: LatencyForecast | None = None
    forecast_at: float = -1.0
    ttft_error: float = -1.0
    tpot_error: float = -1.0
    # The spec's `generated_tokens`, read for every token streamed.
    target_tokens: int = field(init=False)
    # The prompt's token ids as bytes while the flight is open (`prompt_bytes`): its
    # routing and every engine visit read them, and making them is numpy's work.
    _prompt: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        self.target_tokens = self.spec.generated_tokens

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def remaining(self) -> int:
        """Tokens still to stream before the request ends on its own."""
        return self.target_tokens - self.generated

    def primed(self, prompt: bytes) -> None:
        """Its prompt's ids, made ahead of its arrival (`prompt_token_bytes_each`)."""
        self._prompt = prompt

    def prompt_bytes(self) -> bytes:
        """The prompt's token ids (`prompt_token_bytes`), made once while it is open."""
        if not self._prompt:
            self._prompt = prompt_token_bytes(self.spec)
        return self._prompt

    def streamed(self, tokens: Sequence[int]) -> None:
        """More tokens reached its client."""
        self.generated += len(tokens)
        self.stream_digest = prefix_hash(tokens, self.stream_digest)

    def streamed_one(self, token: int) -> None:
        self.generated += 1
        self.stream_digest = extend_hash(self.stream_digest, token)

    def continuation_ids(self) -> bytes:
        """The prompt and what it streamed, as a continuation sends them (byte-level ids:
        generated tokens are printable bytes): the tokens are the token function's over
        the prompt (the simulator's engines run the hash backend with EOS ignored), which
        `stream_digest` lets a test check."""
        prompt = self.prompt_bytes()
        if not self.generated:
            return prompt
        tokens, _ = _TOKENS.run(prefix_hash(prompt), self.generated)
        return prompt + bytes(tokens)

    def close(self, reason: FinishReason, now: float, detail: str) -> None:
        """It ended for good: the prompt's ids go (a replay holds every flight)."""
        self.stage = Stage.DONE
        self.reason = reason
        self.detail = detail
        self.finished_at = now
        self._prompt = b""

    def leave_engine(self) -> None:
        """The current engine visit is over; the next one gets a fresh engine rid."""
        self.hop += 1
        self.engine = -1
        self.stage = Stage.NEW
        self.visit_cached = -1

    @property
    def engine_rid(self) -> str:
        """The id of the current engine visit; the trailing '/' keeps SGLang's rid-prefix
        abort from catching another request whose id extends this one."""
        return f"{self.spec.request_id}/{self.hop}/"

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE

    @property
    def completed(self) -> bool:
        return self.reason in (FinishReason.STOP, FinishReason.LENGTH)

    def preempted(self, mode: str) -> None:
        self.preemptions[mode] = self.preemptions.get(mode, 0) + 1

    def enqueue(self, now: float) -> None:
        self.stage = Stage.QUEUED
        self.engine = -1
        self.queued_since = now

    def dequeue(self, now: float) -> None:
        if self.queued_since >= 0:
            self.queue_time_s += now - self.queued_since
            self.queued_since = -1.0

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.spec.arrival_s if self.first_token_at >= 0 else -1.0

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.spec.arrival_s if self.finished_at >= 0 else -1.0

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for one-token answers)."""
        if self.first_token_at < 0 or self.generated < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (self.generated - 1)
