"""Connecting to Redis: standalone or Sentinel, AUTH, TLS, timeouts, retries with jitter.

Every component takes one URL (`RedisSettings.from_url`), so the same Secret works for a
standalone Redis (`redis://`, `rediss://`, `unix://`) and for a Sentinel-managed primary:
`redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]` (`rediss+sentinel`
for TLS to the sentinels and the primary; `?sentinel_password=` when the sentinels require
their own password). The userinfo's password is the primary's.

A lost connection is retried with exponential backoff and full jitter (so a fleet of
sidecars does not reconnect in lock step after a Redis restart); each retry opens a fresh
connection, and behind Sentinel a fresh connection asks the sentinels who the master is
now, so a failover is followed without any action from the caller. Scripts survive a
failover through their NOSCRIPT reload (see `scripts`).

Connections come from a blocking pool: a caller that finds all `max_connections` in use
waits (up to `pool_timeout_s`) for one to come back instead of failing. redis-py's default
pool refuses the caller at once ("Too many connections"), which turned a burst of more
concurrent requests than connections into 503s at the router and skipped KV quota charges
at the sidecars. Redis runs one command at a time, so a few dozen connections keep it busy;
more connections add nothing but file descriptors on the server.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where the control plane's Redis is and how to talk to it.

    `url` is used when `sentinels` is empty (`redis://`, `rediss://` for TLS, or
    `unix://`); with sentinels, the master of `sentinel_service` is discovered through them.
    Timeouts bound every command: keep them above any blocking read a caller asks for.
    `max_connections` caps the connections one client opens (not the callers: beyond it
    they wait, up to `pool_timeout_s`, for a connection to come back); keep it above the
    number of blocking reads (change feed, command channel) the process holds at once.
    """

    url: str = "redis://127.0.0.1:6379/0"
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_service: str = "weir"
    sentinel_password: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    connect_timeout_s: float = 2.0
    command_timeout_s: float = 5.0
    retries: int = 6
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 2.0
    max_connections: int = 64
    pool_timeout_s: float = 5.0
    client_name: str = "weir"

    def __post_init__(self) -> None:
        for name in (
            "connect_timeout_s",
            "command_timeout_s",
            "backoff_base_s",
            "backoff_cap_s",
            "pool_timeout_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < 3600):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not 0 <= self.retries <= 100:
            raise ValueError(f"retries must be in [0, 100], got {self.retries!r}")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Settings for `url` (see the module's docstring for the forms), with `overrides`
        for the fields a URL does not carry (timeouts, retries, client name). Raises
        ValueError, naming what is wrong but never the password, for a URL it cannot use."""
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme in ("redis", "rediss", "unix"):
            return cls(url=url, **overrides)
        if scheme not in ("redis+sentinel", "rediss+sentinel"):
            raise ValueError(
                f"unsupported Redis URL {redact_url(url)!r}: use redis://, rediss://, unix://, "
                "redis+sentinel:// or rediss+sentinel://"
            )
        return cls(**(_sentinel_fields(url, tls=scheme == "rediss+sentinel") | overrides))


def _sentinel_fields(url: str, tls: bool) -> dict[str, Any]:
    """The fields of a `redis+sentinel://` URL."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    sentinels = tuple(_host_port(item, url) for item in hosts.split(",") if item)
    if not sentinels:
        raise ValueError(f"{redact_url(url)!r} names no sentinel (host:port[,host:port...])")
    path = [segment for segment in parts.path.split("/") if segment]
    if not 1 <= len(path) <= 2:
        raise ValueError(f"{redact_url(url)!r}: the path must be /service or /service/db")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"{redact_url(url)!r}: the database must be a number, got {path[1]!r}")
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"{redact_url(url)!r}: unknown parameter(s) {sorted(unknown)}")
    return {
        "url": "",
        "sentinels": sentinels,
        "sentinel_service": unquote(path[0]),
        "db": int(path[1]) if len(path) == 2 else 0,
        "username": unquote(user) or None,
        "password": unquote(password) or None,
        "sentinel_password": query.get("sentinel_password", [None])[0],
        "tls": tls,
    }


def _host_port(item: str, url: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` (a sentinel's port has no default: 26379 is a habit)."""
    host, _, port = item.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{redact_url(url)!r}: {item!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


_USERINFO_PASSWORD = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?[^:/?#@]*:)[^/?#]*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:sentinel_)?password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """`url` as it may be logged or printed: its passwords — in the userinfo
    (`redis://user:PASSWORD@host`, `redis://:PASSWORD@host`), a `password` query parameter
    (`unix:///run/redis.sock?password=PASSWORD`) or a `sentinel_password` one — replaced
    by `***`."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO_PASSWORD.sub(r"\1***@", url, count=1))


def _retry(settings: RedisSettings) -> Retry:
    return Retry(
        ExponentialWithJitterBackoff(base=settings.backoff_base_s, cap=settings.backoff_cap_s),
        settings.retries,
        supported_errors=(ConnectionError, TimeoutError),
    )


def _connection_kwargs(settings: RedisSettings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "username": settings.username,
        "password": settings.password,
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": settings.command_timeout_s,
        "retry": _retry(settings),
        "max_connections": settings.max_connections,
        "client_name": settings.client_name,
        "health_check_interval": 10,
    }
    if settings.tls:
        kwargs.update(
            ssl_ca_certs=settings.tls_ca_file,
            ssl_certfile=settings.tls_cert_file,
            ssl_keyfile=settings.tls_key_file,
        )
    return kwargs


def connect(settings: RedisSettings) -> Redis:
    """A client for `settings` (no I/O yet: connections open on first use)."""
    kwargs = _connection_kwargs(settings)
    if not settings.sentinels:
        url = settings.url
        if settings.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        pool = BlockingConnectionPool.from_url(url, timeout=settings.pool_timeout_s, **kwargs)
        return Redis.from_pool(pool)
    # Sentinel pools pick their TLS connection class from `ssl`.
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": settings.connect_timeout_s,
        "password": settings.sentinel_password,
    }
    if settings.tls:
        kwargs["ssl"] = True
        sentinel_kwargs.update(
            ssl=True,
            ssl_ca_certs=settings.tls_ca_file,
            ssl_certfile=settings.tls_cert_file,
            ssl_keyfile=settings.tls_key_file,
        )
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(settings.sentinels), sentinel_kwargs=sentinel_kwargs, **kwargs
    )
    master: _SentinelMaster = sentinel.master_for(
        settings.sentinel_service,
        redis_class=_SentinelMaster,
        connection_pool_class=_BlockingSentinelPool,
        db=settings.db,
        timeout=settings.pool_timeout_s,
    )
    master.sentinels = list(sentinel.sentinels)
    return master


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The master's pool behind Sentinel: connections to whichever master the sentinels
    name (SentinelConnectionPool), handed out as a blocking pool does: a caller waits for
    a free connection (`timeout`) rather than failing when all are in use."""


class _SentinelMaster(Redis):
    """The master's client; closing it also closes the connections to the sentinels."""

    sentinels: list[Redis]

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in self.sentinels:
            await client.aclose()


async def cancel_loops(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel tasks that loop over Redis commands, and wait until they have ended.

    A cancellation that lands while a command's read times out can come back as the
    command's timeout, a RedisError, which such loops catch and retry: one cancel may not
    end them (seen under load with redis-py 8.1), so they are cancelled until they do."""
    pending = [task for task in tasks if not task.done()]
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)
        pending = [task for task in pending if not task.done()]
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s had failed: %s", task.get_name(), task.exception())
