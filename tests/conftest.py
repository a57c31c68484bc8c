"""Fixtures shared by every test: real servers on loopback ports."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.controlplane.cluster_topology import ClusterTopology, running_cluster
from tests.kube.control_plane import (
    Cluster,
    ControlPlane,
    ControlPlaneUnavailableError,
    binaries,
)
from tests.tiers import unavailable
from weir.local.prometheus import PrometheusNotInstalledError
from weir.local.redis_server import RedisNotInstalledError, RedisServer

# What a component raises when a binary it starts is not installed (bootstrap installs
# them), by the tier that needs it: its tests skip, saying why, and fail in CI.
_NOT_INSTALLED: dict[type[Exception], str] = {
    RedisNotInstalledError: "Redis",
    PrometheusNotInstalledError: "Prometheus",
}


def _not_installed_skips(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    except tuple(_NOT_INSTALLED) as exc:
        unavailable(_NOT_INSTALLED[type(exc)], str(exc))


# In a fixture (setup) or in the test itself (call).
pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_not_installed_skips)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_not_installed_skips)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With pytest-xdist (`WEIR_TEST_WORKERS=N make check`: `--dist loadgroup`), each
    tier that shares one costly process goes to one worker, so it starts once: the
    Kubernetes control plane, and the real SGLang servers (their tests also start their
    own servers: two CPU-heavy servers at once would only slow each other down). Called
    with the whole session's items, e2e's included."""
    for item in items:
        if item.get_closest_marker("sglang") is not None:
            item.add_marker(pytest.mark.xdist_group("sglang"))
        elif "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("kube"))


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


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterTopology]:
    """One real Redis Cluster (three primaries, one replica each, AUTH on) for the
    session. Tests that move slots or kill nodes start a cluster of their own."""
    with running_cluster(password="weir-cluster") as topology:
        yield topology


@pytest.fixture
def redis_cluster_url(redis_cluster: ClusterTopology) -> str:
    """The session's cluster, emptied: a `redis+cluster://` URL."""
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture(params=["standalone", "cluster"])
def store_url(request: pytest.FixtureRequest) -> str:
    """An empty Redis of either kind, as the URL every component takes: a test that
    takes it runs on both."""
    fixture = "redis_url" if request.param == "standalone" else "redis_cluster_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that restart or kill it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def kube() -> Iterator[Cluster]:
    """One Kubernetes cluster for the session; tests take namespaces of their own.

    By default the suite's own control plane (etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler, kwok's fake node), which scripts/k8s_controlplane.sh builds; the tier
    skips without it (fails in CI). With WEIR_TEST_KUBECONFIG, an existing cluster instead:
    the CRD and chart tests run there; tests that need kwok's node or stop the API server
    skip."""
    external = os.environ.get("WEIR_TEST_KUBECONFIG")
    try:
        if external:
            yield Cluster(Path(external), binaries())
            return
        plane = ControlPlane()
    except ControlPlaneUnavailableError as exc:
        unavailable("Kubernetes", str(exc))
    with plane:
        yield plane
