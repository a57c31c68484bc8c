"""The operator on a real control plane, as the chart's ServiceAccount.

The API server validates and stores, the Deployment and ReplicaSet controllers make pods,
the scheduler places them on kwok's fake node, kwok runs them (Running, Ready, an IP),
the garbage collector removes children. The tests play only the sidecars, registering
endpoints in a real redis-server under the pods' names. Every call the operator makes
goes through the chart's RBAC: a 403 anywhere fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio
from kubernetes_asyncio.client.exceptions import ApiException

from controlplane.contract import EndpointState, Lifecycle, PoolPolicy, decode_json
from controlplane.store import EndpointRegistry, PoolKeys
from fleet_operator import observing, reconciling
from fleet_operator.applying import FIELD_MANAGER, write_status
from fleet_operator.config import OperatorConfig
from fleet_operator.handlers import connect_kubernetes
from fleet_operator.observing import DELETION_COST
from tests.kube.control_plane import Cluster, ControlPlane
from tests.kube.fault_proxy import FaultProxy
from tests.operator.cluster import operator_thread, point_clients_at, until
from tests.operator.real_cluster import CRD_NAME, Installation, install_crd
from weir.local.ports import free_port

pytestmark = [pytest.mark.kube, pytest.mark.redis, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = ("serviceaccount", "deployment", "service", "configmap", "poddisruptionbudget")


def child_name(kind: str, pool: str) -> str:
    return {"configmap": f"{pool}-policy", "serviceaccount": f"{pool}-engine"}.get(kind, pool)


@pytest.fixture(scope="module")
def crd(kube: Cluster) -> ControlPlane:
    if not isinstance(kube, ControlPlane):
        pytest.skip("needs the suite's own control plane (kwok's node runs the engine pods)")
    install_crd(kube)
    return kube


@dataclass
class Weir:
    """An installation with its operator running in this process."""

    install: Installation
    redis: redis.asyncio.Redis
    settings: OperatorConfig
    restart: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]

    def registry(self, pool: str) -> EndpointRegistry:
        return EndpointRegistry(self.redis, pool)

    def kubectl(self, *args: str, stdin: str | None = None) -> Any:
        return self.install.kube.kubectl(*args, "-n", self.install.namespace, stdin=stdin)

    def apply_pool(self, name: str, **spec: Any) -> None:
        applied = self.kubectl(
            "apply", "-f", "-", stdin=json.dumps(self.install.pool(name, **spec))
        )
        assert applied.returncode == 0, applied.stderr

    def patch_pool(self, name: str, spec: dict[str, Any]) -> None:
        patched = self.kubectl(
            "patch", CRD_NAME, name, "--type=merge", "-p", json.dumps({"spec": spec})
        )
        assert patched.returncode == 0, patched.stderr

    def pool(self, name: str) -> dict[str, Any]:
        return self.install.get(CRD_NAME, name) or {}

    def status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = self.pool(name).get("status") or {}
        return status

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return self.install.condition(name, kind)

    def replicas(self, name: str) -> int | None:
        deployment = self.install.get("deployment", name)
        return None if deployment is None else int(deployment["spec"]["replicas"])

    def ready_pods(self, pool: str) -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in self.install.pods(pool)
            if p.get("status", {}).get("podIP")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions") or []
            )
        )

    def versions(self, name: str) -> dict[str, str]:
        """resourceVersion of the pool and of each child: any write changes one."""
        found = {"pool": self.pool(name)["metadata"]["resourceVersion"]}
        for kind in CHILDREN:
            child = self.install.get(kind, child_name(kind, name))
            assert child is not None, kind
            found[kind] = child["metadata"]["resourceVersion"]
        return found

    def events(self, name: str) -> list[dict[str, Any]]:
        got = self.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}",
                           "-o", "json")  # fmt: skip
        assert got.returncode == 0, got.stderr
        items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
        return items


def changes(before: Any, after: Any, path: str = "") -> list[str]:
    """Where two objects differ, as paths with both values: a readable assertion."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            change
            for key in sorted(before.keys() | after.keys())
            for change in changes(before.get(key), after.get(key), f"{path}.{key}")
        ]
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def forbidden(records: list[logging.LogRecord]) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if "403" in r.getMessage() or "forbidden" in r.getMessage().lower()
    ]


