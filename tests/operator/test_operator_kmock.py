"""The operator, run for real by kopf, against kmock's Kubernetes emulator and a real
redis-server. The emulator runs no controllers: the tests play the Deployment controller
and the sidecars (pods, their readiness and their heartbeats) where a scenario needs them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import msgspec
import pytest
import redis.asyncio
from kubernetes_asyncio import client

from controlplane.contract import EndpointState, Lifecycle, PoolPolicy, WatermarkState, decode_json
from controlplane.store import EndpointRegistry, PoolKeys
from fleet_operator.applying import MERGE_PATCH
from fleet_operator.config import OperatorConfig
from fleet_operator.observing import DELETION_COST
from fleet_operator.spec import GROUP, PLURAL, VERSION
from tests.operator.cluster import (
    POOLS,
    api_client,
    declare,
    eventually,
    point_clients_at,
    running_operator,
    stored,
    write_kubeconfig,
)
from weir.local.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

DEPLOYMENTS = "apps/v1/deployments"
DEPLOYMENT_RESOURCE = kmock.resource(DEPLOYMENTS)
# The client's stubs omit `_content_type`; its default for a dict would be a JSON patch.
MERGE: dict[str, Any] = {"_content_type": MERGE_PATCH}


def pool_manifest(name: str = "llama", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "contextLength": 8192},
        "engine": {"image": "lmsysorg/sglang:v0.5.5", "tensorParallel": 2},
        "replicas": {"min": 2, "max": 2},
        "kv": {"pageSize": 32, "lowWatermark": 0.6, "highWatermark": 0.8},
        "scheduling": {"chunkedPrefillSize": 4096, "maxRunningRequests": 64},
    }
    body.update(spec)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferencePool",
        # The emulator assigns neither: kopf's JSON patches test the resourceVersion, and
        # children's owner references need the uid.
        "metadata": {
            "name": name,
            "namespace": "default",
            "resourceVersion": "1",
            "uid": f"uid-{name}",
        },
        "spec": body,
    }


class Cluster:
    def __init__(self, emulator: kmock.KubernetesEmulator, api: client.ApiClient) -> None:
        self.emulator = emulator
        self.api = api
        self.pools = client.CustomObjectsApi(api)

    async def create_pool(self, manifest: dict[str, Any]) -> None:
        await self.pools.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, manifest
        )

    async def patch_pool(self, name: str, spec: dict[str, Any]) -> None:
        await self.pools.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, name, {"spec": spec}, **MERGE
        )

    async def delete_pool(self, name: str) -> None:
        await self.pools.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        return stored(self.emulator, resource, name)

    def status(self, name: str = "llama") -> dict[str, Any]:
        pool = self.get(POOLS, name) or {}
        status: dict[str, Any] = pool.get("status") or {}
        return status

    def condition(self, kind: str, name: str = "llama") -> dict[str, Any]:
        for item in self.status(name).get("conditions") or []:
            if item["type"] == kind:
                return dict(item)
        return {}

    def patches(self, resource: str) -> int:
        res = kmock.resource(resource)
        return sum(1 for r in self.emulator if r.method == "PATCH" and r.resource == res)

    def add_pod(self, pool: str, name: str, ready: bool = True) -> None:
        self.emulator.objects["v1/pods", "default", name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": {"inference.weir.dev/pool": pool},
            },
            "spec": {"containers": [{"name": "engine", "image": "sglang"}]},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
        }

    def mark_ready(self, name: str, replicas: int) -> None:
        """Play the Deployment controller: every engine up to date and ready."""
        self.emulator.objects[DEPLOYMENTS, "default", name].patch(
            {
                "metadata": {"generation": 1},
                "status": {
                    "observedGeneration": 1,
                    "replicas": replicas,
                    "readyReplicas": replicas,
                    "updatedReplicas": replicas,
                },
            }
        )


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    r = redis.asyncio.Redis.from_url(redis_url)
    yield r
    await r.aclose()


@contextlib.asynccontextmanager
async def operated_cluster(
    emulator: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> AsyncIterator[Cluster]:
    """The emulator with the operator running against it and the control plane at `url`."""
    declare(emulator)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(emulator.url))
    point_clients_at(monkeypatch, kubeconfig)
    api = await api_client(kubeconfig)
    settings = OperatorConfig(redis_url=url, status_interval_s=0.3, image="weir:test")
    try:
        async with running_operator(settings):
            yield Cluster(emulator, api)
    finally:
        await api.close()


@pytest.fixture
async def cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> AsyncIterator[Cluster]:
    async with operated_cluster(kmock, tmp_path, monkeypatch, redis_url) as operated:
        yield operated


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = next(c for c in containers if c["name"] == name)
    return found


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


async def register(registry: EndpointRegistry, endpoint_id: str, **fields: Any) -> EndpointState:
    state = EndpointState(
        pool=registry.pool,
        endpoint_id=endpoint_id,
        address=f"http://10.0.0.1:8000/{endpoint_id}",
        model="meta-llama/Llama-3.1-8B-Instruct",
        **fields,
    )
    return await registry.register(state, ttl_s=60)


async def test_create_renders_children_with_the_specs_flags(cluster: Cluster) -> None:
    await cluster.create_pool(pool_manifest())
    deployment = await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"), what="deployment")

    assert deployment["spec"]["replicas"] == 2
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("InferencePool", "llama")
    args = container(deployment, "engine")["args"]
    assert flag(args, "--model-path") == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(args, "--tp") == "2"
    assert flag(args, "--page-size") == "32"
    assert flag(args, "--context-length") == "8192"
    assert flag(args, "--chunked-prefill-size") == "4096"
    assert flag(args, "--max-running-requests") == "64"
    assert "--enable-priority-scheduling" in args
    assert container(deployment, "engine")["resources"]["limits"]["nvidia.com/gpu"] == "2"
    sidecar = container(deployment, "sidecar")
    assert sidecar["image"] == "weir:test"
    assert flag(sidecar["args"], "--pool") == "llama"
    assert sidecar["lifecycle"]["preStop"]["exec"]["command"][:3] == ["weir", "sidecar", "drain"]

    configmap = await eventually(lambda: cluster.get("v1/configmaps", "llama-policy"))
    policy = decode_json(configmap["data"]["policy.json"], PoolPolicy)
    assert (policy.pool, policy.kv.low_watermark, policy.kv.page_size) == ("llama", 0.6, 32)
    service = await eventually(lambda: cluster.get("v1/services", "llama"))
    assert service["spec"]["clusterIP"] == "None"
    assert await eventually(lambda: cluster.get("policy/v1/poddisruptionbudgets", "llama"))
    pool = await eventually(lambda: cluster.status().get("observedGeneration") is not None)
    assert pool


async def test_spec_change_patches_only_what_changed(cluster: Cluster) -> None:
    await cluster.create_pool(pool_manifest())
    await eventually(lambda: cluster.get("policy/v1/poddisruptionbudgets", "llama"))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))
    before = {r: cluster.patches(r) for r in ("v1/configmaps", "v1/services", DEPLOYMENTS)}

    await cluster.patch_pool("llama", {"engine": {"image": "lmsysorg/sglang:v0.5.23"}})

    def engine_image() -> str | None:
        deployment = cluster.get(DEPLOYMENTS, "llama") or {}
        image = container(deployment, "engine")["image"] if deployment else None
        return image if image == "lmsysorg/sglang:v0.5.23" else None

    await eventually(engine_image, what="the new engine image")
    assert cluster.patches(DEPLOYMENTS) > before[DEPLOYMENTS]
    assert cluster.patches("v1/configmaps") == before["v1/configmaps"]
    assert cluster.patches("v1/services") == before["v1/services"]

    # A policy change reaches the ConfigMap and rolls the pods (the policy hash).
    old_hash = (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["template"]["metadata"][
        "annotations"
    ]["inference.weir.dev/policy-hash"]
    await cluster.patch_pool("llama", {"kv": {"lowWatermark": 0.5}})

    def low_watermark() -> float | None:
        data = (cluster.get("v1/configmaps", "llama-policy") or {})["data"]["policy.json"]
        value = json.loads(data)["kv"]["low_watermark"]
        return value if value == 0.5 else None

    await eventually(low_watermark, what="the new policy")
    new_hash = await eventually(
        lambda: (
            h
            if (
                h := (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["template"]["metadata"][
                    "annotations"
                ]["inference.weir.dev/policy-hash"]
            )
            != old_hash
            else None
        )
    )
    assert new_hash != old_hash
    assert cluster.patches("v1/services") == before["v1/services"]


async def test_status_reflects_the_control_plane(cluster: Cluster, redis_client: Any) -> None:
    registry = EndpointRegistry(redis_client, "llama")
    await register(
        registry,
        "llama-a",
        kv_capacity_tokens=1000,
        kv_used_tokens=500,
        kv_reserved_growth_tokens=100,
    )
    await register(
        registry,
        "llama-b",
        kv_capacity_tokens=1000,
        kv_used_tokens=900,
        watermark=WatermarkState.CRITICAL,
    )
    await cluster.create_pool(pool_manifest())
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))
    cluster.mark_ready("llama", 2)

    await eventually(lambda: cluster.condition("Ready").get("status") == "True", what="Ready")
    status = cluster.status()
    assert status["endpoints"] == {"live": 2, "draining": 0, "expired": 0}
    assert status["watermarks"]["critical"] == 1
    assert status["watermarks"]["normal"] == 1
    assert status["kvUsage"] == "75%"
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert cluster.condition("ControlPlaneReachable")["status"] == "True"
    assert cluster.condition("Degraded")["status"] == "False"
    assert cluster.condition("Progressing")["reason"] == "Stable"


async def test_scale_down_drains_the_victim_first(cluster: Cluster, redis_client: Any) -> None:
    registry = EndpointRegistry(redis_client, "llama")
    await cluster.create_pool(pool_manifest(replicas={"min": 3, "max": 3}))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))
    cluster.mark_ready("llama", 3)
    in_flight = {"llama-a": 5, "llama-b": 2, "llama-c": 7}
    states = {}
    for pod_name, running in in_flight.items():
        cluster.add_pod("llama", pod_name)
        states[pod_name] = await register(registry, pod_name, running_requests=running)

    await cluster.patch_pool("llama", {"replicas": {"min": 2, "max": 2}})

    drain = await eventually(lambda: cluster.status().get("drain"), what="a drain")
    assert drain["victims"] == ["llama-b"]
    assert drain["targetReplicas"] == 2
    snapshot = await registry.snapshot()
    assert snapshot.endpoints["llama-b"].lifecycle is Lifecycle.DRAINING
    assert snapshot.endpoints["llama-a"].lifecycle is Lifecycle.READY
    pod = cluster.get("v1/pods", "llama-b") or {}
    assert pod["metadata"]["annotations"][DELETION_COST] == "-1000"
    # The victim still has requests in flight: the Deployment keeps its engines.
    await eventually(lambda: cluster.condition("Progressing").get("reason") == "Draining")
    assert (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["replicas"] == 3

    # Its requests finish; the next pass lets the Deployment drop exactly one engine.
    victim = states["llama-b"]
    idle = msgspec.structs.replace(
        victim, version=victim.version + 1, lifecycle=Lifecycle.DRAINING, running_requests=0
    )
    await registry.heartbeat(idle, ttl_s=60)
    await eventually(
        lambda: (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["replicas"] == 2,
        what="scale-down after the drain",
    )
    await eventually(lambda: "drain" not in cluster.status(), what="the drain to clear")


async def test_delete_clears_the_control_plane(cluster: Cluster, redis_client: Any) -> None:
    registry = EndpointRegistry(redis_client, "llama")
    await register(registry, "llama-a")
    other = EndpointRegistry(redis_client, "other")
    await register(other, "other-a")
    await cluster.create_pool(pool_manifest())
    pool = await eventually(lambda: cluster.get(POOLS, "llama"))
    await eventually(
        lambda: (cluster.get(POOLS, "llama") or {}).get("metadata", {}).get("finalizers"),
        what="the finalizer",
    )
    assert pool

    await cluster.delete_pool("llama")

    await eventually(lambda: cluster.get(POOLS, "llama") is None, what="the pool to go")
    keys = [k async for k in redis_client.scan_iter(match=PoolKeys("llama").pattern)]
    assert keys == []
    assert (await other.snapshot()).endpoints.keys() == {"other-a"}


async def test_invalid_pool_is_degraded_not_crashing(cluster: Cluster) -> None:
    bad = pool_manifest(kv={"lowWatermark": 0.9, "highWatermark": 0.8})
    await cluster.create_pool(bad)

    degraded = await eventually(
        lambda: cluster.condition("Degraded") if cluster.condition("Degraded") else None
    )
    assert degraded["status"] == "True"
    assert degraded["reason"] == "InvalidSpec"
    assert "watermarks" in degraded["message"]
    assert cluster.get(DEPLOYMENTS, "llama") is None

    # The operator is alive: fixing the spec brings the pool up.
    await cluster.patch_pool("llama", {"kv": {"lowWatermark": 0.7}})
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"), what="deployment after fix")
    await eventually(lambda: cluster.condition("Degraded").get("status") == "False")


async def test_unreachable_control_plane_is_a_condition(
    kmock: kmock.KubernetesEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_redis: RedisServer,
) -> None:
    async with operated_cluster(kmock, tmp_path, monkeypatch, fresh_redis.url) as cluster:
        await cluster.create_pool(pool_manifest())

        def reachable() -> str | None:
            status = cluster.condition("ControlPlaneReachable").get("status")
            return status if isinstance(status, str) else None

        assert await eventually(reachable) == "True"
        fresh_redis.stop()
        await eventually(lambda: reachable() == "False", what="Redis reported unreachable")
        assert cluster.condition("ControlPlaneReachable")["reason"] == "RedisUnavailable"
        fresh_redis.start()  # same port, empty: the operator reconnects by itself
        await eventually(lambda: reachable() == "True", what="Redis reachable again")


async def test_autoscaling_adds_engines_under_kv_pressure(
    cluster: Cluster, redis_client: Any
) -> None:
    registry = EndpointRegistry(redis_client, "llama")
    await register(registry, "llama-a", kv_capacity_tokens=1000, kv_used_tokens=900)
    autoscaling = {
        "enabled": True,
        "targetKvPressure": 0.5,
        "scaleUpStabilizationS": 0,
        "scaleDownStabilizationS": 600,
    }
    await cluster.create_pool(pool_manifest(replicas={"min": 1, "max": 3}, autoscaling=autoscaling))
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))

    await eventually(
        lambda: (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["replicas"] == 3,
        what="scale-up to replicas.max",
    )
    assert cluster.status()["autoscaler"]["recommendations"]


async def test_servicemonitor_when_prometheus_operator_is_installed(cluster: Cluster) -> None:
    cluster.emulator.resources["monitoring.coreos.com/v1/servicemonitors"] = kmock.ResourceInfo(
        kind="ServiceMonitor", namespaced=True, verbs={"get", "create", "patch"}
    )
    crds = "apiextensions.k8s.io/v1/customresourcedefinitions"
    cluster.emulator.objects[crds, None, "servicemonitors.monitoring.coreos.com"] = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": "ServiceMonitor", "plural": "servicemonitors"},
            "versions": [{"name": "v1", "served": True, "storage": True}],
        },
    }
    await cluster.create_pool(pool_manifest())
    monitor = await eventually(
        lambda: cluster.get("monitoring.coreos.com/v1/servicemonitors", "llama"),
        what="the ServiceMonitor",
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["metadata"]["ownerReferences"][0]["name"] == "llama"


async def test_scale_down_proceeds_after_the_drain_deadline(
    cluster: Cluster, redis_client: Any
) -> None:
    registry = EndpointRegistry(redis_client, "llama")
    await cluster.create_pool(
        pool_manifest(replicas={"min": 2, "max": 2}, sidecar={"drainDeadlineSeconds": 1})
    )
    await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))
    for pod_name in ("llama-a", "llama-b"):
        cluster.add_pod("llama", pod_name)
        await register(registry, pod_name, running_requests=4)  # never finishes

    await cluster.patch_pool("llama", {"replicas": {"min": 1, "max": 1}})

    await eventually(lambda: cluster.status().get("drain"), what="a drain")
    await eventually(
        lambda: (cluster.get(DEPLOYMENTS, "llama") or {})["spec"]["replicas"] == 1,
        what="scale-down once the deadline passed",
    )
    drained = [
        e
        for e, s in (await registry.snapshot()).endpoints.items()
        if s.lifecycle is Lifecycle.DRAINING
    ]
    assert len(drained) == 1


async def test_restarted_operator_adopts_children_without_patching(
    kmock: kmock.KubernetesEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
) -> None:
    async with operated_cluster(kmock, tmp_path, monkeypatch, redis_url) as cluster:
        await cluster.create_pool(pool_manifest())
        await eventually(lambda: cluster.get("policy/v1/poddisruptionbudgets", "llama"))
        await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))
        await eventually(lambda: cluster.status().get("observedGeneration") is not None)
    children = (DEPLOYMENTS, "v1/services", "v1/configmaps", "policy/v1/poddisruptionbudgets")
    before = {r: cluster.patches(r) for r in children}
    requests_before = len(list(kmock))

    async with operated_cluster(kmock, tmp_path, monkeypatch, redis_url) as again:
        # The resumed pool is read again (a GET of its Deployment), then left alone.
        await eventually(
            lambda: any(
                r.method == "GET" and r.resource == DEPLOYMENT_RESOURCE
                for r in list(kmock)[requests_before:]
            ),
            what="the resumed operator to look at the pool",
        )
        await eventually(lambda: again.condition("Ready"), what="status after resume")
        assert {r: again.patches(r) for r in children} == before


async def test_a_deleted_deployment_is_rendered_again(cluster: Cluster) -> None:
    await cluster.create_pool(pool_manifest())
    await eventually(lambda: cluster.status().get("observedGeneration") is not None)
    first = await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"))

    await client.AppsV1Api(cluster.api).delete_namespaced_deployment("llama", "default")
    assert cluster.get(DEPLOYMENTS, "llama") is None

    again = await eventually(lambda: cluster.get(DEPLOYMENTS, "llama"), what="the Deployment back")
    assert again["spec"] == first["spec"]
