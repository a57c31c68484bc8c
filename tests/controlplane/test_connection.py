"""Connection settings against real servers: TLS with AUTH, refused bad settings, callers
beyond the pool's size waiting for a connection (standalone, behind Sentinel, on a Redis
Cluster); a cluster that cannot be read failing as an outage; the URL forms every
component takes (a Sentinel-managed primary behind AUTH, a cluster among them); stopping
loops over Redis commands; URLs fit to log."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from controlplane.store import (
    EndpointRegistry,
    RedisSettings,
    cancel_loops,
    connect,
    redact_url,
)
from tests.controlplane.cluster_topology import ClusterTopology
from tests.controlplane.records import POOL, endpoint
from tests.controlplane.sentinel_topology import SERVICE, SentinelTopology
from tests.polling import until
from weir.local.ports import free_port
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis
PASSWORD = "s3cret-pass"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server that speaks only TLS and requires a password; (port, CA file)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make certificates")
    ca_key, ca, key, csr, cert = (
        tmp_path / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=weir-test-ca",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", str(key), "-out", str(csr))  # fmt: skip
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    port = free_port()
    server = RedisServer(
        port,
        extra_args=("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                    "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                    "--tls-auth-clients", "no", "--requirepass", PASSWORD),
    )  # fmt: skip
    with server:
        yield port, ca


async def test_tls_and_auth(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    url = f"redis://127.0.0.1:{port}/0"
    good = connect(RedisSettings(url=url, tls=True, tls_ca_file=str(ca), password=PASSWORD))
    try:
        stored = await EndpointRegistry(good, POOL).register(endpoint("a"), ttl_s=10)
        assert stored.epoch == 1
        assert set((await EndpointRegistry(good, POOL).snapshot()).endpoints) == {"a"}
    finally:
        await good.aclose()

    wrong = connect(
        RedisSettings(url=url, tls=True, tls_ca_file=str(ca), password="nope", retries=0)
    )
    try:
        with pytest.raises(redis.AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()

    plain = connect(RedisSettings(url=url, password=PASSWORD, retries=0, command_timeout_s=1))
    try:
        with pytest.raises(redis.ConnectionError):
            await plain.ping()
    finally:
        await plain.aclose()


@pytest.mark.parametrize(
    ("field", "value"),
    [("connect_timeout_s", 0), ("command_timeout_s", -1), ("retries", 101), ("max_connections", 0),
     ("pool_timeout_s", 0)],
)  # fmt: skip
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RedisSettings(**{field: value})  # type: ignore[arg-type]


async def _callers_share_two_connections(
    settings: RedisSettings, server_port: int, password: str | None = None
) -> None:
    """Twenty callers each hold a connection for a blocking read; the client has two: the
    others wait their turn (redis-py's default pool refused the third one at once with
    "Too many connections") and the server never sees more than two. The keys share a
    hash slot: on a cluster they are all on the server at `server_port`."""
    client = connect(settings)
    server = redis.Redis(port=server_port, password=password)
    try:
        replies = await asyncio.gather(
            *(client.blpop([f"{{two}}:empty-{i}"], timeout=0.05) for i in range(20))
        )
        assert replies == [None] * 20
        # Counted by their last command: a cluster client also keeps the connection it
        # read the topology on, if it picked this node to read it from.
        blocking = [
            c
            for c in await asyncio.to_thread(server.client_list)
            if c["name"] == settings.client_name and c["cmd"] == "blpop"
        ]
        assert len(blocking) == 2
    finally:
        server.close()
        await client.aclose()


async def test_callers_beyond_the_pool_wait_for_a_connection(redis_server: RedisServer) -> None:
    settings = RedisSettings(url=redis_server.url, max_connections=2, client_name="weir-two")
    await _callers_share_two_connections(settings, redis_server.port)


async def test_callers_beyond_the_pool_wait_for_a_connection_behind_sentinel() -> None:
    with SentinelTopology() as topology:
        settings = RedisSettings(
            sentinels=(("127.0.0.1", topology.sentinel_port),),
            sentinel_service=SERVICE,
            max_connections=2,
            client_name="weir-two-sentinel",
        )
        await _callers_share_two_connections(settings, topology.master.port)


async def test_callers_beyond_the_pool_wait_for_a_connection_on_a_cluster(
    redis_cluster: ClusterTopology,
) -> None:
    settings = RedisSettings.from_url(
        redis_cluster.url, max_connections=2, client_name="weir-two-cluster"
    )
    owner = redis_cluster.owner("{two}:empty-0")
    await _callers_share_two_connections(settings, owner.port, redis_cluster.password)


async def test_a_cluster_that_cannot_be_read_is_a_redis_error(
    redis_cluster: ClusterTopology,
) -> None:
    """redis-py reports an unreachable cluster, or one that refuses the password, outside
    RedisError; the store's loops take only RedisError for an outage they wait out."""
    wrong = connect(
        RedisSettings.from_url(redis_cluster.url.replace(":weir-", ":nope-"), retries=0)
    )
    nobody = connect(RedisSettings.from_url(f"redis+cluster://127.0.0.1:{free_port()}", retries=0))
    try:
        with pytest.raises(redis.AuthenticationError):
            await wrong.ping()
        with pytest.raises(redis.ConnectionError, match="cannot be connected"):
            await nobody.ping()
    finally:
        await wrong.aclose()
        await nobody.aclose()