@pytest.fixture
def faults(crd: ControlPlane) -> Iterator[FaultProxy]:
    with FaultProxy(crd.server, crd.pki / "ca.crt") as proxy:
        yield proxy


@pytest.fixture
async def weir(
    crd: ControlPlane,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Weir]:
    """Weir installed, its operator running; through the fault proxy for tests that ask
    for `faults`."""
    caplog.set_level(logging.INFO)
    install = Installation(crd, redis_url, tmp_path)
    if "faults" in request.fixturenames:
        proxy: FaultProxy = request.getfixturevalue("faults")
        config = json.loads(install.operator_kubeconfig.read_text())
        config["clusters"][0]["cluster"] = {"server": proxy.url}
        install.operator_kubeconfig.write_text(json.dumps(config))
    point_clients_at(monkeypatch, install.operator_kubeconfig)
    settings = OperatorConfig(redis_url=redis_url, status_interval_s=0.5, image="weir:test")
    client = redis.asyncio.Redis.from_url(redis_url)
    stack = contextlib.ExitStack()

    async def restart() -> None:
        await asyncio.to_thread(stack.close)
        await asyncio.to_thread(stack.enter_context, operator_thread(settings, [install.namespace]))

    async def stop() -> None:
        await asyncio.to_thread(stack.close)

    await asyncio.to_thread(stack.enter_context, operator_thread(settings, [install.namespace]))
    try:
        yield Weir(install, client, settings, restart, stop)
    finally:
        await asyncio.to_thread(stack.close)
        await client.aclose()
    assert forbidden(caplog.records) == []


async def register(registry: EndpointRegistry, endpoint_id: str, **fields: Any) -> EndpointState:
    state = EndpointState(
        pool=registry.pool,
        endpoint_id=endpoint_id,
        address=f"http://{endpoint_id}:8000",
        model="meta-llama/Llama-3.1-8B-Instruct",
        kv_capacity_tokens=1000,
        **fields,
    )
    return await registry.register(state, ttl_s=120)


async def test_a_pool_comes_up_with_its_children_and_pods(weir: Weir) -> None:
    weir.apply_pool(
        "llama",
        replicas={"min": 2, "max": 2},
        kv={"pageSize": 32, "lowWatermark": 0.6, "highWatermark": 0.8},
        scheduling={"chunkedPrefillSize": 4096, "maxRunningRequests": 64},
    )
    pods = await until(lambda: len(weir.ready_pods("llama")) == 2 and weir.ready_pods("llama"),
                            timeout_s=90, what="two engine pods Running and Ready")  # fmt: skip
    pool_uid = weir.pool("llama")["metadata"]["uid"]
    for kind in CHILDREN:
        child = weir.install.get(kind, child_name(kind, "llama"))
        assert child is not None, kind
        owner = child["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "InferencePool",
            pool_uid,
            True,
        )
        managers = {m["manager"] for m in child["metadata"]["managedFields"]}
        assert FIELD_MANAGER in managers, (kind, managers)
    configmap = weir.install.get("configmap", "llama-policy") or {}
    policy = decode_json(configmap["data"]["policy.json"], PoolPolicy)
    assert (policy.pool, policy.kv.low_watermark, policy.kv.page_size) == ("llama", 0.6, 32)
    deployment = weir.install.get("deployment", "llama") or {}
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][engine["args"].index("--chunked-prefill-size") + 1] == "4096"
    # The namespace enforces Pod Security's `restricted` profile: these pods exist, so the
    # server admitted them. They run as the pool's ServiceAccount, with no API token.
    assert weir.install.pod_security() == "restricted"
    for pod in weir.install.pods("llama"):
        spec = pod["spec"]
        assert spec["serviceAccountName"] == "llama-engine"
        assert not [v for v in spec["volumes"] if v["name"].startswith("kube-api-access")]
        for container in spec["containers"]:
            assert not [m for m in container["volumeMounts"]
                        if m["mountPath"].startswith("/var/run/secrets/kubernetes.io")]  # fmt: skip

    # Not ready until the sidecars hold leases in the control plane.
    assert weir.condition("llama", "Ready").get("status") != "True"
    registry = weir.registry("llama")
    for pod in pods:
        await register(registry, pod, kv_used_tokens=300)
    await until(lambda: weir.condition("llama", "Ready").get("reason") == "EnginesReady",
                     what="Ready")  # fmt: skip
    status = weir.status("llama")
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["endpoints"] == {"live": 2, "draining": 0, "expired": 0}
    assert status["kvUsage"] == "30%"
    assert weir.condition("llama", "Progressing")["reason"] == "Stable"


