"""SGLang's Prometheus metrics, with SGLang's names, labels and refresh cadence.

Scheduler gauges are refreshed only on prefill iterations, every `decode_log_interval`
decode iterations and when the engine goes idle, as SGLang's scheduler does: readers must
treat them as possibly stale. Counters and latency histograms move when requests finish
(tokenizer-side in SGLang), so they are always current.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetsim.engine import EngineModel, EngineRequest

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip

_GAUGES_055 = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_used_tokens": "The number of used tokens.",
    "token_usage": "The token usage.",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
    "num_retracted_reqs": "The number of retracted requests.",
}
_GAUGES_0523 = {
    "kv_used_tokens": "KV cache tokens in use.",
    "kv_available_tokens": "KV cache tokens free.",
    "kv_evictable_tokens": "KV cache tokens held only by the prefix cache.",
    "max_total_num_tokens": "KV cache capacity in tokens.",
    "page_size": "KV cache page size in tokens.",
}


class EngineMetrics:
    """One registry per engine, so several engines can live in one process (tests)."""

    def __init__(self, model: EngineModel, api_version: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        name = model.config.model
        sched = {"model_name": name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        gauges = dict(_GAUGES_055)
        if api_version != "0.5.5":
            gauges.update(_GAUGES_0523)
        self._gauges = {
            key: Gauge(f"sglang:{key}", doc, list(sched), registry=self.registry).labels(**sched)
            for key, doc in gauges.items()
        }
        labels = {"model_name": name}

        def counter(key: str, doc: str) -> Counter:
            return Counter(f"sglang:{key}", doc, list(labels), registry=self.registry).labels(
                **labels
            )

        def histogram(key: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"sglang:{key}", doc, list(labels), buckets=buckets, registry=self.registry
            ).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("num_requests", "Number of requests processed.")
        self.aborted = counter("num_aborted_requests", "Number of requests aborted.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.refresh()

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
            "num_retracted_reqs": loads.num_retracted_reqs,
            "kv_used_tokens": loads.num_used_tokens,
            "kv_available_tokens": loads.num_available_tokens,
            "kv_evictable_tokens": loads.num_evictable_tokens,
            "max_total_num_tokens": loads.max_total_num_tokens,
            "page_size": self.model.page_size,
        }
        for key, gauge in self._gauges.items():
            gauge.set(values[key])

    def finished(self, req: EngineRequest) -> None:
        """Count a request that ended, however it ended."""
        self.requests.inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(req.completion_tokens)
        self.cached_tokens.inc(req.cached_tokens)
        if req.finish is not None and req.finish.kind == "abort":
            self.aborted.inc()
        else:
            self.e2e.observe(max(0.0, req.finished_at - req.arrival))
