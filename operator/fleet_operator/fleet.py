"""The operator's window on the control plane: what the endpoints of a pool report, and
the two writes the operator makes there (drain victims of a scale-down, forget a deleted
pool).

`ControlPlane` is the small interface the kopf handlers use; `RedisControlPlane` is the
real one over `controlplane.store`. Observations are plain immutable values, so status
and scaling stay pure functions of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from controlplane.contract import Lifecycle, WatermarkState
from controlplane.store import (
    EndpointRegistry,
    PoolKeys,
    RedisClient,
    RedisSettings,
    StoredPool,
    connect,
)


class ControlPlaneUnreachableError(Exception):
    """Redis did not answer (after the client's own retries); the message says why."""


@dataclass(frozen=True, slots=True)
class EndpointSummary:
    """What the operator reads of one endpoint: enough for the pool's status and scaling."""

    endpoint_id: str
    lifecycle: Lifecycle
    watermark: WatermarkState
    lease_valid: bool
    in_flight: int
    kv_used_tokens: int
    kv_reserved_growth_tokens: int
    kv_capacity_tokens: int
    waiting_prefill_tokens: int
    predicted_ttft_s: float


@dataclass(frozen=True, slots=True)
class FleetObservation:
    """One pool's endpoints as the control plane sees them at one moment."""

    endpoints: tuple[EndpointSummary, ...] = ()

    def by_id(self) -> dict[str, EndpointSummary]:
        return {e.endpoint_id: e for e in self.endpoints}

    @property
    def leased(self) -> tuple[EndpointSummary, ...]:
        return tuple(e for e in self.endpoints if e.lease_valid)

    @property
    def live(self) -> int:
        return sum(1 for e in self.leased if e.lifecycle is Lifecycle.READY)

    @property
    def draining(self) -> int:
        return sum(1 for e in self.leased if e.lifecycle is Lifecycle.DRAINING)

    @property
    def expired(self) -> int:
        return sum(1 for e in self.endpoints if not e.lease_valid)

    def watermark_counts(self) -> dict[WatermarkState, int]:
        counts = Counter(e.watermark for e in self.leased)
        return {state: counts.get(state, 0) for state in WatermarkState}

    @property
    def kv_pressure(self) -> float | None:
        """Used plus reserved growth over capacity across leased endpoints; None if no
        endpoint reports a capacity."""
        capacity = sum(e.kv_capacity_tokens for e in self.leased)
        if capacity <= 0:
            return None
        committed = sum(e.kv_used_tokens + e.kv_reserved_growth_tokens for e in self.leased)
        return committed / capacity


def observation_from_snapshot(snapshot: StoredPool) -> FleetObservation:
    return FleetObservation(
        tuple(
            EndpointSummary(
                endpoint_id=eid,
                lifecycle=state.lifecycle,
                watermark=state.watermark,
                lease_valid=snapshot.lease_valid(eid),
                in_flight=state.running_requests + state.queued_requests,
                kv_used_tokens=state.kv_used_tokens,
                kv_reserved_growth_tokens=state.kv_reserved_growth_tokens,
                kv_capacity_tokens=state.kv_capacity_tokens,
                waiting_prefill_tokens=state.waiting_prefill_tokens,
                predicted_ttft_s=state.predicted_ttft_s,
            )
            for eid, state in sorted(snapshot.endpoints.items())
        )
    )


class ControlPlane(Protocol):
    async def observe(self, pool: str) -> FleetObservation: ...

    async def drain(self, pool: str, endpoint_ids: Iterable[str]) -> list[str]:
        """Take endpoints out of routing; returns those that were registered."""
        ...

    async def forget(self, pool: str) -> int:
        """Delete every key of the pool; returns how many there were."""
        ...

    async def close(self) -> None: ...


class RedisControlPlane:
    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    @classmethod
    def from_url(cls, url: str) -> RedisControlPlane:
        # Few retries: a status pass should report Redis as unreachable, not hang on it.
        return cls(connect(RedisSettings.from_url(url, retries=2, client_name="weir-operator")))

    async def observe(self, pool: str) -> FleetObservation:
        try:
            snapshot = await EndpointRegistry(self.redis, pool).snapshot()
        except (RedisError, OSError) as exc:
            raise ControlPlaneUnreachableError(f"reading pool {pool}: {exc}") from exc
        return observation_from_snapshot(snapshot)

    async def drain(self, pool: str, endpoint_ids: Iterable[str]) -> list[str]:
        registry = EndpointRegistry(self.redis, pool)
        drained: list[str] = []
        try:
            for eid in endpoint_ids:
                if await registry.drain(eid):
                    drained.append(eid)
        except (RedisError, OSError) as exc:
            raise ControlPlaneUnreachableError(f"draining in pool {pool}: {exc}") from exc
        return drained

    async def forget(self, pool: str) -> int:
        pattern = PoolKeys(pool).pattern
        removed = 0
        try:
            batch: list[bytes] = []
            async for key in self.redis.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) >= 500:
                    removed += int(await self.redis.unlink(*batch))
                    batch = []
            if batch:
                removed += int(await self.redis.unlink(*batch))
        except (RedisError, OSError) as exc:
            raise ControlPlaneUnreachableError(f"forgetting pool {pool}: {exc}") from exc
        return removed

    async def close(self) -> None:
        await self.redis.aclose()
