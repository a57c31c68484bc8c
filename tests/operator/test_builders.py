"""Pure parts of the operator: spec parsing, rendering, merge patches, status, scaling."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, cast

import pytest

from controlplane.contract import (
    AutoscalingPolicy,
    Lifecycle,
    PoolPolicy,
    PreemptionMode,
    WatermarkState,
    decode_json,
)
from fleet_operator.applying import merge_patch
from fleet_operator.config import OperatorConfig
from fleet_operator.fleet import EndpointSummary, FleetObservation
from fleet_operator.rendering import (
    POLICY_HASH,
    engine_args,
    render_children,
    render_configmap,
    render_deployment,
)
from fleet_operator.scaling import (
    PodView,
    Recommendation,
    drain_finished,
    pick_victims,
    recommend,
    stabilized,
    target_replicas,
)
from fleet_operator.spec import InvalidPoolError, ReplicaSpec, parse_pool
from fleet_operator.status import (
    DeploymentView,
    Observed,
    build_status,
    rejection,
    rejection_status,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
SPEC: dict[str, Any] = {
    "model": {"name": "m", "source": "org/m", "servedName": "m-chat", "contextLength": 4096},
    "engine": {"tensorParallel": 4, "memFractionStatic": 0.8, "extraArgs": ["--foo", "1"]},
    "kv": {"pageSize": 64},
    "scheduling": {"chunkedPrefillSize": -1, "priorityScheduling": False,
                   "preemptionModes": ["migrate"]},
    "tenants": [{"name": "a", "maxConcurrency": 3, "reservedFraction": 0.5}],
}  # fmt: skip


def endpoint(eid: str, **kw: Any) -> EndpointSummary:
    fields: dict[str, Any] = {
        "endpoint_id": eid,
        "lifecycle": Lifecycle.READY,
        "watermark": WatermarkState.NORMAL,
        "lease_valid": True,
        "in_flight": 0,
        "kv_used_tokens": 0,
        "kv_reserved_growth_tokens": 0,
        "kv_capacity_tokens": 1000,
        "waiting_prefill_tokens": 0,
        "predicted_ttft_s": 0.0,
    }
    fields.update(kw)
    return EndpointSummary(**fields)


def test_spec_becomes_the_contracts_policy() -> None:
    pool = parse_pool("m", "ns", SPEC)
    policy = pool.policy
    assert isinstance(policy, PoolPolicy)
    assert (policy.model, policy.context_length, policy.kv.page_size) == ("m-chat", 4096, 64)
    assert policy.scheduling.preemption_modes == (PreemptionMode.MIGRATE,)
    assert policy.tenants[0].max_concurrency == 3
    roundtrip = decode_json(render_configmap(pool)["data"]["policy.json"], PoolPolicy)
    assert roundtrip == policy


@pytest.mark.parametrize(("name", "spec", "message"), [
    ("Bad_Name", SPEC, "DNS-1035 label"),
    ("7b-pool", SPEC, "starting with a letter"),
    ("m", {"model": {"name": "m"}, "kv": {"pageSize": "16"}}, "Expected `int`"),
    ("m", {"engine": {}}, "model"),
    ("m", {**SPEC, "engine": {"port": 8000}}, "must differ"),
    ("m", {**SPEC, "tenants": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ("m", {**SPEC, "tenants": [{"name": "a", "reservedFraction": 0.7},
                              {"name": "b", "reservedFraction": 0.7}]}, "sum"),
    ("m", {**SPEC, "engine": {"runAsUser": -1}}, "runAsUser"),
    ("m", {**SPEC, "engine": {"runAsUser": 2**31}}, "runAsUser"),
    ("m", {**SPEC, "engine": {"runAsUser": "0"}}, "Expected `int | null`"),
    ("m", {**SPEC, "engine": {"addCapabilities": ["CAP_IPC_LOCK"]}}, "without CAP_"),
    ("m", {**SPEC, "engine": {"addCapabilities": ["ALL"]}}, "addCapabilities"),
    ("m", {**SPEC, "engine": {"addCapabilities": ["ipc_lock"]}}, "addCapabilities"),
    ("m", {**SPEC, "engine": {"bootstrapPort": 30000}}, "bootstrapPort must differ"),
    ("m", {**SPEC, "engine": {"transferBackend": "fake"}}, "transferBackend must be one of"),
])  # fmt: skip
def test_invalid_specs_name_the_problem(name: str, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPoolError, match=message):
        parse_pool(name, "ns", spec)


def test_engine_flags_follow_the_spec() -> None:
    args = engine_args(parse_pool("m", "ns", SPEC))

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--model-path") == "org/m"
    assert value("--served-model-name") == "m-chat"
    assert value("--tp") == "4"
    assert value("--chunked-prefill-size") == "-1"
    assert value("--mem-fraction-static") == "0.8"
    assert "--enable-priority-scheduling" not in args
    assert "--max-running-requests" not in args  # 0 leaves it to SGLang
    assert args[-2:] == ["--foo", "1"]


def test_pd_pools_engines_serve_their_half_on_the_pods_address() -> None:
    config = OperatorConfig()
    engine = {**SPEC["engine"], "bootstrapPort": 9100, "transferBackend": "nixl"}
    prefill = parse_pool("p", "ns", {**SPEC, "engine": engine, "role": "prefill",
                                     "decodePool": "d"})  # fmt: skip
    decode = parse_pool("d", "ns", {**SPEC, "engine": engine, "role": "decode"})
    mixed = parse_pool("m", "ns", SPEC)
    for pool, mode in ((prefill, "prefill"), (decode, "decode")):
        args = engine_args(pool)
        assert args[args.index("--disaggregation-mode") + 1] == mode
        assert args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
        # Decode engines reach a prefill engine's bootstrap server and transfer ports.
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[-2:] == ["--foo", "1"]  # extra args still win
    p_args = engine_args(prefill)
    assert p_args[p_args.index("--disaggregation-bootstrap-port") + 1] == "9100"
    assert "--disaggregation-bootstrap-port" not in engine_args(decode)
    assert "--disaggregation-mode" not in engine_args(mixed)
    assert engine_args(mixed)[engine_args(mixed).index("--host") + 1] == "127.0.0.1"
    ports = {
        pool.name: _engine(render_deployment(pool, 1, config)).get("ports")
        for pool in (prefill, decode)
    }
    assert ports == {"p": [{"name": "bootstrap", "containerPort": 9100}], "d": None}
    assert prefill.policy.decode_pool == "d"


def test_policy_change_changes_the_pod_template_hash() -> None:
    config = OperatorConfig()
    a = render_deployment(parse_pool("m", "ns", SPEC), 1, config)
    b = render_deployment(parse_pool("m", "ns", {**SPEC, "kv": {"pageSize": 32}}), 1, config)
    annotations = [d["spec"]["template"]["metadata"]["annotations"][POLICY_HASH] for d in (a, b)]
    assert annotations[0] != annotations[1]
    assert render_deployment(parse_pool("m", "ns", SPEC), 1, config) == a  # deterministic


def _sidecar(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return cast(dict[str, Any], next(c for c in containers if c["name"] == "sidecar"))


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return cast(dict[str, Any], next(c for c in containers if c["name"] == "engine"))


def test_sidecars_get_their_admin_token_from_a_mounted_secret() -> None:
    """The admin routes are locked in every engine pod: the token Secret is mounted as a
    file, and the sidecar and its preStop drain read it from there (never an argument)."""
    pool = parse_pool("m", "ns", SPEC)
    config = OperatorConfig.from_env(
        {"WEIR_ADMIN_SECRET": "rel-sidecar-admin", "WEIR_ADMIN_SECRET_KEY": "tok"}
    )
    deployment = render_deployment(pool, 1, config)
    sidecar = _sidecar(deployment)
    token_file = "/var/run/secrets/weir/admin/token"
    args = sidecar["args"]
    assert args[args.index("--admin-token-file") + 1] == token_file
    drain = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:3] == ["weir", "sidecar", "drain"]
    assert drain[drain.index("--admin-token-file") + 1] == token_file
    (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == "admin-token"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/run/secrets/weir/admin", True)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-token"]["secret"] == {
        "secretName": "rel-sidecar-admin",
        "items": [{"key": "tok", "path": "token"}],
    }
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "admin-token" not in {m["name"] for m in engine["volumeMounts"]}
    assert OperatorConfig().admin_secret == "weir-sidecar-admin"  # the chart's, by default
    # Explicitly none: no mount, no flag (the sidecar warns that its admin routes are open).
    open_ = render_deployment(pool, 1, OperatorConfig.from_env({"WEIR_ADMIN_SECRET": ""}))
    assert "--admin-token-file" not in _sidecar(open_)["args"]
    assert "admin-token" not in {v["name"] for v in open_["spec"]["template"]["spec"]["volumes"]}


def _pod(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The pod spec, its engine container and its sidecar container."""
    spec = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"engine", "sidecar"}
    return spec, containers["engine"], containers["sidecar"]


