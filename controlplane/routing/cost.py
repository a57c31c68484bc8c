"""The routing cost model, term by term, in seconds.

    cost = uncached prefill + queue + transfer + future KV growth + SLO risk + load penalty

Each term estimates what sending a request to one endpoint costs the request or the
fleet. Scorers (`controlplane.routing.scorers`) turn one term each into a score in [0, 1];
a profile's weights then set how much each term counts. Cache affinity is the uncached
prefill term only — one term, never the rule: a hot owner near critical loses on future KV
growth and queue even when it holds the whole prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    # Each term is computed for all candidates in one call, from the views' flat derived
    # fields: a decision is a few dozen of these, and per-candidate method calls or
    # nested attribute reads would cost more than the arithmetic.

    def uncached_prefill_s(
        self, request: RouteRequest, cached_tokens: Sequence[int]
    ) -> list[float]:
        """Prefill time of the prompt tokens each candidate does not hold."""
        prompt, rate = request.prompt_tokens, self.prefill_tokens_per_s
        return [(prompt - cached) / rate if cached < prompt else 0.0 for cached in cached_tokens]

    def queue_s(self, views: Sequence[EndpointView], ctx: RoutingContext) -> list[float]:
        """Waiting prefill tokens plus queued requests, counting what this router sent
        since each endpoint's last heartbeat."""
        inflight, rate, per_request = ctx.inflight, self.prefill_tokens_per_s, self.queued_request_s
        if not inflight:
            return [
                v.waiting_prefill_tokens / rate + v.queued_requests * per_request for v in views
            ]
        return [
            v.waiting_prefill_tokens / rate
            + (v.queued_requests + inflight.get(v.endpoint_id, 0)) * per_request
            for v in views
        ]

    def transfer_s(self, request: RouteRequest, views: Sequence[EndpointView]) -> list[float]:
        """A prefill endpoint ships the prompt's KV to a decode endpoint afterwards."""
        shipped = request.prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s
        return [shipped if v.is_prefill else 0.0 for v in views]

    def future_kv_s(self, request: RouteRequest, views: Sequence[EndpointView]) -> list[float]:
        """Grows without bound with the fraction `c` of each endpoint's KV committed if it
        admits this request: used, the reserved growth of what runs there, this prompt
        and its expected output (`penalty * c^2 / (1 - c)`)."""
        own = request.prompt_tokens + request.max_new_tokens * self.expected_output_fraction
        penalty, full = self.kv_penalty_s, self.kv_penalty_s * 1e3
        return [
            penalty * c * c / (1.0 - c)
            if v.kv_capacity_tokens > 0
            and (c := (v.kv_committed_tokens + own) / v.kv_capacity_tokens) < 1.0
            else full
            for v in views
        ]

    def slo_risk_s(
        self,
        request: RouteRequest,
        views: Sequence[EndpointView],
        queue_s: Sequence[float],
        ctx: RoutingContext,
    ) -> list[float]:
        """Seconds by which the request is expected to miss its TTFT objective or its
        deadline on each endpoint (0 when it is expected to make both).

        Where the endpoint publishes its latency model (`prefill_s_per_token` > 0), the
        first token comes after its predicted wait, the requests this router sent there
        since its heartbeat (`queued_request_s` each, as in the queue term), and the
        prompt's prefill at the engine's learned pace; the answer after the published
        TPOT per token. Elsewhere (a sidecar without the model) the first token comes
        after the queue term and the prompt at this model's calibrated pace."""
        prompt, rate, per_request = (
            request.prompt_tokens,
            self.prefill_tokens_per_s,
            self.queued_request_s,
        )
        inflight = ctx.inflight
        firsts = [
            v.predicted_ttft_s
            + inflight.get(v.endpoint_id, 0) * per_request
            + prompt * v.prefill_s_per_token
            if v.prefill_s_per_token > 0.0
            else queued + prompt / rate + v.predicted_ttft_s
            for v, queued in zip(views, queue_s, strict=True)
        ]
        slo, deadline = self.ttft_slo_s, request.deadline_s
        if deadline <= 0:
            return [first - slo if first > slo else 0.0 for first in firsts]
        tokens = request.max_new_tokens
        risks = []
        for v, first in zip(views, firsts, strict=True):
            late = first - slo  # first token, past the objective
            missed = first + tokens * v.predicted_tpot_s - deadline
            risks.append((late if late > 0.0 else 0.0) + (missed if missed > 0.0 else 0.0))
        return risks

    def load_penalty(
        self, views: Sequence[EndpointView], ctx: RoutingContext, mean_load: float
    ) -> list[float]:
        """Grows with how far each endpoint's load is above the pool's mean."""
        inflight, scale = ctx.inflight, self.load_penalty_s / (mean_load + 1.0)
        if not inflight:
            return [
                scale * (v.reported_load - mean_load) if v.reported_load > mean_load else 0.0
                for v in views
            ]
        return [
            scale * (load - mean_load)
            if (load := v.reported_load + inflight.get(v.endpoint_id, 0)) > mean_load
            else 0.0
            for v in views
        ]
