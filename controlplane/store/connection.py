"""Connecting to Redis: standalone, Sentinel or Cluster, AUTH, TLS, timeouts, retries with
jitter.

Every component takes one URL (`RedisSettings.from_url`), so the same Secret works for a
standalone Redis (`redis://`, `rediss://`, `unix://`), for a Sentinel-managed primary:
`redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]` (`rediss+sentinel`
for TLS to the sentinels and the primary; `?sentinel_password=` when the sentinels require
their own password; the userinfo's password is the primary's), and for a Redis Cluster:
`redis+cluster://[[user]:password@]host:port[,host:port...][/0]` (`rediss+cluster` for TLS),
the nodes to discover the cluster from. On a cluster every key of a pool lives in one hash
slot (see `keys`), so each script and transaction runs on one node; redis-py follows MOVED
and ASK redirections and, after a primary fails, asks the cluster again who serves the slot.

A lost connection is retried with exponential backoff and full jitter (so a fleet of
sidecars does not reconnect in lock step after a Redis restart); each retry opens a fresh
connection, and behind Sentinel a fresh connection asks the sentinels who the master is
now, so a failover is followed without any action from the caller. redis-py's cluster
client takes only the number of retries: it tries again at once, after reading the slots
from another node, so while a dead primary's replica is not yet promoted (the cluster's
node timeout and an election, seconds) calls fail fast and the callers' loops retry. Scripts survive a
failover through their NOSCRIPT reload (see `scripts`).

Connections come from a blocking pool: a caller that finds all `max_connections` in use
waits (up to `pool_timeout_s`) for one to come back instead of failing. redis-py's default
pool refuses the caller at once ("Too many connections"), which turned a burst of more
concurrent requests than connections into 503s at the router and skipped KV quota charges
at the sidecars. Redis runs one command at a time, so a few dozen connections keep it busy;
more connections add nothing but file descriptors on the server. redis-py's cluster client
has no blocking pool (a node out of connections refuses at once), so the cluster client
makes callers wait for one of `max_connections` permits instead (see `_Cluster`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    RedisClusterException,
    SlotNotCoveredError,
    TimeoutError,
)

log = logging.getLogger(__name__)

RedisClient: TypeAlias = Redis | RedisCluster
"""What `connect` returns: a standalone or Sentinel-managed Redis, or a Redis Cluster. The
store uses only commands both serve the same way for keys of one slot."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where the control plane's Redis is and how to talk to it.

    `url` is used when `sentinels` and `cluster_nodes` are empty (`redis://`, `rediss://`
    for TLS, or `unix://`); with sentinels, the master of `sentinel_service` is discovered
    through them; with `cluster_nodes`, the cluster is discovered from them (database 0).
    Timeouts bound every command: keep them above any blocking read a caller asks for.
    `max_connections` caps the connections one client opens (not the callers: beyond it
    they wait, up to `pool_timeout_s`, for a connection to come back); keep it above the
    number of blocking reads (change feed, command channel) the process holds at once.
    """

    url: str = "redis://127.0.0.1:6379/0"
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_service: str = "weir"
    sentinel_password: str | None = None
    cluster_nodes: tuple[tuple[str, int], ...] = ()
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
        if self.cluster_nodes and (self.sentinels or self.db):
            raise ValueError("a Redis Cluster has no sentinels and only database 0")

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Settings for `url` (see the module's docstring for the forms), with `overrides`
        for the fields a URL does not carry (timeouts, retries, client name). Raises
        ValueError, naming what is wrong but never the password, for a URL it cannot use."""
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme in ("redis", "rediss", "unix"):
            return cls(url=url, **overrides)
        if scheme in ("redis+cluster", "rediss+cluster"):
            return cls(**(_cluster_fields(url, tls=scheme == "rediss+cluster") | overrides))
        if scheme not in ("redis+sentinel", "rediss+sentinel"):
            raise ValueError(
                f"unsupported Redis URL {redact_url(url)!r}: use redis://, rediss://, unix://, "
                "redis+sentinel://, rediss+sentinel://, redis+cluster:// or rediss+cluster://"
            )
        return cls(**(_sentinel_fields(url, tls=scheme == "rediss+sentinel") | overrides))


