"""The pool policy: what the operator renders from an InferencePool spec into a ConfigMap,
and what sidecars and routers obey. Mirrors the CRD's spec sections (see crds/)."""

from __future__ import annotations

import enum
import math

import msgspec

from controlplane.contract.models import SCHEMA_VERSION, Role, TenantQuota


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"
    MIGRATE = "migrate"
    OFFLOAD = "offload"


class KVPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Watermarks are fractions of KV capacity: normal < low <= pressure < high <= critical
    < emergency <= exhausted. `hysteresis` is how far usage must fall below a threshold
    before the state steps down. The growth reserve covers the running sequences' growth
    over `growth_horizon_steps` decode steps, bounded by each one's remaining tokens and
    the `growth_quantile` of predicted output length."""

    page_size: int = 16
    low_watermark: float = 0.70
    high_watermark: float = 0.85
    emergency_watermark: float = 0.95
    hysteresis: float = 0.03
    headroom_tokens: int = 0
    growth_horizon_steps: int = 256
    growth_quantile: float = 0.9

    def safety_tokens(self, capacity_tokens: int) -> int:
        """The KV a sidecar never admits into: the band above the emergency watermark plus
        the absolute headroom."""
        return int(capacity_tokens * (1.0 - self.emergency_watermark)) + self.headroom_tokens


class SchedulingPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How engines schedule and sidecars admit. `target_tpot_s` is the pool's TPOT
    objective: while a request the sidecar admitted still waits for its first token and
    its engine's predicted TPOT is above it, the sidecar admits nothing new (the request
    waits in its queue, at most `local_queue_max_wait_s`). 0 turns the gate off; a
    prefill or decode pool's engines have no such gate."""

    chunked_prefill_size: int = 8192
    max_running_requests: int = 0
    priority_scheduling: bool = True
    aging_per_second: float = 1.0
    preemption_modes: tuple[PreemptionMode, ...] = (
        PreemptionMode.RECOMPUTE,
        PreemptionMode.MIGRATE,
    )
    max_preemptions_per_request: int = 3
    overload_may_abort: bool = False
    local_queue_size: int = 256
    local_queue_max_wait_s: float = 30.0
    target_tpot_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.target_tpot_s < math.inf:
            raise ValueError(
                f"scheduling.target_tpot_s must be a number >= 0, got {self.target_tpot_s}"
            )


class RoutingPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How routers place requests. The dispatch limits are the router's fair queue
    (`queue_capacity_per_band` requests per priority, each waiting at most
    `queue_max_wait_s` for an endpoint with room), the endpoints a request is offered to
    before its first byte (`max_attempts`), and how long a stream handed back mid-answer
    waits for an endpoint to resume it (`resume_wait_s`): at the router, its time there
    with no endpoint to take it (over all its spells), and in one sidecar's queue, before
    that sidecar gives it back to the router. Time queued at an endpoint, as accepted
    work, is not counted against the router's wait: a stream is lost for want of an
    endpoint, never for waiting behind streams that keep their room."""

    prefix_block_tokens: int = 64
    prefix_blocks_for_owner: int = 4
    virtual_nodes: int = 128
    bounded_load_factor: float = 1.25
    max_affinity_wait_s: float = 2.0
    tenant_isolated_cache: bool = False
    snapshot_staleness_s: float = 10.0
    queue_capacity_per_band: int = 256
    queue_max_wait_s: float = 30.0
    max_attempts: int = 3
    resume_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.queue_capacity_per_band < 1 or self.max_attempts < 1:
            raise ValueError(
                "routing.queue_capacity_per_band and routing.max_attempts must be >= 1, got "
                f"{self.queue_capacity_per_band} and {self.max_attempts}"
            )
        if not (0 < self.queue_max_wait_s < math.inf and 0 <= self.resume_wait_s < math.inf):
            raise ValueError(
                "routing.queue_max_wait_s must be a positive number and routing.resume_wait_s "
                f"a number >= 0, got {self.queue_max_wait_s} and {self.resume_wait_s}"
            )


class AutoscalingPolicy(msgspec.Struct, frozen=True, kw_only=True):
    enabled: bool = False
    target_kv_pressure: float = 0.75
    target_waiting_prefill_tokens: int = 16384
    target_ttft_s: float = 1.0
    scale_up_stabilization_s: float = 30.0
    scale_down_stabilization_s: float = 300.0


class PoolPolicy(msgspec.Struct, frozen=True, kw_only=True):
    schema: int = SCHEMA_VERSION
    pool: str
    model: str
    role: Role = Role.MIXED
    decode_pool: str = ""
    context_length: int = 32768
    kv: KVPolicy = msgspec.field(default_factory=KVPolicy)
    scheduling: SchedulingPolicy = msgspec.field(default_factory=SchedulingPolicy)
    routing: RoutingPolicy = msgspec.field(default_factory=RoutingPolicy)
    autoscaling: AutoscalingPolicy = msgspec.field(default_factory=AutoscalingPolicy)
    tenants: tuple[TenantQuota, ...] = ()

    def __post_init__(self) -> None:
        kv = self.kv
        if not 0.0 < kv.low_watermark < kv.high_watermark < kv.emergency_watermark <= 1.0:
            raise ValueError(
                "kv watermarks must satisfy 0 < low < high < emergency <= 1, got "
                f"low={kv.low_watermark} high={kv.high_watermark} emergency={kv.emergency_watermark}"
            )
        if self.role is Role.PREFILL and not self.decode_pool:
            raise ValueError("a prefill pool must name its decode pool")

    def tenant(self, name: str) -> TenantQuota | None:
        for quota in self.tenants:
            if quota.name == name:
                return quota
        return None
