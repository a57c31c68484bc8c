"""The routing cost model, term by term, in seconds.

    cost = uncached prefill + queue + transfer + future KV growth + SLO risk + load penalty

Each term estimates what sending a request to one endpoint costs the request or the
fleet. Scorers (`controlplane.routing.scorers`) turn one term each into a score in [0, 1];
a profile's weights then set how much each term counts. Cache affinity is the uncached
prefill term only — one term, never the rule: a hot owner near critical loses on future KV
growth and queue even when it holds the whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.contract import Role
from controlplane.routing.snapshot import EndpointView, RouteRequest, RoutingContext


@dataclass(frozen=True, slots=True)
class CostModel:
    """Calibration of the terms. Defaults describe an H200-class 8B engine.

    `expected_output_fraction` is how much of `max_new_tokens` a request is assumed to
    generate when nothing better is known (the sidecar's predictor reports the growth it
    reserves; the router only needs the request's own share). `kv_penalty_s` is the cost
    of filling an endpoint's KV completely: the future-KV term grows without bound as the
    committed fraction after admission approaches 1.
    """

    prefill_tokens_per_s: float = 20_000.0
    queued_request_s: float = 0.05
    kv_bytes_per_token: int = 131_072
    transfer_bytes_per_s: float = 25e9
    expected_output_fraction: float = 0.5
    kv_penalty_s: float = 1.0
    ttft_slo_s: float = 2.0
    load_penalty_s: float = 0.1

    def uncached_prefill_s(self, request: RouteRequest, cached_tokens: int) -> float:
        return max(0, request.prompt_tokens - cached_tokens) / self.prefill_tokens_per_s

    def queue_s(self, view: EndpointView, ctx: RoutingContext) -> float:
        s = view.state
        queued = s.queued_requests + ctx.inflight.get(view.endpoint_id, 0)
        return s.waiting_prefill_tokens / self.prefill_tokens_per_s + queued * self.queued_request_s

    def transfer_s(self, request: RouteRequest, view: EndpointView) -> float:
        """A prefill endpoint ships the prompt's KV to a decode endpoint afterwards."""
        if view.state.role is not Role.PREFILL:
            return 0.0
        return request.prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def committed_after(self, request: RouteRequest, view: EndpointView) -> float:
        """Fraction of the endpoint's KV committed if it admits this request: used, the
        reserved growth of what runs there, this prompt and its expected output."""
        s = view.state
        if s.kv_capacity_tokens <= 0:
            return 1.0
        own = request.prompt_tokens + request.max_new_tokens * self.expected_output_fraction
        return (view.kv_committed_tokens + own) / s.kv_capacity_tokens

    def future_kv_s(self, request: RouteRequest, view: EndpointView) -> float:
        committed = self.committed_after(request, view)
        if committed >= 1.0:
            return self.kv_penalty_s * 1e3
        return self.kv_penalty_s * committed * committed / (1.0 - committed)

    def slo_risk_s(
        self, request: RouteRequest, view: EndpointView, queue_s: float, prefill_s: float
    ) -> float:
        """Seconds by which the request is expected to miss its TTFT objective or its
        deadline on this endpoint (0 when it is expected to make both)."""
        s = view.state
        first_token = queue_s + prefill_s + s.predicted_ttft_s
        risk = max(0.0, first_token - self.ttft_slo_s)
        if request.deadline_s > 0:
            finish = first_token + request.max_new_tokens * s.predicted_tpot_s
            risk += max(0.0, finish - request.deadline_s)
        return risk

    def load_penalty(self, view: EndpointView, ctx: RoutingContext, mean_load: float) -> float:
        """Grows with how far the endpoint's load is above the pool's mean."""
        load = view.reported_load + ctx.inflight.get(view.endpoint_id, 0)
        return self.load_penalty_s * max(0.0, load - mean_load) / (mean_load + 1.0)
