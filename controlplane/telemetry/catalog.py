"""Metric families, by component (docs/metrics.md lists them for users)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MetricKind(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def series_names(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind is MetricKind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FAST_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.05,
)
MS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)

_G, _C, _H = MetricKind.GAUGE, MetricKind.COUNTER, MetricKind.HISTOGRAM
_EP = ("pool", "endpoint")
_LEN = ("input_bucket", "output_bucket")
_LENGTH_BOUNDS = (256, 1024, 4096, 16384)
LENGTH_BUCKETS = (*(f"le{bound}" for bound in _LENGTH_BOUNDS), f"gt{_LENGTH_BOUNDS[-1]}")
"""Every value of `input_bucket` and `output_bucket`, shortest first."""


def length_bucket(tokens: int) -> str:
    """The `input_bucket`/`output_bucket` of a length in tokens, the same at every hop so
    that router and sidecar series join: powers of four, so the series count stays small."""
    for bound, name in zip(_LENGTH_BOUNDS, LENGTH_BUCKETS, strict=False):
        if tokens <= bound:
            return name
    return LENGTH_BUCKETS[-1]


# Families both components export, under their own prefix.
_RELEASES_PENDING = (
    "Tenant quota releases Redis has not taken yet (it was unreachable, or failing over): "
    "each is sent again until Redis takes it; meanwhile the tenant's usage reads high by "
    "what they hold, so a tenant near its quota may be refused."
)
_CLIENT_LIMITS = (
    "Client connections closed, or request bodies refused, by one of this server's limits "
    "(docs/security.md): header_timeout, idle_timeout, too_many_connections, "
    "body_too_large, body_too_complex, body_timeout, body_budget."
)

SIDECAR: tuple[MetricSpec, ...] = (
    MetricSpec(
        "weir_sidecar_active_sequences",
        _G,
        "Sequences held by the engine, by priority and tenant.",
        (*_EP, "priority", "tenant"),
    ),
    MetricSpec(
        "weir_sidecar_kv_used_tokens",
        _G,
        "KV tokens in use (prompt + generated of live requests).",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_kv_reserved_growth_tokens",
        _G,
        "KV tokens reserved for near-term growth of running sequences.",
        _EP,
    ),
    MetricSpec("weir_sidecar_kv_capacity_tokens", _G, "KV pool capacity in tokens.", _EP),
    MetricSpec("weir_sidecar_kv_growth_tokens_per_second", _G, "Smoothed KV growth rate.", _EP),
    MetricSpec(
        "weir_sidecar_watermark_state",
        _G,
        "1 for the endpoint's current watermark state, 0 for the others.",
        (*_EP, "state"),
    ),
    MetricSpec(
        "weir_sidecar_waiting_prefill_tokens",
        _G,
        "Prompt tokens admitted but not yet prefilled.",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_predicted_tpot_seconds",
        _G,
        "The latency model's TPOT for a request reaching the engine now. Above the pool's "
        "scheduling.targetTpotS while a prefill is pending, new requests wait in the "
        "sidecar queue (the TPOT gate).",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_prefill_yields_total",
        _C,
        "Times a long prefill yielded at a chunk boundary.",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_prefill_wait_age_seconds", _G, "Age of the oldest waiting prefill.", _EP
    ),
    MetricSpec(
        "weir_sidecar_preemptions_total",
        _C,
        "Preemptions by mode (recompute, migrate, offload).",
        (*_EP, "mode"),
    ),
    MetricSpec(
        "weir_sidecar_recomputed_tokens_total",
        _C,
        "Tokens re-prefilled because of preemption.",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_offloaded_tokens_total",
        _C,
        "Tokens resumed from the engine's host tier instead of re-prefilled (offloads).",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_migration_reservations_total",
        _C,
        "Room held here for continuations other sidecars migrate here, by outcome: taken, "
        "refused (no room), consumed (the continuation arrived and took it), expired (it "
        "did not arrive in time; the room returned).",
        (*_EP, "outcome"),
    ),
    MetricSpec(
        "weir_sidecar_kv_held_for_migrations_tokens",
        _G,
        "KV tokens held for continuations migrating here (committed until they arrive or "
        "their reservation expires).",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_transferred_bytes_total",
        _C,
        "KV or continuation bytes moved to another endpoint.",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_admission_rejections_total",
        _C,
        "Local admission refusals by reason.",
        (*_EP, "reason"),
    ),
    MetricSpec(
        "weir_sidecar_kv_quota_charges_total",
        _C,
        "KV quota charges by result: granted, refused, unavailable (Redis did not answer; "
        "the request was admitted on local admission alone and its charge is released "
        "when it leaves, in case it landed).",
        (*_EP, "result"),
    ),
    MetricSpec(
        "weir_sidecar_prompt_bytes_per_token",
        _G,
        "The engine's bytes per token over the text prompts it has counted, by which the "
        "sidecar sizes a text prompt before the engine says its size (1 until it has "
        "counted one).",
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_quota_releases_pending",
        _G,
        _RELEASES_PENDING,
        _EP,
    ),
    MetricSpec(
        "weir_sidecar_client_limits_total",
        _C,
        _CLIENT_LIMITS,
        (*_EP, "limit"),
    ),
    MetricSpec(
        "weir_sidecar_requests_finished_total",
        _C,
        "Requests ended, by finish reason.",
        (*_EP, "reason"),
    ),
    MetricSpec(
        "weir_sidecar_cancel_to_freed_ms",
        _H,
        "Milliseconds from client cancel to engine KV freed.",
        _EP,
        MS_BUCKETS,
    ),
    MetricSpec(
        "weir_sidecar_output_length_prediction_error_tokens",
        _H,
        "Absolute error of the output-length predictor.",
        _EP,
        (16, 64, 256, 1024, 4096, 16384),
    ),
    MetricSpec(
        "weir_sidecar_latency_prediction_error_ratio",
        _H,
        "Absolute percentage error of the latency model (absolute error over the observed "
        "value) per request that finished undisturbed: measure ttft (arrival at the sidecar "
        "to the first token) or tpot.",
        (*_EP, "measure"),
        (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    ),
    MetricSpec(
        "weir_sidecar_ttft_seconds",
        _H,
        "Time to first token at the sidecar.",
        (*_EP, *_LEN),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "weir_sidecar_tpot_seconds",
        _H,
        "Time per output token at the sidecar.",
        (*_EP, *_LEN),
        (*FAST_BUCKETS, 0.1, 0.25, 0.5),
    ),
    MetricSpec(
        "weir_sidecar_e2e_seconds",
        _H,
        "End-to-end request latency at the sidecar.",
        (*_EP, *_LEN),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "weir_sidecar_heartbeats_total",
        _C,
        "Heartbeats written, by result (ok, fenced, error).",
        (*_EP, "result"),
    ),
    MetricSpec(
        "weir_sidecar_state_publish_delay_seconds",
        _H,
        "Delay from a KV state change to its publication.",
        _EP,
        LATENCY_BUCKETS,
    ),
)

ROUTER: tuple[MetricSpec, ...] = (
    MetricSpec(
        "weir_router_decision_seconds", _H, "Routing decision latency.", ("pool",), FAST_BUCKETS
    ),
    MetricSpec(
        "weir_router_decisions_total",
        _C,
        "Routing decisions by reason (primary_owner, secondary_owner, least_cost, "
        "reserved_target; a refusal's reason when nothing was picked) and whether the "
        "primary owner was picked.",
        ("pool", "reason", "owner_hit"),
    ),
    MetricSpec(
        "weir_router_retries_total",
        _C,
        "Requests retried on another endpoint before the first byte, by reason: the "
        "endpoint's 429 or 503, how the call failed (connect_error, connect_timeout, "
        "pool_timeout, read_timeout, protocol_error, connection_closed), or which leg of a "
        "P/D pair failed (prefill_failed, decode_failed).",
        ("pool", "reason"),
    ),
    MetricSpec(
        "weir_router_resumes_total",
        _C,
        "Streams resumed as a continuation after an engine failure or migration.",
        ("pool", "reason"),
    ),
    MetricSpec(
        "weir_router_overloads_total",
        _C,
        "Requests refused with overload, by reason.",
        ("pool", "reason"),
    ),
    MetricSpec(
        "weir_router_queue_seconds",
        _H,
        "Time spent in the router's fair queue.",
        ("pool", "priority"),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "weir_router_ttft_seconds",
        _H,
        "Time to first token at the router.",
        ("pool", "tenant", *_LEN),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "weir_router_tpot_seconds",
        _H,
        "Time per output token at the router.",
        ("pool", "tenant", *_LEN),
        (*FAST_BUCKETS, 0.1, 0.25, 0.5),
    ),
    MetricSpec(
        "weir_router_e2e_seconds",
        _H,
        "End-to-end latency at the router.",
        ("pool", "tenant", *_LEN),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "weir_router_requests_total",
        _C,
        "Requests by tenant and finish reason.",
        ("pool", "tenant", "reason"),
    ),
    MetricSpec(
        "weir_router_tokens_total",
        _C,
        "Tokens by tenant and direction (input, output).",
        ("pool", "tenant", "direction"),
    ),
    MetricSpec(
        "weir_router_kv_token_seconds_total",
        _C,
        "KV token-seconds consumed, by tenant.",
        ("pool", "tenant"),
    ),
    MetricSpec(
        "weir_router_quota_utilization_ratio",
        _G,
        "Fraction of each tenant quota in use, by resource.",
        ("pool", "tenant", "resource"),
    ),
    MetricSpec(
        "weir_router_endpoints",
        _G,
        "Endpoints in the router's snapshot, by lifecycle and watermark state.",
        ("pool", "lifecycle", "watermark"),
    ),
    MetricSpec(
        "weir_router_endpoint_kv_tokens",
        _G,
        "Per-endpoint KV from the snapshot, by kind (used, reserved, capacity).",
        ("pool", "endpoint", "kind"),
    ),
    MetricSpec(
        "weir_router_ring_version", _G, "Membership version of the ownership ring.", ("pool",)
    ),
    MetricSpec(
        "weir_router_snapshot_age_seconds", _G, "Age of the router's pool snapshot.", ("pool",)
    ),
    MetricSpec(
        "weir_router_lease_expiries_total",
        _C,
        "Endpoints removed from routing because their lease expired.",
        ("pool",),
    ),
    MetricSpec(
        "weir_router_handoff_credits_total",
        _C,
        "A prefill pool's decode handoff credits: taken before a P/D pair starts (refused "
        "when the decode class has no room), consumed when its KV lands on the decode "
        "side, released when the pair fails or its client leaves first, expired when "
        "consumed too late, unreachable when Redis did not answer the settling (the "
        "credit then expires on its own).",
        ("pool", "outcome"),
    ),
    MetricSpec("weir_router_quota_releases_pending", _G, _RELEASES_PENDING, ("pool",)),
    MetricSpec("weir_router_client_limits_total", _C, _CLIENT_LIMITS, ("pool", "limit")),
)

CATALOG: tuple[MetricSpec, ...] = SIDECAR + ROUTER


def metric_names() -> frozenset[str]:
    """Every sample name Weir can export (histograms expand to _bucket/_sum/_count)."""
    return frozenset(name for spec in CATALOG for name in spec.series_names())


def render_markdown() -> str:
    """docs/metrics.md, generated from the catalogue (a test keeps the file current)."""
    lines = [
        "# Metrics",
        "",
        "Every metric family Weir exports, generated from `controlplane/telemetry/catalog.py`",
        "(`python -m controlplane.telemetry > docs/metrics.md`). Dashboards query only these.",
    ]
    for title, specs in (("Sidecar (`weir sidecar`)", SIDECAR), ("Router (`weir router`)", ROUTER)):
        lines += ["", f"## {title}", "", "| name | type | labels | meaning |", "|---|---|---|---|"]
        lines += [
            f"| `{s.name}` | {s.kind} | {', '.join(f'`{label}`' for label in s.labels)} | {s.help} |"
            for s in specs
        ]
    values = ", ".join(f"`{name}`" for name in LENGTH_BUCKETS)
    lines += [
        "",
        "## Length buckets",
        "",
        "`input_bucket` (the prompt's tokens) and `output_bucket` take the same values at the",
        f"router and the sidecar, so their series join: {values}.",
        "At the router `output_bucket` counts the tokens the client received; at the sidecar,",
        "the tokens the request asked for (`max_new_tokens`: its time to first token is",
        "observed before the output is known). The sidecar's values were `le1k`, `le4k`,",
        "`le16k` and `gt16k` before they were shared: a query or recording rule that names",
        "those needs the new ones.",
    ]
    return "\n".join(lines) + "\n"
