"""An engine's launch configuration: SGLang's launch flags where they mean something here,
plus the reference engine's own knobs (timing profile, speed factor, token backend)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from fleetsim.engine.timing import TimingModel
from fleetsim.engine.tokens import DEFAULT_EOS_PER_MILLE

# SGLang clips each request's remaining output at this many tokens when it estimates growth.
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an `EngineModel` (and the server around it) is launched with.

    `None` means "automatic", as in SGLang: `max_total_tokens` from the timing profile's
    memory, `context_length` from the model profile, `max_running_requests` from the pool.
    """

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    context_length: int | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    chunked_prefill_size: int = 8192  # -1 disables chunking
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    # Weir's execution fairness: a chunked prefill yields to shorter ones at chunk
    # boundaries, but never more than `prefill_max_yields` times in a row (aging).
    prefill_yield: bool = False
    prefill_max_yields: int = 4
    prefill_time_budget_s: float | None = None
    # Priority aging: a waiting request gains one priority level per this many seconds.
    priority_aging_s: float | None = None
    # SGLang's new-token ratio: starts at init, decays linearly to init*min_factor over
    # `decay_steps` decode steps, jumps back to init after a retraction or when idle.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    decode_log_interval: int = 40
    # SGLang's --incremental-streaming-output: /generate stream chunks carry only new
    # text and ids instead of everything so far.
    incremental_streaming_output: bool = False
    enable_metrics: bool = True
    timing: TimingModel = field(default_factory=TimingModel)
    speed_factor: float = 1.0
    # Seconds (real time) the server reports "starting" (/health 503) after it listens,
    # like SGLang loading weights and warming up.
    startup_s: float = 0.0
    token_backend: Literal["hash", "torch"] = "hash"
    eos_per_mille: float = DEFAULT_EOS_PER_MILLE
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.page_size < 1:
            problems.append("page_size must be at least 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            problems.append("chunked_prefill_size must be positive or -1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            problems.append("max_total_tokens must hold at least one page")
        if self.context_length is not None and self.context_length < 2:
            problems.append("context_length must be at least 2")
        for name in ("max_running_requests", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be at least 1")
        if not self.startup_s >= 0:
            problems.append("startup_s must not be negative")
        if not self.speed_factor > 0:
            problems.append("speed_factor must be positive")
        if self.prefill_max_yields < 0:
            problems.append("prefill_max_yields must not be negative")
        if problems:
            raise ValueError("; ".join(problems))

    # -- resolved values ---------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        """KV capacity in tokens, a whole number of pages (SGLang's max_total_num_tokens)."""
        tokens = self.max_total_tokens or self.timing.kv_capacity_tokens()
        return tokens // self.page_size * self.page_size

    @property
    def context_len(self) -> int:
        return self.context_length or self.timing.model.context_length

    @property
    def running_limit(self) -> int:
        """SGLang sizes the running batch from the pool when not given; so do we."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        return max(1, min(4096, self.total_tokens // 2))

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_len - 1, self.total_tokens - 1)

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
