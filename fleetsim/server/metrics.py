"""SGLang's Prometheus metrics: the families Weir reads, with the names, types, labels and
buckets each version's server gives them (0.5.23: sglang/srt/observability/
metrics_collector.py; 0.5.5: sglang/srt/metrics/collector.py), and SGLang's refresh
cadence. tests/sglang/test_reference_fidelity.py holds them to a real server's /metrics;
docs/reference-engine.md lists the families left out.

Scheduler gauges are refreshed only on prefill iterations, every `decode_log_interval`
decode iterations and when the engine goes idle, as SGLang's scheduler does: readers must
treat them as possibly stale. Counters and latency histograms move as requests produce
and finish (tokenizer-side in SGLang), so they are always current.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetsim.engine import EngineModel, EngineRequest

_TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0,
)  # fmt: skip
_E2E_BUCKETS = (*_TTFT_BUCKETS, 600.0, 1200.0, 1800.0, 2400.0)
_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
_QUEUE_TAIL = (
    1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0,
    100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0, 1400.0,
    1600.0, 1800.0, 2000.0, 2500.0, 3000.0,
)  # fmt: skip
_QUEUE_BUCKETS = {
    "0.5.5": (0.0, 0.1, 0.2, 0.5, *_QUEUE_TAIL),
    "0.5.23": (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, *_QUEUE_TAIL),
}
_RETRACTION_BUCKETS = (
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0,
    50.0, 75.0, 100.0,
)  # fmt: skip

_GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_used_tokens": "The number of used tokens.",
    "token_usage": "The token usage.",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
}
_GAUGES_0523 = {
    "kv_used_tokens": "KV cache tokens in use.",
    "kv_available_tokens": "KV cache tokens free.",
    "kv_evictable_tokens": "KV cache tokens held only by the prefix cache.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "page_size": "The page size of the KV cache.",
    "new_token_ratio": "The new token ratio.",
}
# The hierarchical cache's gauges (0.5.23, only with --enable-hierarchical-cache).
_HICACHE_GAUGES = {
    "hicache_host_used_tokens": "Number of tokens currently used in the host KV cache.",
    "hicache_host_total_tokens": "Total capacity of the host KV cache in tokens.",
}
# Per-process gauges (prometheus_client's multiprocess mode "all"): SGLang's carry a pid.
_PROCESS_GAUGES = {
    "num_retracted_reqs": "The number of retracted requests.",
    "num_paused_reqs": "The number of paused requests by async weight sync.",
}


# P/D (sglang/srt/observability/metrics_collector.py): the queue gauges and the transfer
# histograms, served here only by a prefill or decode engine.
_PD_GAUGES = {
    "num_prefill_bootstrap_queue_reqs": "The number of requests in the prefill bootstrap queue.",
    "num_prefill_inflight_queue_reqs": "The number of requests in the prefill inflight queue.",
    "num_decode_prealloc_queue_reqs": "The number of requests in the decode prealloc queue.",
    "num_decode_transfer_queue_reqs": "The number of requests in the decode transfer queue.",
}
_PD_HISTOGRAMS = {
    "kv_transfer_speed_gb_s": (
        "Histogram of KV cache transfer speed in GB/s.",
        (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400),
    ),
    "kv_transfer_latency_ms": (
        "Histogram of KV cache transfer latency in ms.",
        (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
    ),
    "kv_transfer_alloc_ms": (
        "Histogram of KV transfer allocation waiting time in ms.",
        (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
    ),
    "kv_transfer_total_mb": (
        "Histogram of KV cache transfer size in MB.",
        (1, 5, 10, 50, 100, 500, 1000, 5000, 10000),
    ),
}
_PD_COUNTERS = {
    "num_bootstrap_failed_reqs": "The number of bootstrap failed requests.",
    "num_transfer_failed_reqs": "The number of transfer failed requests.",
}


def engine_type(mode: str) -> str:
    """SGLang's `engine_type` label for a `--disaggregation-mode`."""
    return "unified" if mode == "null" else mode


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format, without prometheus_client's `_created`
    series: SGLang's multiprocess collector has none."""
    lines = generate_latest(registry).split(b"\n")
    return b"\n".join(line for line in lines if not _created(line))


