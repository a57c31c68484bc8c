"""What one simulated run measured, as plain JSON-ready numbers.

Definitions (the report and docs/fleet-simulation.md use exactly these):

- offered: every request the workload sent. rejected: refused before admission
  (`overload`, or an engine's outright refusal). accepted: everything else that a router
  took. lost: requests that ended with neither a natural finish (`stop` / `length`), nor
  a client's own action (`cancelled`, `deadline`), nor a refusal: an error or an abort.
  open: still running when the run stopped (the simulator drains for a bounded time).
- goodput: completed requests meeting all three SLOs (TTFT, TPOT, E2E; see `SLO`) per
  second of offered traffic — counted per request, per output token, and weighted by
  priority (weight = priority + 1). Refusals are reported beside it: a request refused is
  one that did not meet its SLO, not one the policy was excused from serving.
- SLO attainment: the share of requests that met their SLOs among those that can be
  judged. A request its client withdrew (cancelled, or its deadline passed) while it was
  still within its objectives, or one still running within them when the run stopped,
  is not judged (`unjudged`): nothing shows it would have missed. One that had already
  missed an objective by then (no first token by its TTFT objective, or fewer tokens
  streamed than its E2E objective asks for by then) counts as a miss, as does every
  refusal and loss.
- KV high water: engine-seconds spent with the engine's KV at or above the policy's high
  watermark; exhaustion events: iterations in which an engine had to retract running
  requests because decode found no free page.
- P/D handoff: from a request's first token on its prefill engine to its next one on a
  decode engine (KV transfer plus waiting for the decode side). client retries: 429/503
  refusals (Weir's tenant quotas and handoff credits) that a patient client sent again
  after Retry-After.
- fairness: Jain's index over the tenants with demand (at least one request offered) of
  their normalised service x_t = KV token-seconds delivered to t / t's weight:
  (Σ x_t)² / (n · Σ x_t²), 1 when every tenant got the same share, 1/n when one got all.
  A request's KV token-seconds are what Weir's fair queues charge (`controlplane.rules.
  fairness.kv_cost`): its prompt plus the tokens it generated, held from its first
  dispatch to an engine until it ended (or the run stopped). Tenants whose demand is
  below their fair share lower the index under any policy: it compares policies on one
  workload, it is not a grade on its own. Beside it, each tenant's SLO attainment (the
  share of its judged requests that met their SLOs).
- latency MAPE: the mean absolute percentage error of Weir's sidecar latency model: the
  TTFT predicted when a new request reached a sidecar (its wait plus its uncached prompt
  at the learned pace) against its arrival there to first token, over the requests not
  preempted before it; the TPOT predicted then against the request's own, over those
  that finished undisturbed. Only policies with the model (Weir, the oracle) report it.
- starvation: over low-priority requests (priority 0), the share that completed, the
  share whose first token came within their `max_wait_s`, and the longest wait for a first
  token (or until the request ended without one). Requests their clients cancelled are
  left out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controlplane.contract import FinishReason
from controlplane.rules.fairness import kv_cost
from fleetsim.sim import SLO, SimFlight, SimResult
from fleetsim.workloads import LENGTH_BUCKETS, length_bucket

CLIENT_ENDINGS = frozenset({FinishReason.CANCELLED, FinishReason.DEADLINE})


def quantiles(values: Iterable[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 (nearest rank); NaN for an empty sample."""
    ordered = sorted(values)
    if not ordered:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "n": 0}
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * n) - 1)]

    return {
        "mean": sum(ordered) / n,
        "p50": rank(0.5),
        "p90": rank(0.9),
        "p99": rank(0.99),
        "n": n,
    }


def meets_slo(flight: SimFlight, slo: SLO) -> bool:
    if not flight.completed:
        return False
    inp = flight.spec.input_tokens
    return (
        flight.ttft_s <= slo.ttft_for(inp)
        and flight.tpot_s <= slo.tpot_s
        and flight.e2e_s <= slo.e2e_for(inp, flight.generated)
    )


