"""An engine's launch configuration: SGLang's launch flags where they mean something here,
plus the reference engine's own knobs (timing profile, speed factor, token backend)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Final, Literal

from fleetsim.engine.timing import TimingModel
from fleetsim.engine.tokens import DEFAULT_EOS_PER_MILLE

# SGLang clips each request's remaining output at this many tokens when it estimates growth
# (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, sglang/srt/managers/schedule_policy.py).
CLIP_MAX_NEW_TOKENS: Final = 4096

SGLangVersion = Literal["0.5.5", "0.5.23"]
DisaggregationMode = Literal["null", "prefill", "decode"]
# SGLang's --disaggregation-transfer-backend choices; the reference engine moves KV over
# loopback HTTP whichever is named, and reports the name.
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl", "ascend", "fake", "mori")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an `EngineModel` (and the server around it) is launched with.

    `None` means "automatic", as in SGLang: `max_total_tokens` from the timing profile's
    memory, `context_length` from the model profile, `max_running_requests` from the pool.
    """

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    # Whose scheduler details to follow where the two versions differ (the page charged
    # per admission, ignore_eos reservations, max_new_tokens clipped to memory); the
    # server sets it to the HTTP surface it speaks.
    sglang_version: SGLangVersion = "0.5.23"
    context_length: int | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    chunked_prefill_size: int = 8192  # -1 disables chunking
    max_prefill_tokens: int = 16384  # new tokens one prefill batch may take
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    # With priority scheduling, a newcomer at the running limit preempts running requests
    # whose priority is more than this threshold below its own.
    disable_priority_preemption: bool = False
    priority_scheduling_preemption_threshold: int = 10
    retraction_policy: Literal["length", "priority"] = "length"
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    disable_radix_cache: bool = False
    # SGLang's hierarchical cache: a host pool `hicache_ratio` times the device pool, or
    # `hicache_size` GB when that is given; pages copied to it on eviction (write_back)
    # or as they are cached (write_through, SGLang's default; write_through_selective is
    # not modelled).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: Literal["write_back", "write_through", "write_through_selective"] = (
        "write_back"
    )
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
    # P/D disaggregation (SGLang's --disaggregation-*): a prefill engine computes prompts
    # and first tokens and ships their KV from its bootstrap server; a decode engine
    # preallocates pages for a prompt, waits for its KV and decodes. The transfer takes
    # the KV's bytes over `kv_link_bytes_per_s` (None: the hardware profile's link).
    disaggregation_mode: DisaggregationMode = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    num_reserved_decode_tokens: int = 512
    kv_link_bytes_per_s: float | None = None
    # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: how long either side waits for its peer.
    bootstrap_timeout_s: float = 300.0
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
        if self.max_prefill_tokens < 1:
            problems.append("max_prefill_tokens must be at least 1")
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            problems.append("retraction_policy priority requires enable_priority_scheduling")
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
        if self.enable_hierarchical_cache:
            problems += self._hicache_problems()
        if self.disaggregation_mode != "null":
            problems += self._disaggregation_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _hicache_problems(self) -> list[str]:
        problems = []
        if self.disable_radix_cache:
            problems.append("the hierarchical cache needs the radix cache")
        if self.token_backend != "hash":
            problems.append("the hierarchical cache is modelled with the hash backend only")
        if self.hicache_write_policy == "write_through_selective":
            problems.append(
                "hicache_write_policy: write_back and write_through are modelled, "
                "not write_through_selective"
            )
        if not self.hicache_ratio > 0:
            problems.append("hicache_ratio must be positive")
        if self.hicache_size < 0:
            problems.append("hicache_size must not be negative")
        return problems

    def _disaggregation_problems(self) -> list[str]:
        problems = []
        if self.disaggregation_mode not in ("prefill", "decode"):
            problems.append(
                f"disaggregation_mode must be null, prefill or decode, got "
                f"{self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            problems.append(
                f"disaggregation_transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}"
            )
        if self.disaggregation_mode == "prefill" and self.disaggregation_transfer_backend == "fake":
            # As SGLang: the fake backend is a decode-only benchmark harness.
            problems.append("Prefill server does not support 'fake' as the transfer backend")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            problems.append("disaggregation_bootstrap_port must be a TCP port (0: a free one)")
        if self.num_reserved_decode_tokens < 0:
            problems.append("num_reserved_decode_tokens must not be negative")
        if self.kv_link_bytes_per_s is not None and not self.kv_link_bytes_per_s > 0:
            problems.append("kv_link_bytes_per_s must be positive")
        if not self.bootstrap_timeout_s > 0:
            problems.append("bootstrap_timeout_s must be positive")
        if self.enable_hierarchical_cache and self.disaggregation_mode == "decode":
            problems.append("the hierarchical cache is not modelled on a decode engine")
        return problems

    # -- resolved values ---------------------------------------------------------------
    @property
    def host_total_tokens(self) -> int:
        """Host pool capacity in tokens, whole pages: 0 without the hierarchical cache."""
        if not self.enable_hierarchical_cache:
            return 0
        if self.hicache_size > 0:
            tokens = int(self.hicache_size * 1e9 // self.timing.model.kv_bytes_per_token)
        else:
            tokens = int(self.total_tokens * self.hicache_ratio)
        return tokens // self.page_size * self.page_size

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
        """SGLang's request slots: 512 per context length of pool, within [2048, 4096] when
        not given, and never more than half the pool's tokens (resolve_max_num_reqs in
        sglang/srt/mem_cache/kv_cache_configurator.py)."""
        capacity = self.total_tokens
        if self.max_running_requests is not None:
            return max(1, min(self.max_running_requests, capacity // 2))
        estimated = max(min(int(capacity / self.context_len * 512), 4096), 2048)
        return max(1, min(estimated, capacity // 2))

    @property
    def max_req_len(self) -> int:
        """Prompt plus output a request may reach (sglang/srt/managers/tp_worker.py)."""
        return min(self.context_len - 1, self.total_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    @property
    def priority_preemption(self) -> bool:
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
