"""The operator's side of the control plane (`RedisControlPlane`) on a standalone Redis and
on a Redis Cluster: observing, draining and forgetting a pool touch that pool only. On a
cluster, forgetting scans every primary (SCAN is per node) for the pool's keys."""

from __future__ import annotations

import msgspec
import pytest

from controlplane.store import EndpointRegistry, PoolKeys
from fleet_operator.fleet import RedisControlPlane
from tests.controlplane.records import POOL, endpoint

pytestmark = pytest.mark.redis


async def test_a_pool_is_observed_drained_and_forgotten_alone(store_url: str) -> None:
    plane = RedisControlPlane.from_url(store_url)
    try:
        await EndpointRegistry(plane.redis, POOL).register(endpoint("a"), ttl_s=30)
        other = msgspec.structs.replace(endpoint("a"), pool="other")
        await EndpointRegistry(plane.redis, "other").register(other, ttl_s=30)
        seen = await plane.observe(POOL)
        assert [(e.endpoint_id, e.lease_valid) for e in seen.endpoints] == [("a", True)]
        assert await plane.drain(POOL, ["a", "missing"]) == ["a"]
        assert [e.lifecycle for e in (await plane.observe(POOL)).endpoints] == ["draining"]
        assert await plane.forget(POOL) > 0
        assert [k async for k in plane.redis.scan_iter(match=PoolKeys(POOL).pattern)] == []
        assert [e.endpoint_id for e in (await plane.observe("other")).endpoints] == ["a"]
    finally:
        await plane.close()