async def test_a_pd_pair_of_pools_runs_engines_that_serve_their_halves(weir: Weir) -> None:
    """A decode pool and the prefill pool that names it: the server admits both
    Deployments (under Pod Security's `restricted` profile), each engine launched for its
    half, the prefill engines with their bootstrap port."""
    weir.apply_pool("ds-decode", role="decode")
    weir.apply_pool("ds-prefill", role="prefill", decodePool="ds-decode",
                    engine={"bootstrapPort": 9100, "transferBackend": "nixl"})  # fmt: skip
    await until(
        lambda: weir.ready_pods("ds-decode") and weir.ready_pods("ds-prefill"),
        timeout_s=90, what="an engine pod of each pool Running and Ready",
    )  # fmt: skip
    for name, mode in (("ds-decode", "decode"), ("ds-prefill", "prefill")):
        deployment = weir.install.get("deployment", name) or {}
        engine = deployment["spec"]["template"]["spec"]["containers"][0]
        args = engine["args"]
        assert args[args.index("--disaggregation-mode") + 1] == mode
        assert args[args.index("--host") + 1] == "0.0.0.0"
        policy = decode_json((weir.install.get("configmap", f"{name}-policy") or {})["data"]
                             ["policy.json"], PoolPolicy)  # fmt: skip
        assert policy.role.value == mode
    prefill = (weir.install.get("deployment", "ds-prefill") or {})["spec"]["template"]["spec"]
    engine = prefill["containers"][0]
    assert engine["args"][engine["args"].index("--disaggregation-bootstrap-port") + 1] == "9100"
    assert engine["ports"] == [{"name": "bootstrap", "containerPort": 9100, "protocol": "TCP"}]


async def test_a_steady_pool_makes_no_writes(weir: Weir, caplog: pytest.LogCaptureFixture) -> None:
    """Quantities the server rewrites (0.5 → 500m, 1024Mi → 1Gi) and fields it omits
    (publishNotReadyAddresses: false) are no difference: neither the status passes nor a
    restarted operator's resume write anything."""
    weir.apply_pool(
        "steady",
        engine={"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"},
                              "limits": {"memory": "1024Mi"}}},
        sidecar={"resources": {"requests": {"cpu": "0.25", "memory": "0.5Gi"}}},
        autoscaling={"enabled": True, "scaleDownStabilizationS": 30},
        replicas={"min": 1, "max": 2},
    )  # fmt: skip
    [pod] = await until(lambda: weir.ready_pods("steady"), timeout_s=90, what="the pod")
    await register(weir.registry("steady"), pod, kv_used_tokens=500)
    await until(lambda: weir.condition("steady", "Ready").get("status") == "True")
    await asyncio.sleep(2)  # the last status writes of start-up land
    before = weir.versions("steady")

    await asyncio.sleep(3)  # six status passes
    assert weir.versions("steady") == before
    await weir.restart()  # resume: every child applied again
    await asyncio.sleep(3)
    assert weir.versions("steady") == before
    # Nothing was reported as changed either: no "patched" event or log line.
    assert [e["message"] for e in weir.events("steady") if e["reason"] == "Patched"] == []
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("patched")] == []


