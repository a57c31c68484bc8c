"""Fixtures for the control-plane store tests: clients of the real redis-server fixtures.

`client` (and `registry` on it) runs each store test twice, as `store_url` does: on a
standalone server and on a Redis Cluster, where every key of a pool lives in one hash
slot."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controlplane.store import EndpointRegistry, RedisClient, RedisSettings, connect
from tests.controlplane.records import POOL


@pytest.fixture
async def client(store_url: str) -> AsyncIterator[RedisClient]:
    redis = connect(RedisSettings.from_url(store_url, retries=2))
    yield redis
    await redis.aclose()


@pytest.fixture
def registry(client: RedisClient) -> EndpointRegistry:
    return EndpointRegistry(client, POOL)