async def test_a_loop_that_takes_a_cancellation_for_a_redis_timeout_is_still_stopped() -> None:
    """What a Redis loop does when a cancel lands in a command's timed-out read: the loop
    sees a RedisError, retries, and goes on. cancel_loops ends it all the same."""
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # taken for a timeout, retried

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0)
    await cancel_loops([task])
    assert task.cancelled()
    assert swallowed == 1


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@redis.weir.svc:6379/0", "redis://:***@redis.weir.svc:6379/0"),
        ("rediss://weir:s3cret@r.example:6380/0", "rediss://weir:***@r.example:6380/0"),
        ("redis://weir:p%40ss:w@rd@h:6379", "redis://weir:***@h:6379"),  # '@' and ':' in it
        ("redis://weir:s3cret@h/0?ssl_cert_reqs=none", "redis://weir:***@h/0?ssl_cert_reqs=none"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        (
            "redis+sentinel://:s3cret@s1:26379,s2:26379/weir?sentinel_password=s3cret2",
            "redis+sentinel://:***@s1:26379,s2:26379/weir?sentinel_password=***",
        ),
        (
            "rediss+cluster://weir:s3cret@n1:6379,n2:6379",
            "rediss+cluster://weir:***@n1:6379,n2:6379",
        ),
        ("redis://h:6379/0?Password=s3cret#x", "redis://h:6379/0?Password=***#x"),
        ("weir:s3cret@h:6379", "weir:***@h:6379"),  # no scheme
        # Nothing to hide: unchanged.
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://weir@h:6379/0", "redis://weir@h:6379/0"),  # a user name only
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("http://10.0.0.5:8001/path?q=1", "http://10.0.0.5:8001/path?q=1"),
        ("", ""),
    ],
)
def test_a_redacted_url_hides_only_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
    # What is shown still connects to the same place (same parse but the password).
    if url.startswith(("redis://", "rediss://")) and "@" in url:
        kept = redis.connection.parse_url(url)
        seen = redis.connection.parse_url(shown)
        assert {**kept, "password": None} == {**seen, "password": None}


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_primary_s_auth() -> None:
    settings = RedisSettings.from_url(
        "rediss+sentinel://weir:p%40ss@s1.redis:26379,[fd00::7]:26380/weir-prod/2"
        "?sentinel_password=sp",
        retries=3,
        client_name="weir-router",
    )
    assert settings.sentinels == (("s1.redis", 26379), ("fd00::7", 26380))
    assert (settings.sentinel_service, settings.db) == ("weir-prod", 2)
    assert (settings.username, settings.password) == ("weir", "p@ss")
    assert (settings.sentinel_password, settings.tls) == ("sp", True)
    assert (settings.retries, settings.client_name) == (3, "weir-router")
    plain = RedisSettings.from_url("redis+sentinel://127.0.0.1:26379/weir")
    assert (plain.username, plain.password, plain.db, plain.tls) == (None, None, 0, False)
    direct = RedisSettings.from_url("rediss://:pw@redis:6380/1", retries=1)
    assert (direct.url, direct.sentinels, direct.retries) == ("rediss://:pw@redis:6380/1", (), 1)


