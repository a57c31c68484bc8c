"""Replica decisions: autoscaling from fleet pressure, with stabilization, and the choice
of which engines a scale-down drains. Pure: `now` and every observation are parameters.

Stabilization follows the HorizontalPodAutoscaler's rule: a scale-up takes the lowest
recommendation of the up window (so one spike does not buy GPUs) and a scale-down the
highest of the down window (so a lull does not drop engines that will be needed again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.contract import AutoscalingPolicy
from fleet_operator.fleet import FleetObservation
from fleet_operator.spec import ReplicaSpec

# Within this ratio of the target nothing changes (the HPA's default tolerance).
TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(slots=True)
class RecommendationLog:
    """One pool's recent recommendations. The operator keeps them in memory, not in the
    pool's status: a status rewritten on every pass costs the API server a write each
    time and grows with the window."""

    since: float
    entries: list[Recommendation]


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    ready: bool


def load_ratio(policy: AutoscalingPolicy, fleet: FleetObservation) -> float | None:
    """The worst of KV pressure, waiting prefill and predicted TTFT against their targets;
    None when no endpoint reports anything yet."""
    leased = fleet.leased
    if not leased:
        return None
    ratios = [
        sum(e.waiting_prefill_tokens for e in leased)
        / len(leased)
        / policy.target_waiting_prefill_tokens,
        max(e.predicted_ttft_s for e in leased) / policy.target_ttft_s,
    ]
    pressure = fleet.kv_pressure
    if pressure is not None:
        ratios.append(pressure / policy.target_kv_pressure)
    return max(ratios)


def recommend(policy: AutoscalingPolicy, fleet: FleetObservation, current: int) -> int:
    ratio = load_ratio(policy, fleet)
    if ratio is None or current == 0 or abs(ratio - 1.0) <= TOLERANCE:
        return current
    return max(1, math.ceil(current * ratio))


def stabilized(
    history: Sequence[Recommendation],
    policy: AutoscalingPolicy,
    now: float,
    current: int,
    since: float,
) -> int:
    """`since`: when recommendations began (the operator's start, for this pool). A
    scale-down waits until its whole window has been observed, so a restarted operator
    does not drop engines on its first sample of a lull."""
    up = [r.replicas for r in history if now - r.at <= policy.scale_up_stabilization_s]
    down = [r.replicas for r in history if now - r.at <= policy.scale_down_stabilization_s]
    if up and min(up) > current:
        return min(up)
    window_seen = now - since >= policy.scale_down_stabilization_s
    if down and max(down) < current and window_seen:
        return max(down)
    return current


def prune(
    history: Sequence[Recommendation], policy: AutoscalingPolicy, now: float
) -> list[Recommendation]:
    keep = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    return [r for r in history if now - r.at <= keep]


def target_replicas(
    bounds: ReplicaSpec,
    policy: AutoscalingPolicy,
    history: Sequence[Recommendation],
    now: float,
    current: int,
    since: float,
) -> int:
    """Without autoscaling the pool runs `min`; with it, the stabilized recommendation
    (history must already include this pass's), always within [min, max]."""
    wanted = stabilized(history, policy, now, current, since) if policy.enabled else bounds.min
    return min(bounds.max, max(bounds.min, wanted))


def pick_victims(pods: Sequence[PodView], fleet: FleetObservation, count: int) -> list[str]:
    """The pods a scale-down removes: those that serve nothing first (not ready, not
    registered, lease lapsed), then those with the least in flight and the least KV, so
    the fewest requests have to finish or move. Ties go by name, for determinism."""
    endpoints = fleet.by_id()

    def cost(pod: PodView) -> tuple[int, int, int, str]:
        endpoint = endpoints.get(pod.name)
        if not pod.ready or endpoint is None or not endpoint.lease_valid:
            return (0, 0, 0, pod.name)
        return (1, endpoint.in_flight, endpoint.kv_used_tokens, pod.name)

    return [p.name for p in sorted(pods, key=cost)[: max(0, count)]]


def drain_finished(
    victims: Sequence[str],
    fleet: FleetObservation,
    started_at: float,
    now: float,
    deadline_s: float,
) -> bool:
    """Whether a scale-down may proceed: every victim is idle or gone, or the drain
    deadline passed (the preStop drain then handles what is left)."""
    if now - started_at >= deadline_s:
        return True
    endpoints = fleet.by_id()
    for name in victims:
        endpoint = endpoints.get(name)
        if endpoint is not None and endpoint.lease_valid and endpoint.in_flight > 0:
            return False
    return True
