"""A Kubernetes API for the operator tests: kmock's emulator, declared with the resources
the operator uses, plus a kubeconfig that points both kopf and kubernetes_asyncio at it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.config import kube_config

from fleet_operator.config import OperatorConfig
from fleet_operator.handlers import build_registry
from fleet_operator.spec import GROUP, PLURAL, VERSION

VERBS = {"get", "list", "watch", "patch", "create", "update", "delete"}
POOLS = f"{GROUP}/{VERSION}/{PLURAL}"
RESOURCES = {
    f"{GROUP}/{VERSION}/{PLURAL}": ("InferencePool", True),
    "apps/v1/deployments": ("Deployment", True),
    "v1/services": ("Service", True),
    "v1/configmaps": ("ConfigMap", True),
    "v1/pods": ("Pod", True),
    "v1/events": ("Event", True),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True),
    "v1/namespaces": ("Namespace", False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
}


def declare(emulator: kmock.KubernetesEmulator) -> None:
    for key, (kind, namespaced) in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS)
    # As in the CRD: kopf then writes the status through the status subresource.
    emulator.resources[POOLS].subresources = {"status"}


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


@contextlib.asynccontextmanager
async def running_operator(settings: OperatorConfig) -> AsyncIterator[None]:
    """kopf, for real, cluster-wide, until the block ends."""
    ready: asyncio.Event = asyncio.Event()
    memo = kopf.Memo()
    task = asyncio.create_task(
        kopf.operator(
            registry=build_registry(settings),
            clusterwide=True,
            standalone=True,
            ready_flag=ready,
            memo=memo,
        )
    )
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(ready.wait())],
        timeout=30,
        return_when=asyncio.FIRST_COMPLETED,
    )
    if task in done:
        task.result()  # the operator died at startup: raise its error
    try:
        yield
    finally:
        # Cancelling (rather than the stop flag) skips kopf's 5-second grace period for
        # tasks it did not start, such as the emulator's. A cancel that lands while kopf
        # waits for its root tasks skips the cleanup handler, so what it would close is
        # closed here (closing twice is harmless); left to the collector, it surfaced as
        # an unraisable ResourceWarning in a later test.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)
        for client in (getattr(memo, "control", None), getattr(memo, "api", None)):
            if client is not None:
                await client.close()


async def api_client(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


def point_clients_at(monkeypatch: Any, kubeconfig: Path) -> None:
    """kopf's login and the operator's own client both read the default kubeconfig
    location, which kubernetes_asyncio fixes at import from $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


async def eventually(probe: Callable[[], Any], limit_s: float = 30.0, what: str = "") -> Any:
    """Poll `probe` until it returns something truthy; fail after `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or probe}")
        await asyncio.sleep(0.1)


def stored(
    emulator: kmock.KubernetesEmulator, resource: str, name: str, ns: str = "default"
) -> dict[str, Any] | None:
    try:
        obj = emulator.objects[resource, ns, name]
    except KeyError:
        return None
    if obj.deleted:
        return None
    raw: dict[str, Any] = obj.raw
    return raw