def test_a_cluster_url_names_the_nodes_to_discover_the_cluster_from() -> None:
    settings = RedisSettings.from_url(
        "rediss+cluster://weir:p%40ss@n1.redis:6379,[fd00::7]:6380/0", retries=3
    )
    assert settings.cluster_nodes == (("n1.redis", 6379), ("fd00::7", 6380))
    assert (settings.username, settings.password, settings.tls) == ("weir", "p@ss", True)
    assert (settings.url, settings.sentinels, settings.db, settings.retries) == ("", (), 0, 3)
    plain = RedisSettings.from_url("redis+cluster://127.0.0.1:7000")
    assert (plain.cluster_nodes, plain.password, plain.tls) == ((("127.0.0.1", 7000),), None, False)
    with pytest.raises(ValueError, match="only database 0"):
        RedisSettings(cluster_nodes=(("n1", 6379),), db=1)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://:s3cret@redis:6379/0", "unsupported Redis URL"),
        ("127.0.0.1:6379", "unsupported Redis URL"),
        ("redis+sentinel://:s3cret@/weir", "names no sentinel"),
        ("redis+sentinel://:s3cret@s1/weir", "is not host:port"),
        ("redis+sentinel://:s3cret@s1:99999/weir", "is not host:port"),
        ("redis+sentinel://:s3cret@s1:26379", "/service or /service/db"),
        ("redis+sentinel://:s3cret@s1:26379/weir/zero", "must be a number"),
        ("redis+sentinel://:s3cret@s1:26379/weir?password=x", "unknown parameter"),
        ("redis+cluster://:s3cret@/", "names no cluster node"),
        ("redis+cluster://:s3cret@n1,n2:6379", "is not host:port"),
        ("redis+cluster://:s3cret@n1:6379/1", "only database 0"),
        ("redis+cluster://:s3cret@n1:6379?password=s3cret", "takes no parameters"),
    ],
)
def test_a_url_no_component_can_use_is_refused_without_showing_its_password(
    url: str, complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint) as refused:
        RedisSettings.from_url(url)
    assert "s3cret" not in str(refused.value)


async def test_the_primary_behind_sentinel_with_auth_is_reached_from_a_url() -> None:
    with SentinelTopology(password=PASSWORD) as topology:
        client = connect(RedisSettings.from_url(topology.url, retries=1))
        try:
            stored = await EndpointRegistry(client, POOL).register(endpoint("a"), ttl_s=10)
            assert stored.epoch == 1
        finally:
            await client.aclose()
        wrong = topology.url.replace(PASSWORD, "nope")
        refused = connect(RedisSettings.from_url(wrong, retries=0))
        try:
            with pytest.raises(redis.AuthenticationError):
                await refused.ping()
        finally:
            await refused.aclose()


async def _closing_leaves_no_connection_open(
    settings: RedisSettings, server_port: int, password: str | None = None
) -> None:
    """A task's command in flight while another closes the client (a component's
    background loop at shutdown): closing drops the command's connection, its retry
    opens a new one, and that one must close when it comes back to the closed client —
    redis-py's pool closes only the connections it holds at the moment it closes, so the
    socket stayed open until garbage collection found it (an unraisable
    ResourceWarning in whatever test ran then)."""
    client = connect(settings)
    server = redis.Redis(port=server_port, password=password)

    def named() -> list[dict[str, str]]:
        return [c for c in server.client_list() if c["name"] == settings.client_name]

    waiting = asyncio.create_task(client.blpop(["{closing}:empty"], timeout=0.5))
    try:
        await until(lambda: asyncio.to_thread(named), "the command's connection")
        await client.aclose()
        assert await waiting is None  # the retry ran to the end of its timeout
        assert await asyncio.to_thread(named) == []
    finally:
        waiting.cancel()
        server.close()
        await client.aclose()


async def test_a_command_still_running_when_its_client_closes_leaves_no_connection_open(
    redis_server: RedisServer,
) -> None:
    settings = RedisSettings(url=redis_server.url, retries=3, client_name="weir-closing")
    await _closing_leaves_no_connection_open(settings, redis_server.port)


async def test_a_command_still_running_when_its_cluster_client_closes_leaves_none_open(
    redis_cluster: ClusterTopology,
) -> None:
    settings = RedisSettings.from_url(redis_cluster.url, retries=3, client_name="weir-closing")
    owner = redis_cluster.owner("{closing}:empty")
    await _closing_leaves_no_connection_open(settings, owner.port, redis_cluster.password)