def _created(line: bytes) -> bool:
    fields = line.split(b" ", 3)
    name = fields[2] if line.startswith(b"# ") and len(fields) > 2 else line.split(b"{")[0]
    return name.split(b" ")[0].endswith(b"_created")


class EngineMetrics:
    """One registry per engine, so several engines can live in one process (tests)."""

    def __init__(self, model: EngineModel, api_version: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        new = api_version != "0.5.5"
        name = model.config.model
        kind = engine_type(model.config.disaggregation_mode)
        sched = {"engine_type": kind, "model_name": name, "pp_rank": "0", "tp_rank": "0"}
        if new:
            sched["moe_ep_rank"] = "0"
        # The tokenizer side labels by model (and engine type on 0.5.23); 0.5.23 splits
        # request counts and latencies by whether the request streamed.
        self._tok = {"engine_type": kind, "model_name": name} if new else {"model_name": name}
        # 0.5.23 with priority scheduling labels both sides by priority: "" on scheduler
        # totals, each request's own on its counts and latencies (the scheduler's
        # per-priority breakdown of its queue gauges is not modelled).
        self._by_priority = new and model.config.enable_priority_scheduling
        if self._by_priority:
            sched["priority"] = self._tok["priority"] = ""
        self._split = ["is_streaming"] if new else []
        gauges = {**_GAUGES, **(_GAUGES_0523 if new else {})}
        self._gauges = {
            key: Gauge(f"sglang:{key}", doc, list(sched), registry=self.registry).labels(**sched)
            for key, doc in gauges.items()
        }
        per_process = {**sched, "pid": str(os.getpid())}
        # num_paused_reqs stays 0: no weight sync pauses requests here.
        self.retracted_now, _ = (
            Gauge(f"sglang:{key}", doc, list(per_process), registry=self.registry).labels(
                **per_process
            )
            for key, doc in _PROCESS_GAUGES.items()
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
            list(sched), buckets=_QUEUE_BUCKETS[api_version], registry=self.registry,
        ).labels(**sched)  # fmt: skip
        self.retractions: Histogram | None = None
        self.retracted_counters: tuple[Counter, Counter, Counter] | None = None
        if new:
            self.retracted_counters = (
                self._counter("num_retracted_requests", "Number of retracted requests.", sched),
                self._counter(
                    "num_retracted_input_tokens", "Input tokens of retracted requests.", sched
                ),
                self._counter(
                    "num_retracted_output_tokens", "Output tokens of retracted requests.", sched
                ),
            )
        else:
            self.retractions = Histogram(
                "sglang:num_retractions", "Histogram of retraction counts per request.",
                list(self._tok), buckets=_RETRACTION_BUCKETS, registry=self.registry,
            ).labels(**self._tok)  # fmt: skip
        names = [*self._tok, *self._split]
        self._prompt = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", names,
            registry=self.registry,
        )  # fmt: skip
        self._generation = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", names,
            registry=self.registry,
        )  # fmt: skip
        self._requests = Counter(
            "sglang:num_requests", "Number of requests processed.", names,
            registry=self.registry,
        )  # fmt: skip
        cached_names = [*self._tok, "cache_source"] if new else list(self._tok)
        cached = Counter(
            "sglang:cached_tokens", "Number of cached prompt tokens.", cached_names,
            registry=self.registry,
        )  # fmt: skip
        self.cached_tokens = (
            cached.labels(**self._tok, cache_source="device") if new else cached.labels(**self._tok)
        )
        self.host_cached_tokens = (
            cached.labels(**self._tok, cache_source="host") if new else self.cached_tokens
        )
        self._hicache = _HiCacheMetrics(model, self.registry, sched) if new and model.host else None
        pd = model.config.disaggregation_mode != "null"
        self.pd = DisaggregationMetrics(model, self.registry, sched) if pd else None
        self.aborted = self._counter(
            "num_aborted_requests", "Number of requests aborted.", self._tok
        )
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            names, buckets=_TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            list(self._tok), buckets=_ITL_BUCKETS, registry=self.registry,
        ).labels(**self._tok)  # fmt: skip
        self._e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds", names,
            buckets=_E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.refresh()

    def _counter(self, key: str, doc: str, labels: dict[str, str]) -> Counter:
        metric = Counter(f"sglang:{key}", doc, list(labels), registry=self.registry)
        return metric.labels(**labels)

    def _labels(self, req: EngineRequest, streaming: bool) -> dict[str, str]:
        labels = self._tok
        if self._by_priority:
            labels = {**labels, "priority": str(req.priority)}
        if self._split:
            return {**labels, "is_streaming": "true" if streaming else "false"}
        return labels

    def refresh(self) -> None:
        """Copy the scheduler's state into the gauges (SGLang's log_stats moments)."""
        loads = self.model.loads()
        values = {
            "num_running_reqs": loads.num_running_reqs,
            "num_queue_reqs": loads.num_waiting_reqs,
            "num_used_tokens": loads.num_used_tokens,
            "token_usage": loads.token_usage,
            "gen_throughput": loads.gen_throughput,
            "cache_hit_rate": loads.cache_hit_rate,
            "kv_used_tokens": loads.num_used_tokens,
            "kv_available_tokens": loads.num_available_tokens,
            "kv_evictable_tokens": loads.num_evictable_tokens,
            "max_total_num_tokens": loads.max_total_num_tokens,
            "page_size": self.model.page_size,
            "new_token_ratio": loads.new_token_ratio,
        }
        for key, gauge in self._gauges.items():
            gauge.set(values[key])
        self.retracted_now.set(loads.num_retracted_reqs)
        if self._hicache is not None:
            self._hicache.refresh()
        if self.pd is not None:
            self.pd.refresh()

    def first_token(self, req: EngineRequest, streaming: bool, at: float) -> None:
        self._ttft.labels(**self._labels(req, streaming)).observe(max(0.0, at - req.arrival))

    def retracted(self, req: EngineRequest) -> None:
        if self.retracted_counters is not None:
            requests, inputs, outputs = self.retracted_counters
            requests.inc()
            inputs.inc(len(req.input_ids))
            outputs.inc(len(req.output_ids))

    def finished(self, req: EngineRequest, streaming: bool) -> None:
        """Count a request that ended, however it ended."""
        labels = self._labels(req, streaming)
        self._requests.labels(**labels).inc()
        self._prompt.labels(**labels).inc(req.prompt_tokens)
        self._generation.labels(**labels).inc(req.completion_tokens)
        self.cached_tokens.inc(req.cached_tokens - req.host_cached_tokens)
        self.host_cached_tokens.inc(req.host_cached_tokens)
        if self.retractions is not None:
            self.retractions.observe(req.retractions)
        if req.finish is not None and req.finish.kind == "abort":
            self.aborted.inc()
        else:
            self._e2e.labels(**labels).observe(max(0.0, req.finished_at - req.arrival))