def _host_list_fields(
    url: str, field: str, what: str, tls: bool
) -> tuple[dict[str, Any], list[str]]:
    """What a `redis+sentinel://` or `redis+cluster://` URL's authority holds: the
    credentials, TLS, and its hosts (`what`s, in `field`); and the URL's path segments."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    addresses = tuple(_host_port(item, url) for item in hosts.split(",") if item)
    if not addresses:
        raise ValueError(f"{redact_url(url)!r} names no {what} (host:port[,host:port...])")
    fields = {
        "url": "",
        field: addresses,
        "username": unquote(user) or None,
        "password": unquote(password) or None,
        "tls": tls,
    }
    return fields, [segment for segment in parts.path.split("/") if segment]


def _cluster_fields(url: str, tls: bool) -> dict[str, Any]:
    """The fields of a `redis+cluster://` URL."""
    fields, path = _host_list_fields(url, "cluster_nodes", "cluster node", tls)
    if path not in ([], ["0"]):
        raise ValueError(f"{redact_url(url)!r}: a Redis Cluster has only database 0 (/0 or none)")
    if urlsplit(url).query:
        raise ValueError(f"{redact_url(url)!r}: a cluster URL takes no parameters")
    return fields


def _sentinel_fields(url: str, tls: bool) -> dict[str, Any]:
    """The fields of a `redis+sentinel://` URL."""
    fields, path = _host_list_fields(url, "sentinels", "sentinel", tls)
    if not 1 <= len(path) <= 2:
        raise ValueError(f"{redact_url(url)!r}: the path must be /service or /service/db")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"{redact_url(url)!r}: the database must be a number, got {path[1]!r}")
    query = parse_qs(urlsplit(url).query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"{redact_url(url)!r}: unknown parameter(s) {sorted(unknown)}")
    return fields | {
        "sentinel_service": unquote(path[0]),
        "db": int(path[1]) if len(path) == 2 else 0,
        "sentinel_password": query.get("sentinel_password", [None])[0],
    }


def _host_port(item: str, url: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` (no default port: a sentinel's 26379 and a cluster
    node's 6379 are habits, and a wrong guess fails only at the first connection)."""
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


def connect(settings: RedisSettings) -> RedisClient:
    """A client for `settings` (no I/O yet: connections open on first use)."""
    if settings.cluster_nodes:
        return _connect_cluster(settings)
    kwargs = _connection_kwargs(settings)
    if not settings.sentinels:
        url = settings.url
        if settings.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        pool = _ClosingPool.from_url(url, timeout=settings.pool_timeout_s, **kwargs)
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
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
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


class _ClosingPool(BlockingConnectionPool):
    """A blocking pool that stays closed. redis-py's pool closes only the connections it
    holds when it closes: a command still running then (a component's background loop at
    shutdown) loses its connection, its retry opens another, and that one came back to a
    pool nobody would close again — its socket open until garbage collection found it.
    Here a connection that comes back to a closed pool is closed."""

    _closed = False

    async def aclose(self) -> None:
        self._closed = True
        await super().aclose()

    async def release(self, connection: AbstractConnection) -> None:
        await super().release(connection)
        if self._closed:
            await connection.disconnect()


class _BlockingSentinelPool(SentinelConnectionPool, _ClosingPool):
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


def _connect_cluster(settings: RedisSettings) -> _Cluster:
    kwargs = _connection_kwargs(settings)
    if settings.tls:
        kwargs["ssl"] = True
    return _Cluster(
        settings.pool_timeout_s,
        startup_nodes=[ClusterNode(host, port) for host, port in settings.cluster_nodes],
        # A MOVED reply only repoints its slot. By default every fifth one makes redis-py
        # close all its connections, those other callers are using too: while a slot
        # moved, their commands broke mid-flight ("Connection closed by server", even an
        # AttributeError). A dead node still makes it read the whole topology again.
        reinitialize_steps=0,
        **kwargs,
    )


# Set while a task holds one of a cluster client's permits: the command a pipeline sends
# again after a redirection runs inside the pipeline's permit, not waiting for a second.
_HOLDS_PERMIT: ContextVar[bool] = ContextVar("weir_redis_cluster_permit", default=False)


class _Cluster(RedisCluster):
    """redis-py's cluster client, with callers beyond `max_connections` waiting their
    turn (up to `pool_timeout_s`) as on a blocking pool, rather than refused at once by a
    node that has no free connection. A command holds at most one connection per node
    at a time, so the permits also bound the connections to the node of a pool's slot.
    A command still running when the client closes closes, when it ends, what its retries
    opened (redis-py would read the topology again and keep those connections)."""

    def __init__(self, pool_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._permits = asyncio.Semaphore(kwargs["max_connections"])
        self._pool_timeout_s = pool_timeout_s
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        await super().aclose()

    @asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        if _HOLDS_PERMIT.get():
            yield
            return
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._permits.acquire()
        except TimeoutError:
            raise ConnectionError("no free connection to the Redis Cluster") from None
        held = _HOLDS_PERMIT.set(True)
        try:
            yield
        finally:
            _HOLDS_PERMIT.reset(held)
            self._permits.release()
            if self._closed:
                await super().aclose()

    async def initialize(self, *args: Any, **kwargs: Any) -> _Cluster:
        """Read the cluster's slots. redis-py reports a cluster it cannot read (no node
        answers, AUTH refused, slots uncovered) with an exception outside RedisError,
        which the store's loops would not take for an outage and retry."""
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            refused = isinstance(exc.__cause__, AuthenticationError)
            raise (AuthenticationError if refused else ConnectionError)(str(exc)) from exc
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.permit():
            try:
                return await super().execute_command(*args, **kwargs)
            except SlotNotCoveredError as exc:  # outside RedisError too
                raise ConnectionError(str(exc)) from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # redis-py refuses it
        # redis-py's stubs leave an attribute of ClusterPipeline abstract that it sets.
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    """A pipeline that runs under one of its client's permits."""

    cluster_client: _Cluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        async with self.cluster_client.permit():
            return await super().execute(raise_on_error, allow_redirections)


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
