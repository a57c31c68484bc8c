"""The router's metric families, built from the catalogue so names, labels and buckets
never drift from `controlplane.telemetry.catalog.ROUTER` (a test asserts every family is
exported). Each router owns its registry, so several can run in one process.

Event counters start at zero for every label value the router can produce (standard
Prometheus practice): a series that only appears after its first event makes rates and
dashboards show "no data" instead of 0, and `increase()` misses that first event.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from controlplane.telemetry.catalog import ROUTER, MetricKind
from controlplane.transport import TRANSPORT_REASONS
from controlplane.transport.guard import LIMITS

# The label values the router produces, by family (reasons are the `reason` of its
# refusals: `controlplane.router.errors`, the quota store's limits, the fair queue; a
# retry's, the upstream's status or the transport failure's kind).
RETRY_REASONS = ("upstream_429", "upstream_503", *TRANSPORT_REASONS)
RESUME_REASONS = ("broken", "preempted")
OVERLOAD_REASONS = (
    "queue_full",
    "queue_timeout",
    "endpoints_overloaded",
    "snapshot_stale",
    "concurrency",
    "input_tokens",
    "output_tokens",
    "class_capacity",
)
HANDOFF_OUTCOMES = ("taken", "refused", "consumed", "released", "expired", "unreachable")
DEFAULT_PRIORITY = "0"


class RouterMetrics:
    def __init__(self, pool: str) -> None:
        self.registry = CollectorRegistry()
        self._families: dict[str, Any] = {}
        for spec in ROUTER:
            if spec.kind is MetricKind.COUNTER:
                family: Any = Counter(spec.name, spec.help, spec.labels, registry=self.registry)
            elif spec.kind is MetricKind.GAUGE:
                family = Gauge(spec.name, spec.help, spec.labels, registry=self.registry)
            else:
                family = Histogram(
                    spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry
                )
            self._families[spec.name] = family
        f = self._families
        self.decision_seconds = f["weir_router_decision_seconds"]
        self.decisions = f["weir_router_decisions_total"]
        self.retries = f["weir_router_retries_total"]
        self.resumes = f["weir_router_resumes_total"]
        self.overloads = f["weir_router_overloads_total"]
        self.queue_seconds = f["weir_router_queue_seconds"]
        self.ttft = f["weir_router_ttft_seconds"]
        self.tpot = f["weir_router_tpot_seconds"]
        self.e2e = f["weir_router_e2e_seconds"]
        self.requests = f["weir_router_requests_total"]
        self.tokens = f["weir_router_tokens_total"]
        self.kv_token_seconds = f["weir_router_kv_token_seconds_total"]
        self.quota_utilization = f["weir_router_quota_utilization_ratio"]
        self.endpoints = f["weir_router_endpoints"]
        self.endpoint_kv = f["weir_router_endpoint_kv_tokens"]
        self.ring_version = f["weir_router_ring_version"]
        self.snapshot_age = f["weir_router_snapshot_age_seconds"]
        self.lease_expiries = f["weir_router_lease_expiries_total"]
        self.handoff_credits = f["weir_router_handoff_credits_total"]
        self.quota_releases_pending = f["weir_router_quota_releases_pending"]
        self.client_limits = f["weir_router_client_limits_total"]
        for family, reasons in (
            (self.retries, RETRY_REASONS),
            (self.resumes, RESUME_REASONS),
            (self.overloads, OVERLOAD_REASONS),
            (self.client_limits, LIMITS),
            (self.handoff_credits, HANDOFF_OUTCOMES),
        ):
            for reason in reasons:
                family.labels(pool, reason)
        self.lease_expiries.labels(pool)
        self.quota_releases_pending.labels(pool)
        self.queue_seconds.labels(pool, DEFAULT_PRIORITY)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