def slo_verdict(flight: SimFlight, slo: SLO, end_s: float) -> bool | None:
    """Whether the request met its SLOs; None when its client withdrew it, or the run
    ended at `end_s`, while it was still within them."""
    if flight.completed:
        return meets_slo(flight, slo)
    if flight.done and flight.reason not in CLIENT_ENDINGS:
        return False
    inp = flight.spec.input_tokens
    waited = (flight.finished_at if flight.done else end_s) - flight.spec.arrival_s
    if flight.first_token_at < 0:
        on_track = waited <= slo.ttft_for(inp)
    else:
        on_track = flight.ttft_s <= slo.ttft_for(inp) and waited <= slo.e2e_for(
            inp, flight.generated
        )
    return None if on_track else False


def is_rejected(flight: SimFlight) -> bool:
    return flight.reason is FinishReason.OVERLOAD or (
        flight.reason is FinishReason.ERROR and not flight.accepted
    )


def is_lost(flight: SimFlight) -> bool:
    """Ended, but neither naturally, nor by its client, nor refused with `overload`
    (which a client sees and may retry): an error or an abort. A request still running
    when the run stops is open, not lost."""
    if not flight.done or flight.completed or flight.reason in CLIENT_ENDINGS:
        return False
    return not is_rejected(flight)


def kv_service(flights: Iterable[SimFlight], end_s: float) -> dict[str, float]:
    """KV token-seconds delivered per tenant with demand (see the module's docstring)."""
    service: dict[str, float] = {}
    for f in flights:
        delivered = 0.0
        if f.dispatched_at >= 0:
            ended = f.finished_at if f.done else end_s
            delivered = kv_cost(f.spec.input_tokens, f.generated, ended - f.dispatched_at)
        service[f.spec.tenant] = service.get(f.spec.tenant, 0.0) + delivered
    return service


def jain_index(shares: Iterable[float]) -> float:
    """Jain's fairness index of `shares`: 1 when all are equal; NaN with none."""
    values = list(shares)
    squares = sum(x * x for x in values)
    if not values or squares == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * squares)


