"""Built-in filters: which endpoints a request may be sent to at all."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.contract import WatermarkState
from controlplane.routing.framework import Cycle
from controlplane.routing.snapshot import EndpointView

_CRITICAL = WatermarkState.CRITICAL.rank


@dataclass(frozen=True, slots=True)
class LeaseValid:
    """Drops endpoints whose lease lapsed: a worker that stopped heartbeating is out of
    routing at once, before the control plane's reaper publishes its removal."""

    name: str = "lease-valid"

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]:
        now = cycle.ctx.now
        return [e for e in candidates if e.lease_deadline > now]


@dataclass(frozen=True, slots=True)
class NotDraining:
    """Draining endpoints finish what they hold and take nothing new."""

    name: str = "not-draining"

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in candidates if e.routable]


@dataclass(frozen=True, slots=True)
class RoleModelAdapterMatch:
    """The endpoint serves the request's model, adapter and role (a mixed request goes to
    mixed endpoints, a prefill to prefill endpoints)."""

    name: str = "role-model-adapter"

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]:
        request = cycle.request
        model, adapter, role = request.model, request.adapter, request.role
        kept = [e for e in candidates if e.state.model == model and e.state.role is role]
        if adapter:
            return [e for e in kept if adapter in e.state.adapters]
        return kept


@dataclass(frozen=True, slots=True)
class WatermarkBelowCritical:
    """An endpoint at critical (or worse) KV pressure takes no new request: the first
    step of the relief ladder is to stop routing there."""

    name: str = "watermark-below-critical"

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in candidates if e.watermark_rank < _CRITICAL]


@dataclass(frozen=True, slots=True)
class BoundedLoad:
    """Consistent hashing with bounded loads: no endpoint takes more than `factor` times
    the pool's mean load (rounded up, counting this request), so a hot prefix spills to
    other endpoints instead of piling onto its owner."""

    factor: float = 1.25
    name: str = "bounded-load"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"bounded-load factor must be a finite number >= 1, got {self.factor}")

    def filter(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[EndpointView]:
        ready = len(cycle.ctx.snapshot.preferred) or 1
        bound = math.ceil(self.factor * (cycle.mean_load * ready + 1.0) / ready)
        inflight = cycle.ctx.inflight
        if not inflight:
            return [e for e in candidates if e.reported_load < bound]
        return [e for e in candidates if e.reported_load + inflight.get(e.endpoint_id, 0) < bound]