async def test_scale_down_drains_the_cheapest_pod_and_the_replicaset_removes_it(
    weir: Weir,
) -> None:
    weir.apply_pool("drain", replicas={"min": 3, "max": 3})
    pods = await until(lambda: len(weir.ready_pods("drain")) == 3 and weir.ready_pods("drain"),
                            timeout_s=90, what="three pods")  # fmt: skip
    registry = weir.registry("drain")
    states = {}
    for pod, running in zip(pods, (5, 1, 7), strict=True):
        states[pod] = await register(registry, pod, running_requests=running)
    victim = pods[1]

    weir.patch_pool("drain", {"replicas": {"min": 2, "max": 2}})
    drain = await until(lambda: weir.status("drain").get("drain"), what="a drain")
    assert (drain["victims"], drain["targetReplicas"]) == ([victim], 2)
    assert (await registry.snapshot()).endpoints[victim].lifecycle is Lifecycle.DRAINING
    pod = weir.install.get("pod", victim) or {}
    assert pod["metadata"]["annotations"][DELETION_COST] == "-1000"
    await until(lambda: weir.condition("drain", "Progressing").get("reason") == "Draining")
    assert weir.replicas("drain") == 3  # its requests are still running

    idle = msgspec.structs.replace(
        states[victim], version=states[victim].version + 1, lifecycle=Lifecycle.DRAINING,
        running_requests=0,
    )  # fmt: skip
    await registry.heartbeat(idle, ttl_s=120)
    await until(lambda: weir.replicas("drain") == 2, what="the scale-down")
    # The real ReplicaSet controller honours the deletion cost: exactly the victim goes.
    remaining = await until(
        lambda: (names := weir.ready_pods("drain")) == sorted(set(pods) - {victim}) and names,
        timeout_s=60, what="the victim's pod to go",
    )  # fmt: skip
    assert victim not in remaining
    await until(lambda: "drain" not in weir.status("drain"), what="the drain to clear")


async def test_scale_up_and_autoscaling_under_kv_pressure(weir: Weir) -> None:
    autoscaling = {"enabled": True, "targetKvPressure": 0.5, "scaleUpStabilizationS": 0,
                   "scaleDownStabilizationS": 600}  # fmt: skip
    weir.apply_pool("auto", replicas={"min": 1, "max": 3}, autoscaling=autoscaling)
    [first] = await until(lambda: weir.ready_pods("auto"), timeout_s=90, what="one pod")
    await register(weir.registry("auto"), first, kv_used_tokens=900)

    await until(lambda: weir.replicas("auto") == 3, what="scale-up to replicas.max")
    await until(lambda: weir.status("auto").get("readyReplicas") == 3, timeout_s=90,
                     what="three engines ready")  # fmt: skip
    assert weir.status("auto")["autoscaler"] == {"recommendedReplicas": 3}
    await asyncio.sleep(1)  # the pass that saw them ready has written
    written = weir.pool("auto")
    await asyncio.sleep(3)  # steady pressure: the recommendation is not rewritten
    assert changes(written, weir.pool("auto")) == []


