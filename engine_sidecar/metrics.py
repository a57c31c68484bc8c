"""The sidecar's `weir_sidecar_*` metrics, exactly as controlplane/telemetry/catalog.py
names them.

Counters and histograms are updated as things happen. Gauges are read from the ledger when
Prometheus scrapes, so the streaming hot path never touches a gauge.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.contract import PreemptionMode, WatermarkState
from controlplane.store import QuotaHolder
from controlplane.telemetry.catalog import SIDECAR, MetricKind
from controlplane.transport.guard import LIMITS
from engine_sidecar.ledger import Ledger

_SPECS = {spec.name: spec for spec in SIDECAR}
_EP = ("pool", "endpoint")
# Label values known in advance are exported at zero from the start, so a dashboard shows
# "none happened" instead of "no data" (and rate() has a baseline when the first one does).
_KNOWN_LABELS = {
    "weir_sidecar_admission_rejections_total": (
        "too_large",
        "queue_full",
        "queue_timeout",
        "draining",
        "tenant_kv_quota",
    ),
    "weir_sidecar_kv_quota_charges_total": ("granted", "refused", "unavailable"),
    "weir_sidecar_preemptions_total": tuple(mode.value for mode in PreemptionMode),
    "weir_sidecar_migration_reservations_total": ("taken", "refused", "consumed", "expired"),
    "weir_sidecar_client_limits_total": LIMITS,
}
# Active-sequence series stay (at zero) for the (priority, tenant) pairs seen, up to this
# many, so a tenant's line drops to zero when it goes idle instead of vanishing.
_REMEMBERED_SEQUENCE_KEYS = 256


class _Gauges(Collector):
    """Gauges computed from the ledger at scrape time."""

    def __init__(self, ledger: Ledger, pool: str, endpoint: str) -> None:
        self._ledger = ledger
        self._ep = (pool, endpoint)
        self._seen: set[tuple[str, str]] = set()
        self.quota_book: QuotaHolder | None = None  # the KV quota's, once linked

    def _family(self, name: str) -> GaugeMetricFamily:
        spec = _SPECS[name]
        return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))

    def remember(self, key: tuple[str, str]) -> None:
        """Keep exporting (priority, tenant) at zero once its sequences are gone."""
        if len(self._seen) < _REMEMBERED_SEQUENCE_KEYS:
            self._seen.add(key)

    def collect(self) -> Iterator[Metric]:
        ledger, ep = self._ledger, list(self._ep)
        active = self._family("weir_sidecar_active_sequences")
        counts = dict.fromkeys(self._seen, 0)
        for flight in ledger.flights.values():
            if flight.kv:
                key = (str(flight.record.priority), flight.record.tenant)
                counts[key] = counts.get(key, 0) + 1
        for key in counts:
            self.remember(key)
        for (priority, tenant), n in sorted(counts.items()):
            active.add_metric([*ep, priority, tenant], n)
        yield active
        for name, value in (
            ("weir_sidecar_kv_used_tokens", ledger.used_tokens),
            ("weir_sidecar_kv_reserved_growth_tokens", ledger.reserved),
            ("weir_sidecar_kv_held_for_migrations_tokens", ledger.held_tokens),
            ("weir_sidecar_kv_capacity_tokens", ledger.capacity_tokens),
            ("weir_sidecar_kv_growth_tokens_per_second", ledger.growth.tokens_per_s),
            ("weir_sidecar_waiting_prefill_tokens", ledger.waiting_prefill),
            ("weir_sidecar_predicted_tpot_seconds", ledger.latency.predicted_tpot_s(ledger.load())),
            ("weir_sidecar_prefill_wait_age_seconds", ledger.oldest_wait_s()),
            ("weir_sidecar_prompt_bytes_per_token", ledger.prompt_sizer.bytes_per_token),
            (
                "weir_sidecar_quota_releases_pending",
                book.pending if (book := self.quota_book) else 0,
            ),
        ):
            family = self._family(name)
            family.add_metric(ep, float(value))
            yield family
        watermark = self._family("weir_sidecar_watermark_state")
        for state in WatermarkState:
            watermark.add_metric([*ep, state.value], 1.0 if state is ledger.watermark else 0.0)
        yield watermark


class SidecarMetrics:
    """Every sidecar family of the catalogue, bound to one endpoint."""

    def __init__(self, ledger: Ledger, pool: str, endpoint: str) -> None:
        self.registry = CollectorRegistry()
        self.pool, self.endpoint = pool, endpoint
        self._gauges = _Gauges(ledger, pool, endpoint)
        self.registry.register(self._gauges)
        self._counters: dict[str, Counter] = {}
        self._histograms: dict[str, Histogram] = {}
        # Label children by (family, labels): a request's updates skip prometheus-client's
        # label lookup. Label values are bounded (reasons, modes, length buckets).
        self._counted: dict[tuple[str, tuple[str, ...]], Counter] = {}
        self._observed: dict[tuple[str, tuple[str, ...]], Histogram] = {}
        for spec in SIDECAR:
            if spec.kind is MetricKind.COUNTER:
                self._counters[spec.name] = Counter(
                    spec.name, spec.help, spec.labels, registry=self.registry
                )
            elif spec.kind is MetricKind.HISTOGRAM:
                self._histograms[spec.name] = Histogram(
                    spec.name, spec.help, spec.labels, registry=self.registry, buckets=spec.buckets
                )
            if spec.labels == _EP and spec.kind is not MetricKind.GAUGE:
                # No further labels: export the series (at zero) from the start.
                family = self._counters.get(spec.name) or self._histograms[spec.name]
                family.labels(pool, endpoint)
            for value in _KNOWN_LABELS.get(spec.name, ()):
                self._counters[spec.name].labels(pool, endpoint, value)

    def watch_quota(self, book: QuotaHolder) -> None:
        """Export the releases this quota holder has not got Redis to take yet."""
        self._gauges.quota_book = book

    def sequence_ended(self, priority: int, tenant: str) -> None:
        """A sequence that ran here ended, perhaps between two scrapes: its active-sequence
        series must still exist (at zero) for dashboards."""
        self._gauges.remember((str(priority), tenant))

    def count(self, name: str, *labels: str, amount: float = 1.0) -> None:
        child = self._counted.get((name, labels))
        if child is None:
            child = self._counted[name, labels] = self._counters[name].labels(
                self.pool, self.endpoint, *labels
            )
        child.inc(amount)

    def observe(self, name: str, value: float, *labels: str) -> None:
        child = self._observed.get((name, labels))
        if child is None:
            child = self._observed[name, labels] = self._histograms[name].labels(
                self.pool, self.endpoint, *labels
            )
        child.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