class DisaggregationMetrics:
    """A prefill or decode engine's families: its P/D queues (refreshed with the other
    scheduler gauges), the transfers it made and the handoffs that failed. The last
    transfer's speed and latency are kept for `/v1/loads`, as SGLang's reporter does."""

    def __init__(self, model: EngineModel, registry: CollectorRegistry, sched: dict[str, str]):
        self.model = model
        self._queues = [
            Gauge(f"sglang:{key}", doc, list(sched), registry=registry).labels(**sched)
            for key, doc in _PD_GAUGES.items()
        ]
        self.speed, self.latency, self.alloc, self.size = (
            Histogram(f"sglang:{key}", doc, list(sched), buckets=buckets, registry=registry).labels(
                **sched
            )
            for key, (doc, buckets) in _PD_HISTOGRAMS.items()
        )
        self.bootstrap_failed, self.transfer_failed = (
            Counter(f"sglang:{key}", doc, list(sched), registry=registry).labels(**sched)
            for key, doc in _PD_COUNTERS.items()
        )
        self.last_speed_gb_s = 0.0
        self.last_latency_ms = 0.0

    def refresh(self) -> None:
        loads = self.model.loads()
        values = (
            loads.num_bootstrap_reqs, loads.num_inflight_reqs,
            loads.num_prealloc_reqs, loads.num_transfer_reqs,
        )  # fmt: skip
        for gauge, value in zip(self._queues, values, strict=True):
            gauge.set(value)

    def transferred(self, kv_bytes: int, seconds: float) -> None:
        """A prefill engine's KV reached its decode peer."""
        self.last_latency_ms = seconds * 1e3
        self.last_speed_gb_s = kv_bytes / seconds / 1e9 if seconds > 0 else 0.0
        self.latency.observe(self.last_latency_ms)
        self.speed.observe(self.last_speed_gb_s)
        self.size.observe(kv_bytes / 1e6)