def summarize(
    result: SimResult,
    slo: SLO,
    prefill_s_per_token: float,
    weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The run's measures; `weights` are the tenants' fair-share weights (1 unless
    given), for the fairness index."""
    flights = result.flights
    weight = weights or {}
    kv_by_tenant = kv_service(flights, result.end_s)
    span = max(result.duration_s, 1e-9)
    completed = [f for f in flights if f.completed]
    good = [f for f in completed if meets_slo(f, slo)]
    verdicts: dict[str, list[bool]] = defaultdict(list)  # by tenant, of those judged
    for f in flights:
        verdict = slo_verdict(f, slo, result.end_s)
        if verdict is not None:
            verdicts[f.spec.tenant].append(verdict)
    judged = sum(map(len, verdicts.values()))
    unjudged = len(flights) - judged
    rejected = [f for f in flights if is_rejected(f)]
    lost = [f for f in flights if is_lost(f)]
    short = [f for f in completed if not f.spec.is_long]
    low = [f for f in flights if f.spec.priority == 0 and f.reason not in CLIENT_ENDINGS]
    preemptions: dict[str, int] = defaultdict(int)
    for f in flights:
        for mode, count in f.preemptions.items():
            preemptions[mode] += count
    cached = sum(f.cached_tokens for f in flights)
    inputs = sum(f.spec.input_tokens for f in flights if f.first_token_at >= 0)
    served: dict[str, int] = defaultdict(int)
    for f in completed:
        served[f.spec.tenant] += f.spec.input_tokens + f.generated
    total_served = sum(served.values()) or 1
    return {
        "policy": result.policy,
        "offered": len(flights),
        "offered_rps": len(flights) / span,
        "accepted": sum(f.accepted and not is_rejected(f) for f in flights),
        "rejected": len(rejected),
        "rejected_share": len(rejected) / len(flights) if flights else math.nan,
        "completed": len(completed),
        "cancelled": sum(f.reason is FinishReason.CANCELLED for f in flights),
        "deadline": sum(f.reason is FinishReason.DEADLINE for f in flights),
        "lost": len(lost),
        "unjudged": unjudged,
        "open_at_end": sum(not f.done for f in flights),
        "goodput_rps": len(good) / span,
        "slo_met": len(good),
        "goodput_tokens_per_s": sum(f.generated for f in good) / span,
        "goodput_weighted": sum(f.spec.priority + 1 for f in good) / span,
        "slo_attainment": len(good) / judged if judged else math.nan,
        "ttft_s": quantiles(f.ttft_s for f in completed),
        "tpot_s": quantiles(f.tpot_s for f in completed if f.generated > 1),
        "e2e_s": quantiles(f.e2e_s for f in completed),
        "short_ttft_s": quantiles(f.ttft_s for f in short),
        "ttft_by_input": _by_bucket(completed, "input", "ttft"),
        "tpot_by_output": _by_bucket(completed, "output", "tpot"),
        "e2e_by_input": _by_bucket(completed, "input", "e2e"),
        "e2e_by_output": _by_bucket(completed, "output", "e2e"),
        "queue_s": quantiles(f.queue_time_s for f in flights if f.accepted),
        "handoff_s": quantiles(f.handoff_s for f in flights if f.handoff_s > 0),
        "client_retries": sum(f.retries for f in flights),
        "kv_high_water_engine_s": result.high_water_s,
        "kv_high_water_share": result.high_water_s / max(1e-9, result.end_s * result.engines),
        "kv_exhaustion_events": result.exhaustion_events,
        "kv_peak_usage": result.peak_usage,
        "preemptions": dict(sorted(preemptions.items())),
        "recomputed_tokens": sum(f.recomputed_tokens for f in flights),
        "cached_tokens": cached,
        "cache_hit_share": cached / inputs if inputs else 0.0,
        "prefill_s_saved": cached * prefill_s_per_token,
        "tenant_share": {t: n / total_served for t, n in sorted(served.items())},
        "tenant_kv_token_s": dict(sorted(kv_by_tenant.items())),
        "tenant_slo_attainment": {t: sum(v) / len(v) for t, v in sorted(verdicts.items())},
        "fairness_jain": jain_index(kv / weight.get(t, 1.0) for t, kv in kv_by_tenant.items()),
        "starvation": _starvation(low),
        "latency_mape": _latency_mape(flights),
        "end_s": result.end_s,
    }


def _latency_mape(flights: Sequence[SimFlight]) -> dict[str, float]:
    """The sidecar latency model's mean absolute percentage errors (NaN without one)."""
    ttft = [f.ttft_error for f in flights if f.ttft_error >= 0]
    tpot = [f.tpot_error for f in flights if f.tpot_error >= 0]
    return {
        "ttft": sum(ttft) / len(ttft) if ttft else math.nan,
        "tpot": sum(tpot) / len(tpot) if tpot else math.nan,
        "n": len(ttft),
    }


def _by_bucket(flights: Sequence[SimFlight], side: str, metric: str) -> dict[str, dict[str, float]]:
    groups: dict[str, list[float]] = defaultdict(list)
    for f in flights:
        tokens = f.spec.input_tokens if side == "input" else f.generated
        if metric == "tpot" and f.generated < 2:
            continue
        value = {"ttft": f.ttft_s, "tpot": f.tpot_s, "e2e": f.e2e_s}[metric]
        groups[length_bucket(tokens)].append(value)
    return {b: quantiles(groups[b]) for b in LENGTH_BUCKETS if b in groups}


def _starvation(low: Sequence[SimFlight]) -> dict[str, float]:
    if not low:
        return {
            "requests": 0,
            "completed_share": math.nan,
            "within_max_wait_share": math.nan,
            "max_wait_s": math.nan,
        }
    waits = []
    within = 0
    for f in low:
        if f.first_token_at >= 0:
            wait = f.ttft_s
        elif f.finished_at >= 0:
            wait = f.finished_at - f.spec.arrival_s
        else:
            wait = f.spec.max_wait_s or math.inf
        waits.append(wait)
        if f.first_token_at >= 0 and (not f.spec.max_wait_s or wait <= f.spec.max_wait_s):
            within += 1
    return {
        "requests": len(low),
        "completed_share": sum(f.completed for f in low) / len(low),
        "within_max_wait_share": within / len(low),
        "max_wait_s": max(waits),
    }