def test_engine_pods_run_unprivileged_with_their_own_service_account() -> None:
    """Pod Security's `restricted` profile, by default: non-root, RuntimeDefault seccomp,
    no privilege escalation, no capabilities; no API token; an identity of the pool's."""
    pool = parse_pool("m", "ns", SPEC)
    children = render_children(pool, 1, OperatorConfig(), monitoring=False)
    account = next(c for c in children if c["kind"] == "ServiceAccount")
    assert account["metadata"] == {
        "name": "m-engine",
        "namespace": "ns",
        "labels": render_configmap(pool)["metadata"]["labels"],
    }
    assert account["automountServiceAccountToken"] is False
    deployment = next(c for c in children if c["kind"] == "Deployment")
    spec, engine, sidecar = _pod(deployment)
    assert spec["serviceAccountName"] == "m-engine"
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert sidecar["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # A read-only root, but a writable /tmp of its own.
    volumes = {v["name"]: v for v in spec["volumes"]}
    (tmp,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert volumes[tmp["name"]] == {"name": tmp["name"], "emptyDir": {}}
    assert engine["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    # The engine's caches and downloads go to a home it may write.
    assert {"name": "HOME", "value": "/home/engine"} in engine["env"]
    (home,) = [m for m in engine["volumeMounts"] if m["mountPath"] == "/home/engine"]
    assert volumes[home["name"]] == {"name": home["name"], "emptyDir": {}}
    for container in (engine, sidecar):
        assert "privileged" not in container["securityContext"]
    assert not any("hostPath" in v for v in spec["volumes"])
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert key not in spec


def test_the_engine_user_is_the_pools_else_the_operators() -> None:
    def engine(config: OperatorConfig, **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        pool = parse_pool("m", "ns", {**SPEC, "engine": {**SPEC["engine"], **fields}})
        spec, container, sidecar = _pod(render_deployment(pool, 1, config))
        assert sidecar["securityContext"]["runAsUser"] == 10001  # the sidecar never changes
        assert sidecar["securityContext"]["runAsNonRoot"] is True
        return spec, container

    # Root, for a pool whose SGLang setup needs it: still no escalation, no capabilities.
    spec, root = engine(OperatorConfig(), runAsUser=0)
    assert root["securityContext"] == {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert "HOME" not in {e["name"] for e in root.get("env", [])}  # the image's own
    assert "/home/engine" not in {m["mountPath"] for m in root["volumeMounts"]}
    # The operator's default, from its environment (the chart's operator.engineRunAsUser).
    as_root = OperatorConfig.from_env({"WEIR_ENGINE_RUN_AS_USER": "0"})
    assert engine(as_root)[1]["securityContext"]["runAsUser"] == 0
    spec, own = engine(as_root, runAsUser=1000)  # a pool's own user wins
    assert (own["securityContext"]["runAsUser"], own["securityContext"]["runAsGroup"]) == (
        1000,
        1000,
    )
    assert spec["securityContext"]["runAsNonRoot"] is True
    # A HOME the pool sets is kept.
    _, homed = engine(OperatorConfig(), env=[{"name": "HOME", "value": "/models"}])
    assert [e for e in homed["env"] if e["name"] == "HOME"] == [
        {"name": "HOME", "value": "/models"}
    ]
    # Capabilities come back only by name, on top of dropping them all.
    _, rdma = engine(OperatorConfig(), addCapabilities=["IPC_LOCK"])
    assert rdma["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


@pytest.mark.parametrize("value", ["-1", "root", "2147483648", "1.5"])
def test_a_bad_engine_user_in_the_environment_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="WEIR_ENGINE_RUN_AS_USER"):
        OperatorConfig.from_env({"WEIR_ENGINE_RUN_AS_USER": value})


def test_nothing_a_sidecar_runs_talks_to_the_kubernetes_api() -> None:
    """Why engine pods mount no ServiceAccount token: the sidecar's code (and the control
    plane library it uses) imports no Kubernetes client."""
    root = Path(__file__).resolve().parents[2]
    sources = [
        *(root / "engine_sidecar").rglob("*.py"),
        *(root / "controlplane").rglob("*.py"),
        root / "weir" / "commands" / "sidecar.py",
    ]
    assert len(sources) > 10
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert top not in {"kubernetes", "kubernetes_asyncio", "kopf"}, (path, module)


def test_the_redis_url_reaches_sidecars_in_their_environment_not_their_command_line() -> None:
    pool = parse_pool("m", "ns", SPEC)
    config = OperatorConfig.from_env(
        {"WEIR_REDIS_SECRET": "rel-redis", "WEIR_REDIS_SECRET_KEY": "u"}
    )
    sidecar = _sidecar(render_deployment(pool, 1, config))
    words = [
        *sidecar["command"],
        *sidecar["args"],
        *sidecar["lifecycle"]["preStop"]["exec"]["command"],
    ]
    assert "--redis-url" not in words
    assert not [w for w in words if "WEIR_REDIS_URL" in w]
    env = next(e for e in sidecar["env"] if e["name"] == "WEIR_REDIS_URL")
    assert env["valueFrom"]["secretKeyRef"] == {"name": "rel-redis", "key": "u"}
    assert "redis_url" not in repr(config)  # nor in a logged config


def test_decision_logs_and_tracing_reach_the_sidecars() -> None:
    quiet = _sidecar(render_deployment(parse_pool("m", "ns", SPEC), 1, OperatorConfig()))
    assert "--log-decisions" not in quiet["args"]
    assert not [e for e in quiet["env"] if e["name"].startswith("OTEL_")]
    spec = {**SPEC, "sidecar": {"logDecisions": True}}
    config = OperatorConfig.from_env({"WEIR_OTLP_ENDPOINT": "http://collector:4318"})
    told = _sidecar(render_deployment(parse_pool("m", "ns", spec), 1, config))
    assert "--log-decisions" in told["args"]
    env = {e["name"]: e.get("value") for e in told["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert env["OTEL_SERVICE_NAME"] == "weir-sidecar"


def test_servicemonitor_only_when_its_crd_exists() -> None:
    pool = parse_pool("m", "ns", SPEC)
    kinds = [c["kind"] for c in render_children(pool, 1, OperatorConfig(), monitoring=False)]
    assert kinds == ["ServiceAccount", "ConfigMap", "Service", "PodDisruptionBudget", "Deployment"]
    with_monitor = render_children(pool, 1, OperatorConfig(), monitoring=True)
    assert with_monitor[-1]["kind"] == "ServiceMonitor"


def test_merge_patch_touches_only_differences() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x"}]}}}
    live = {
        "spec": {
            "replicas": 2,
            "template": {"containers": [{"name": "a", "image": "x", "imagePullPolicy": "Always"}]},
            "progressDeadlineSeconds": 600,
        },
        "status": {"readyReplicas": 2},
    }
    assert merge_patch(desired, live) == {}  # server defaults are not differences
    changed = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "y"}]}}}
    assert merge_patch(changed, live) == {
        "spec": {"template": {"containers": [{"name": "a", "image": "y"}]}}
    }


def test_status_counts_and_conditions() -> None:
    fleet = FleetObservation((
        endpoint("a", kv_used_tokens=500, kv_reserved_growth_tokens=100),
        endpoint("b", watermark=WatermarkState.CRITICAL, kv_used_tokens=900),
        endpoint("c", lifecycle=Lifecycle.DRAINING),
        endpoint("d", lease_valid=False),
    ))  # fmt: skip
    seen = Observed(generation=3, deployment=DeploymentView(3, 3, 3, True), fleet=fleet)
    status = build_status(seen, [], "2026-01-01T00:00:00+00:00")
    assert status["endpoints"] == {"live": 2, "draining": 1, "expired": 1}
    assert status["watermarks"] == {"normal": 2, "pressure": 0, "critical": 1, "exhausted": 0}
    assert status["kvUsage"] == "50%"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "LeasesExpired",
    )
    # A condition keeps its transition time while its status holds.
    later = build_status(seen, status["conditions"], "2026-01-01T01:00:00+00:00")
    assert {c["type"]: c["lastTransitionTime"] for c in later["conditions"]} == {
        c["type"]: "2026-01-01T00:00:00+00:00" for c in status["conditions"]
    }


def test_unreachable_control_plane_is_a_condition_not_an_error() -> None:
    seen = Observed(generation=1, deployment=DeploymentView(1, 0, 1, True), control_plane_error="x")
    conditions = {c["type"]: c for c in build_status(seen, [], "t")["conditions"]}
    assert conditions["ControlPlaneReachable"]["status"] == "False"
    assert conditions["ControlPlaneReachable"]["reason"] == "RedisUnavailable"
    assert conditions["Ready"]["reason"] == "EnginesNotReady"


def test_a_child_refusal_outlives_a_status_pass_that_read_the_pool_before_it() -> None:
    """The reconciler records a refusal while a status pass, started on the pool as it was,
    writes its own conditions (a merge patch replaces the list): the next pass still finds
    the refusal and keeps Degraded on it, until the spec's generation changes."""
    stale = build_status(Observed(generation=3), [], "t")
    refused = Observed(generation=3, rejected="requests over limits")
    status = build_status(refused, [], "t") | rejection_status("requests over limits", 3)
    # The stale pass lands last; its conditions (AsExpected) replace the list whole.
    status |= stale
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Degraded"] == "AsExpected"
    kept = rejection(status, 3)
    assert kept == "requests over limits"
    degraded = {c["type"]: c for c in build_status(Observed(generation=3, rejected=kept),
                                                   status["conditions"], "t")["conditions"]}  # fmt: skip
    assert (degraded["Degraded"]["status"], degraded["Degraded"]["reason"]) == (
        "True", "ChildRejected",
    )  # fmt: skip
    assert rejection(status, 4) == ""


def test_autoscaling_follows_the_worst_signal_with_stabilization() -> None:
    policy = AutoscalingPolicy(
        enabled=True, target_kv_pressure=0.5, scale_up_stabilization_s=30,
        scale_down_stabilization_s=300,
    )  # fmt: skip
    hot = FleetObservation((endpoint("a", kv_used_tokens=900), endpoint("b", kv_used_tokens=900)))
    assert recommend(policy, hot, current=2) == 4  # 0.9 / 0.5 = 1.8x
    calm = FleetObservation((endpoint("a", kv_used_tokens=250),))
    assert recommend(policy, calm, current=2) == 1
    assert recommend(policy, FleetObservation(), current=2) == 2  # no signal: hold

    # A single spike does not scale up; a sustained one does.
    spike = [Recommendation(0, 2), Recommendation(10, 6)]
    assert stabilized(spike, policy, now=10, current=2, since=0) == 2
    sustained = [Recommendation(0, 6), Recommendation(10, 5)]
    assert stabilized(sustained, policy, now=10, current=2, since=0) == 5
    # A lull does not scale down until the whole down window agrees ...
    lull = [Recommendation(0, 4), Recommendation(200, 1)]
    assert stabilized(lull, policy, now=200, current=4, since=0) == 4
    assert stabilized(lull, policy, now=350, current=4, since=0) == 1
    # ... and was observed: a restarted operator's one low sample is not a lull.
    assert stabilized([Recommendation(350, 1)], policy, now=350, current=4, since=349) == 4
    assert stabilized([Recommendation(650, 1)], policy, now=650, current=4, since=349) == 1

    bounds = ReplicaSpec(min=2, max=5)
    assert target_replicas(bounds, policy, sustained, now=10, current=2, since=0) == 5
    assert target_replicas(bounds, policy, [Recommendation(0, 9)], now=1, current=2, since=0) == 5
    off = AutoscalingPolicy(enabled=False)
    assert target_replicas(bounds, off, sustained, now=10, current=4, since=0) == 2


def test_victims_are_the_cheapest_to_drain() -> None:
    pods = [PodView("a", True), PodView("b", True), PodView("c", True), PodView("d", False)]
    fleet = FleetObservation((
        endpoint("a", in_flight=3), endpoint("b", in_flight=1), endpoint("c", in_flight=1,
        kv_used_tokens=10),
    ))  # fmt: skip
    assert pick_victims(pods, fleet, 1) == ["d"]  # not ready: serves nothing
    assert pick_victims(pods, fleet, 3) == ["d", "b", "c"]
    assert pick_victims(pods, fleet, 0) == []


def test_drain_waits_for_in_flight_work_but_not_past_its_deadline() -> None:
    busy = FleetObservation((endpoint("b", lifecycle=Lifecycle.DRAINING, in_flight=2),))
    idle = FleetObservation((endpoint("b", lifecycle=Lifecycle.DRAINING, in_flight=0),))
    assert not drain_finished(["b"], busy, started_at=0, now=10, deadline_s=60)
    assert drain_finished(["b"], busy, started_at=0, now=60, deadline_s=60)
    assert drain_finished(["b"], idle, started_at=0, now=10, deadline_s=60)
    assert drain_finished(["b"], FleetObservation(), started_at=0, now=1, deadline_s=60)


def test_package_exports() -> None:
    import fleet_operator

    assert sorted(fleet_operator.__all__) == fleet_operator.__all__
    for name in fleet_operator.__all__:
        assert getattr(fleet_operator, name) is not None, name


def test_operator_settings_from_the_environment() -> None:
    config = OperatorConfig.from_env({"WEIR_IMAGE": "w:1", "WEIR_STATUS_INTERVAL_S": "2.5"})
    assert (config.image, config.status_interval_s) == ("w:1", 2.5)
    assert config.redis_secret == "weir-redis"
    with pytest.raises(ValueError, match="WEIR_STATUS_INTERVAL_S"):
        OperatorConfig.from_env({"WEIR_STATUS_INTERVAL_S": "0"})


@pytest.mark.parametrize(
    "resources",
    [
        {"limit": {"cpu": "1"}},
        {"limits": "8 GPUs"},
        {"limits": {"cpu": True}},
        {"limits": {"cpu": ""}},
    ],
)
def test_free_form_resources_are_checked(resources: dict[str, Any]) -> None:
    with pytest.raises(InvalidPoolError, match=r"engine\.resources"):
        parse_pool("m", "ns", {"model": {"name": "m"}, "engine": {"resources": resources}})


async def test_children_of_every_example_round_trip_through_the_api_models() -> None:
    """What the operator renders is exactly what the official client models describe."""
    import yaml
    from kubernetes_asyncio import client

    models = {
        "ServiceAccount": client.V1ServiceAccount,
        "Deployment": client.V1Deployment,
        "Service": client.V1Service,
        "ConfigMap": client.V1ConfigMap,
        "PodDisruptionBudget": client.V1PodDisruptionBudget,
    }

    class Response:
        def __init__(self, doc: dict[str, Any]) -> None:
            self.data = json.dumps(doc)

    api = client.ApiClient()
    try:
        for path in EXAMPLES:
            for doc in yaml.safe_load_all(path.read_text()):
                pool = parse_pool(doc["metadata"]["name"], "ns", doc["spec"])
                for child in render_children(pool, 2, OperatorConfig(), monitoring=False):
                    model = models[child["kind"]]
                    back = api.sanitize_for_serialization(
                        api.deserialize(cast(Any, Response(child)), model)
                    )
                    assert back == child, (path.name, child["kind"])
    finally:
        await api.close()