async def test_delete_clears_the_control_plane_and_collects_every_child(
    weir: Weir, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    weir.apply_pool("gone", replicas={"min": 2, "max": 2})
    pods = await until(lambda: len(weir.ready_pods("gone")) == 2 and weir.ready_pods("gone"),
                            timeout_s=90, what="two pods")  # fmt: skip
    for pod in pods:
        await register(weir.registry("gone"), pod)
    other = EndpointRegistry(weir.redis, "other")
    await register(other, "other-a")
    await until(lambda: weir.condition("gone", "Ready").get("status") == "True")

    # Each status pass now takes seconds (a slow control plane): the deletion lands while
    # one is running, and must not wait for kopf's default minute of polling.
    real_observe = observing.observe

    async def slow_observe(**kwargs: Any) -> None:
        await asyncio.sleep(3)
        await real_observe(**kwargs)

    monkeypatch.setattr(observing, "observe", slow_observe)
    await asyncio.sleep(4)
    started = time.monotonic()
    deleted = weir.kubectl("delete", CRD_NAME, "gone", "--timeout=60s")
    assert deleted.returncode == 0, deleted.stderr
    assert time.monotonic() - started < 20
    keys = [k async for k in weir.redis.scan_iter(match=PoolKeys("gone").pattern)]
    assert keys == []
    assert (await other.snapshot()).endpoints.keys() == {"other-a"}
    cleared = [r for r in caplog.records if "control-plane keys of pool gone" in r.getMessage()]
    assert len(cleared) == 1, [r.getMessage() for r in cleared]
    for kind in CHILDREN:
        name = child_name(kind, "gone")
        await until(lambda k=kind, n=name: weir.install.get(k, n) is None, timeout_s=60,
                         what=f"the garbage collector to remove {kind}")  # fmt: skip
    await until(lambda: weir.install.pods("gone") == [], timeout_s=60, what="the pods to go")


async def test_a_child_the_server_refuses_degrades_the_pool(weir: Weir) -> None:
    """What the CRD cannot check (requests over limits) is refused by the API server: the
    pool says so in Degraded, with the server's message, and in a Warning event."""
    bad = {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}
    weir.apply_pool("refused", engine=bad)
    degraded = await until(
        lambda: (c := weir.condition("refused", "Degraded")).get("status") == "True" and c,
        what="Degraded",
    )
    assert degraded["reason"] == "ChildRejected"
    assert "must be less than or equal to cpu limit" in degraded["message"]
    assert weir.condition("refused", "Ready")["reason"] == "ChildRejected"
    # kopf posts events from a queue of its own: the Warning may trail the condition.
    warnings = await until(
        lambda: [e for e in weir.events("refused") if e["reason"] == "ChildRejected"],
        what="the ChildRejected Warning event",
    )
    assert warnings[0]["type"] == "Warning"
    assert "cpu limit" in warnings[0]["message"]
    await asyncio.sleep(2)  # the status passes keep it
    assert weir.condition("refused", "Degraded")["reason"] == "ChildRejected"
    assert weir.install.get("deployment", "refused") is None

    weir.patch_pool("refused", {"engine": {"resources": {"requests": {"cpu": "1"}}}})
    await until(lambda: weir.install.get("deployment", "refused"), what="the Deployment")
    await until(lambda: weir.condition("refused", "Degraded").get("status") == "False")


async def test_a_status_write_computed_from_an_older_read_of_the_pool_is_refused(
    weir: Weir,
) -> None:
    """A status pass writes over the pool it read, no other: the API server answers a
    write computed from an older resourceVersion with 409 Conflict (a temporary error:
    the next pass reads again). Without it a pass that read the pool just before the
    reconciler recorded a child refusal replaced the conditions (a merge patch replaces
    the list) and showed Ready=Creating beside Degraded=ChildRejected until its next
    pass; the refused-child test above caught that on a loaded machine."""
    weir.apply_pool("stale")
    await until(lambda: weir.status("stale").get("conditions"), what="a status")
    read = weir.pool("stale")["metadata"]["resourceVersion"]
    weir.patch_pool("stale", {"replicas": {"min": 2, "max": 2}})
    await until(lambda: weir.pool("stale")["metadata"]["resourceVersion"] != read)
    api = await connect_kubernetes()
    try:
        with pytest.raises(ApiException) as refused:
            await write_status(api, weir.install.namespace, "stale", {"kvUsage": "0%"}, read)
    finally:
        await api.close()
    assert refused.value.status == 409


async def test_an_invalid_spec_is_degraded_not_crashing(weir: Weir) -> None:
    """A spec that passed an old CRD (here: bypassing validation is impossible, so the
    operator's own check is driven with a value the CRD allows but the pool policy does
    not: two tenants reserving more than the whole pool)."""
    tenants = [{"name": "a", "reservedFraction": 0.7}, {"name": "b", "reservedFraction": 0.7}]
    weir.apply_pool("invalid", tenants=tenants)
    degraded = await until(
        lambda: (c := weir.condition("invalid", "Degraded")).get("status") == "True" and c
    )
    assert degraded["reason"] == "InvalidSpec"
    assert "reservedFraction" in degraded["message"]
    assert weir.install.get("deployment", "invalid") is None
    weir.patch_pool("invalid", {"tenants": [{"name": "a", "reservedFraction": 0.7}]})
    await until(lambda: weir.install.get("deployment", "invalid"), what="the fix to apply")


async def test_an_operator_killed_mid_reconcile_finishes_after_restart(
    weir: Weir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the ConfigMap and Service were applied but before the Deployment:
    the restarted operator completes the pool, once."""
    real_apply = reconciling.apply
    stuck = threading.Event()  # set in the operator's thread

    async def apply_until_deployment(api: Any, manifest: Any) -> Any:
        if manifest["kind"] == "Deployment":
            stuck.set()
            await asyncio.Event().wait()  # hangs until the operator is killed
        return await real_apply(api, manifest)

    monkeypatch.setattr(reconciling, "apply", apply_until_deployment)
    weir.apply_pool("midway")
    assert await asyncio.to_thread(stuck.wait, 60)
    assert weir.install.get("configmap", "midway-policy") is not None
    assert weir.install.get("deployment", "midway") is None

    monkeypatch.setattr(reconciling, "apply", real_apply)
    await weir.restart()
    await until(lambda: weir.ready_pods("midway"), timeout_s=90, what="the pool's pod")
    deployments = weir.kubectl("get", "deployments", "-l", "inference.weir.dev/pool=midway",
                               "-o", "name")  # fmt: skip
    assert deployments.stdout.split() == ["deployment.apps/midway"]
    assert weir.status("midway").get("observedGeneration") == 1


async def test_weir_operator_command_runs_as_the_charts_service_account(
    weir: Weir, tmp_path: Path
) -> None:
    """`weir operator` as a real process: its log lines name the pool, its liveness
    endpoint answers on loopback, and the chart's RBAC is enough for it. It reads the
    Redis URL from a file (`--redis-url-file`, a mounted Secret's key)."""
    await weir.stop()  # the command takes over from the in-process operator
    env = {
        **{k: v for k, v in os.environ.items() if k != "WEIR_REDIS_URL"},
        "KUBECONFIG": str(weir.install.operator_kubeconfig),
        "WEIR_IMAGE": "weir:cli-test",
        "WEIR_STATUS_INTERVAL_S": "0.5",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")]),
    }
    url_file = tmp_path / "redis-url"
    url_file.write_text(weir.settings.redis_url + "\n")
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "weir.cli", "operator", "--namespace",
            weir.install.namespace, "--liveness", liveness, "--log-format", "plain",
            "--redis-url-file", str(url_file),
            env=env, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        weir.apply_pool("cli")
        deployment = await until(lambda: weir.install.get("deployment", "cli"), timeout_s=60)
        sidecar = deployment["spec"]["template"]["spec"]["containers"][1]
        assert sidecar["image"] == "weir:cli-test"
        await until(lambda: weir.condition("cli", "ControlPlaneReachable"), timeout_s=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        await asyncio.wait_for(process.wait(), timeout=30)
    text = log.read_text()
    assert f"control plane: {weir.settings.redis_url}" in text, text[:2000]
    assert f"[{weir.install.namespace}/cli]" in text, text[-2000:]
    assert "403" not in text, text[-2000:]
    assert "Forbidden" not in text, text[-2000:]


async def test_a_conflicting_status_write_is_retried(weir: Weir, faults: FaultProxy) -> None:
    """The first write of the pool's status is answered 409 Conflict: it lands later."""
    conflict = faults.fail("PATCH", r"/inferencepools/conflict/status$", 409)
    weir.apply_pool("conflict")
    await until(lambda: weir.status("conflict").get("conditions"), what="a status")
    assert conflict.hits == 1


async def test_a_child_write_that_fails_once_is_retried(weir: Weir, faults: FaultProxy) -> None:
    """The Deployment's apply is answered 500 once: a temporary error, retried."""
    failed = faults.fail("PATCH", r"/deployments/flaky$", 500)
    weir.apply_pool("flaky")
    await until(lambda: weir.install.get("deployment", "flaky"), timeout_s=60,
                     what="the Deployment after one failed apply")  # fmt: skip
    assert failed.hits == 1


async def test_the_api_server_going_away_for_20s(weir: Weir) -> None:
    """The API server stops for 20 s and comes back with its history compacted. The status
    pass resumes within seconds (the outage is a temporary error, not an unclassified
    traceback retried a minute later), and the operator's watch, resuming from a
    resourceVersion that is gone (410 Gone), lists again and sees a pool created since."""
    kube = weir.install.kube
    assert isinstance(kube, ControlPlane)
    weir.apply_pool("outage")
    [pod] = await until(lambda: weir.ready_pods("outage"), timeout_s=90, what="the pod")
    await register(weir.registry("outage"), pod, kv_used_tokens=100)
    await until(lambda: weir.status("outage").get("kvUsage") == "10%")

    kube.stop_api_server()
    await register(weir.registry("outage"), pod, kv_used_tokens=700)
    await asyncio.sleep(20)
    kube.compact_etcd()
    kube.start_api_server()
    back = time.monotonic()
    await until(lambda: weir.status("outage").get("kvUsage") == "70%", timeout_s=60,
                     what="the status after the outage")  # fmt: skip
    assert time.monotonic() - back < 30
    weir.apply_pool("after")
    await until(lambda: weir.install.get("deployment", "after"), timeout_s=60,
                     what="the pool created after the compaction")  # fmt: skip
