"""Fixtures shared by every test: real servers on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weir.local.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session. Tests isolate themselves by key prefix or
    pool name, or flush with the `redis_url` fixture."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the session's server."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that restart or kill it."""
    with RedisServer() as server:
        yield server