class _HiCacheMetrics:
    """The host tier's families: the scheduler's host pool gauges and the radix cache's
    eviction, write-back and load-back counters (SGLang's RadixCacheMetricsCollector,
    labelled by cache class and rank), copied from the model's cumulative counts."""

    def __init__(self, model: EngineModel, registry: CollectorRegistry, sched: dict[str, str]):
        assert model.host is not None
        self.model, self.host = model, model.host
        self.used, self.total = (
            Gauge(f"sglang:{key}", doc, list(sched), registry=registry).labels(**sched)
            for key, doc in _HICACHE_GAUGES.items()
        )
        radix = {"cache_type": "UnifiedRadixCache", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
        pooled = [*radix, "pool"]

        def counter(name: str, doc: str, names: list[str], **labels: str) -> Counter:
            family = Counter(f"sglang:{name}", doc, names, registry=registry)
            return family.labels(**radix, **labels)

        self.evicted = counter(
            "evicted_tokens", "The number of device KV token slots freed by eviction.", list(radix)
        )
        self.backup = counter(
            "hicache_backup_tokens", "The number of tokens backed up from GPU to local host "
            "DRAM (L2), by host pool.", pooled, pool="kv",
        )  # fmt: skip
        self.load_back = counter(
            "load_back_tokens", "The number of tokens loaded back from local host DRAM (L2) "
            "to GPU, by host pool.", pooled, pool="kv",
        )  # fmt: skip
        self.dropped = counter(
            "hicache_dropped_tokens", "The number of logical device KV tokens destroyed "
            "without a host backup.", [*pooled, "reason"], pool="kv", reason="host_pressure",
        )  # fmt: skip
        # Bytes and copy time, from which a reader takes the host link's bandwidth (SGLang
        # 0.5.23's families): each copy timed as the model's PCIe link moves it.
        self.backup_bytes = counter(
            "hicache_backup_bytes", "Bytes backed up from GPU to local host DRAM (L2).",
            list(radix),
        )  # fmt: skip
        self.load_back_bytes = counter(
            "load_back_bytes", "Bytes loaded back from local host DRAM (L2) to GPU.", list(radix)
        )
        self.backup_seconds, self.load_back_seconds = (
            Histogram(f"sglang:{name}", doc, list(radix), registry=registry).labels(**radix)
            for name, doc in (
                ("hicache_backup_duration_seconds", "Time taken to back up KV cache from GPU "
                 "to local host DRAM (L2) in seconds, per merged write op."),
                ("load_back_duration_seconds", "GPU-stream span of a merged host-to-device "
                 "load-back copy loop."),
            )
        )  # fmt: skip
        self._seen = (0, 0, 0, 0)

    def refresh(self) -> None:
        host = self.host
        self.used.set(host.used_pages * host.page_size)
        self.total.set(host.total_pages * host.page_size)
        now = (
            self.model.kv.evicted_tokens_total,
            host.backup_tokens_total,
            host.load_back_tokens_total,
            host.dropped_tokens_total,
        )
        for counter, value, seen in zip(
            (self.evicted, self.backup, self.load_back, self.dropped), now, self._seen, strict=True
        ):
            counter.inc(value - seen)
        timing = self.model.config.timing
        for tokens, nbytes, seconds in (
            (now[1] - self._seen[1], self.backup_bytes, self.backup_seconds),
            (now[2] - self._seen[2], self.load_back_bytes, self.load_back_seconds),
        ):
            if tokens > 0:  # the copies since the last scrape, as one merged op
                nbytes.inc(tokens * timing.model.kv_bytes_per_token)
                seconds.observe(timing.host_transfer_s(tokens))
        self._seen = now
