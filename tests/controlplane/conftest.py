"""Fixtures for the control-plane store tests: clients of the real redis-server fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from controlplane.store import EndpointRegistry, RedisSettings, connect
from tests.controlplane.records import POOL


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    redis = connect(RedisSettings(url=redis_url, retries=2))
    yield redis
    await redis.aclose()


@pytest.fixture
def registry(client: Redis) -> EndpointRegistry:
    return EndpointRegistry(client, POOL)
