"""Pure builders: from a parsed pool to the child objects that run it.

Each builder returns a plain manifest (a dict, as the API server would receive it) built
from the official client models, so field names and nesting are the client's, not ours.
No I/O and no clock: the same pool always renders the same children, which is what lets
`applying` patch only what changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import (
    ApiClient,
    V1Capabilities,
    V1ConfigMap,
    V1ConfigMapVolumeSource,
    V1Container,
    V1ContainerPort,
    V1Deployment,
    V1DeploymentSpec,
    V1DeploymentStrategy,
    V1EmptyDirVolumeSource,
    V1EnvVar,
    V1EnvVarSource,
    V1ExecAction,
    V1HTTPGetAction,
    V1KeyToPath,
    V1LabelSelector,
    V1Lifecycle,
    V1LifecycleHandler,
    V1ObjectFieldSelector,
    V1ObjectMeta,
    V1PodAffinityTerm,
    V1PodAntiAffinity,
    V1PodDisruptionBudget,
    V1PodDisruptionBudgetSpec,
    V1PodSecurityContext,
    V1PodSpec,
    V1PodTemplateSpec,
    V1Probe,
    V1ResourceRequirements,
    V1RollingUpdateDeployment,
    V1SeccompProfile,
    V1SecretKeySelector,
    V1SecretVolumeSource,
    V1SecurityContext,
    V1Service,
    V1ServiceAccount,
    V1ServicePort,
    V1ServiceSpec,
    V1TCPSocketAction,
    V1Volume,
    V1VolumeMount,
    V1WeightedPodAffinityTerm,
)
from kubernetes_asyncio.client import V1Affinity as Affinity

from controlplane.contract import Role, SchedulingPolicy, encode_json
from fleet_operator.config import OperatorConfig
from fleet_operator.spec import Pool

POOL_LABEL = "inference.weir.dev/pool"
POLICY_HASH = "inference.weir.dev/policy-hash"
POLICY_FILE = "policy.json"
POLICY_DIR = "/etc/weir"
# The sidecars' admin token (a Secret's key, mounted as a file; never on a command line).
ADMIN_TOKEN_DIR = "/var/run/secrets/weir/admin"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/token"
GPU = "nvidia.com/gpu"
# The user of the Weir image (its Dockerfile's USER): sidecars always run as it.
WEIR_UID = 10001
# A non-root engine's home: the image's own (/root) is not its to write, and SGLang,
# Hugging Face, Triton and FlashInfer keep their caches and downloads under $HOME.
ENGINE_HOME = "/home/engine"

# Serialization uses no client state; a real ApiClient would need a running event loop.
_serializer: ApiClient = object.__new__(ApiClient)


def _plain(model: object) -> dict[str, Any]:
    data: dict[str, Any] = _serializer.sanitize_for_serialization(model)
    return data


def selector_labels(pool: Pool) -> dict[str, str]:
    return {POOL_LABEL: pool.name, "app.kubernetes.io/component": "engine"}


def labels(pool: Pool) -> dict[str, str]:
    return {
        **selector_labels(pool),
        "app.kubernetes.io/name": "weir",
        "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/managed-by": "weir-operator",
    }


def _meta(pool: Pool, name: str | None = None) -> V1ObjectMeta:
    return V1ObjectMeta(name=name or pool.name, namespace=pool.namespace, labels=labels(pool))


def policy_json(pool: Pool) -> str:
    return encode_json(pool.policy).decode()


def policy_hash(pool: Pool) -> str:
    return hashlib.sha256(policy_json(pool).encode()).hexdigest()[:16]


def configmap_name(pool: Pool) -> str:
    return f"{pool.name}-policy"


def render_configmap(pool: Pool) -> dict[str, Any]:
    """The pool policy, read by sidecars and routers with `--policy-file`."""
    return _plain(
        V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=_meta(pool, configmap_name(pool)),
            data={POLICY_FILE: policy_json(pool)},
        )
    )


def service_account_name(pool: Pool) -> str:
    return f"{pool.name}-engine"


def render_service_account(pool: Pool) -> dict[str, Any]:
    """The engine pods' own identity: bound to no role, and no token is mounted from it
    (sidecars talk to Redis and to the engine, never to the Kubernetes API)."""
    return _plain(
        V1ServiceAccount(
            api_version="v1",
            kind="ServiceAccount",
            metadata=_meta(pool, service_account_name(pool)),
            automount_service_account_token=False,
        )
    )


def engine_user(pool: Pool, config: OperatorConfig) -> int:
    """The engine container's user id: the pool's, else the operator's; 0 is root."""
    run_as = pool.spec.engine.run_as_user
    return config.engine_run_as_user if run_as is None else run_as


def _sidecar_security() -> V1SecurityContext:
    # The sidecar writes nothing but /tmp (an emptyDir) and needs no privilege at all.
    return V1SecurityContext(
        run_as_non_root=True,
        run_as_user=WEIR_UID,
        run_as_group=WEIR_UID,
        allow_privilege_escalation=False,
        read_only_root_filesystem=True,
        capabilities=V1Capabilities(drop=["ALL"]),
    )


def _engine_security(pool: Pool, uid: int) -> V1SecurityContext:
    # SGLang writes caches, compiled kernels and downloaded weights, so its root
    # filesystem stays writable. GPUs reach it through the device plugin, not through
    # capabilities: it keeps none unless the pool adds some.
    added = list(pool.spec.engine.add_capabilities) or None
    return V1SecurityContext(
        run_as_non_root=True if uid else None,
        run_as_user=uid,
        run_as_group=uid or None,
        allow_privilege_escalation=False,
        capabilities=V1Capabilities(drop=["ALL"], add=added),
    )


def scheduling_args(scheduling: SchedulingPolicy) -> list[str]:
    """The engine-scheduling flags of `engine_args`, from the pool's `scheduling`: the
    prefill chunk, the running cap, priority scheduling. The real SGLang test tier's
    servers run with the defaults' (tests/sglang/conftest.py)."""
    args = ["--chunked-prefill-size", str(scheduling.chunked_prefill_size)]
    if scheduling.max_running_requests > 0:
        args += ["--max-running-requests", str(scheduling.max_running_requests)]
    if scheduling.priority_scheduling:
        # fcfs honours priorities; lpm would ignore them and starve uncached prompts.
        args += ["--enable-priority-scheduling", "--schedule-policy", "fcfs"]
    return args


def engine_args(pool: Pool) -> list[str]:
    """SGLang launch flags derived from the spec (`python -m sglang.launch_server --help`).

    A P/D pool's engines serve their half (`--disaggregation-mode`, the transfer backend,
    a prefill engine's bootstrap port) and listen on the pod's address: decode engines
    reach a prefill engine's bootstrap server, which SGLang binds on `--host`, and the
    transfer backend's ports. A mixed engine listens on loopback, behind its sidecar."""
    spec = pool.spec
    role = spec.role
    args = [
        "--model-path",
        spec.model.path,
        "--served-model-name",
        spec.model.served,
        "--host",
        "127.0.0.1" if role is Role.MIXED else "0.0.0.0",
        "--port",
        str(spec.engine.port),
        "--context-length",
        str(spec.model.context_length),
        "--tp",
        str(spec.engine.tensor_parallel),
        "--page-size",
        str(spec.kv.page_size),
        "--enable-metrics",
        *scheduling_args(spec.scheduling),
    ]
    if spec.engine.mem_fraction_static > 0:
        args += ["--mem-fraction-static", str(spec.engine.mem_fraction_static)]
    if role is not Role.MIXED:
        args += ["--disaggregation-mode", role.value,
                 "--disaggregation-transfer-backend", spec.engine.transfer_backend]  # fmt: skip
    if role is Role.PREFILL:
        args += ["--disaggregation-bootstrap-port", str(spec.engine.bootstrap_port)]
    return [*args, *spec.engine.extra_args]


def sidecar_args(pool: Pool, *, admin_token: bool = True) -> list[str]:
    """The sidecar's flags; `admin_token`: its admin routes need the mounted token. No
    secret is a flag: the Redis URL comes in $WEIR_REDIS_URL, the token as a file."""
    port = pool.spec.sidecar.port
    token = ["--admin-token-file", ADMIN_TOKEN_FILE] if admin_token else []
    return [
        "sidecar",
        "--engine-url",
        f"http://127.0.0.1:{pool.spec.engine.port}",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--pool",
        pool.name,
        "--endpoint-id",
        "$(POD_NAME)",
        "--advertise-url",
        f"http://$(POD_IP):{port}",
        "--policy-file",
        f"{POLICY_DIR}/{POLICY_FILE}",
        *token,
        *(["--log-decisions"] if pool.spec.sidecar.log_decisions else []),
    ]


def drain_command(pool: Pool, *, admin_token: bool = True) -> list[str]:
    """The preStop hook: drain the sidecar (with its admin token, when it has one)."""
    port = pool.spec.sidecar.port
    token = ["--admin-token-file", ADMIN_TOKEN_FILE] if admin_token else []
    return [
        "weir",
        "sidecar",
        "drain",
        "--url",
        f"http://127.0.0.1:{port}",
        "--deadline-s",
        str(pool.spec.sidecar.drain_deadline_seconds),
        *token,
    ]


def _quantities(resources: Mapping[str, Any], key: str) -> dict[str, str]:
    # Quantities as strings, as the API server returns them: `4` and `"4"` must not look
    # like a change on every pass.
    return {name: str(value) for name, value in (resources.get(key) or {}).items()}


def _resources(resources: Mapping[str, Any], gpus: int = 0) -> V1ResourceRequirements:
    limits = _quantities(resources, "limits")
    requests = _quantities(resources, "requests")
    if gpus and GPU not in limits and GPU not in requests:
        limits[GPU] = str(gpus)
    return V1ResourceRequirements(limits=limits or None, requests=requests or None)


def _field_env(name: str, path: str) -> V1EnvVar:
    return V1EnvVar(
        name=name, value_from=V1EnvVarSource(field_ref=V1ObjectFieldSelector(field_path=path))
    )


def _tracing_env(config: OperatorConfig) -> list[V1EnvVar]:
    """Where the sidecar exports its spans (none when no endpoint is configured)."""
    if not config.otlp_endpoint:
        return []
    return [
        V1EnvVar(name="OTEL_EXPORTER_OTLP_ENDPOINT", value=config.otlp_endpoint),
        V1EnvVar(name="OTEL_SERVICE_NAME", value="weir-sidecar"),
    ]


def render_deployment(pool: Pool, replicas: int, config: OperatorConfig) -> dict[str, Any]:
    """Engines with their sidecars. `replicas` is passed in because scaling owns it: a
    re-render keeps whatever count the scaler last set."""
    spec = pool.spec
    sidecar_port = spec.sidecar.port
    probe_period = 10
    guarded = bool(config.admin_secret)
    uid = engine_user(pool, config)
    sidecar_mounts = [
        V1VolumeMount(name="policy", mount_path=POLICY_DIR, read_only=True),
        V1VolumeMount(name="sidecar-tmp", mount_path="/tmp"),
    ]
    engine_mounts = [V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    engine_env = [V1EnvVar(name=e.name, value=e.value) for e in spec.engine.env]
    volumes = [
        V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory")),
        V1Volume(name="policy", config_map=V1ConfigMapVolumeSource(name=configmap_name(pool))),
        V1Volume(name="sidecar-tmp", empty_dir=V1EmptyDirVolumeSource()),
    ]
    if uid:
        engine_mounts.append(V1VolumeMount(name="engine-home", mount_path=ENGINE_HOME))
        volumes.append(V1Volume(name="engine-home", empty_dir=V1EmptyDirVolumeSource()))
        if not any(e.name == "HOME" for e in spec.engine.env):
            engine_env.insert(0, V1EnvVar(name="HOME", value=ENGINE_HOME))
    if guarded:
        sidecar_mounts.append(
            V1VolumeMount(name="admin-token", mount_path=ADMIN_TOKEN_DIR, read_only=True)
        )
        volumes.append(
            V1Volume(
                name="admin-token",
                secret=V1SecretVolumeSource(
                    secret_name=config.admin_secret,
                    items=[V1KeyToPath(key=config.admin_secret_key, path="token")],
                ),
            )
        )
    bootstrap = (
        [V1ContainerPort(name="bootstrap", container_port=spec.engine.bootstrap_port)]
        if spec.role is Role.PREFILL
        else None
    )
    engine = V1Container(
        name="engine",
        image=spec.engine.image,
        command=["python3", "-m", "sglang.launch_server"],
        args=engine_args(pool),
        ports=bootstrap,
        env=engine_env or None,
        resources=_resources(spec.engine.resources, gpus=spec.engine.tensor_parallel),
        volume_mounts=engine_mounts,
        security_context=_engine_security(pool, uid),
    )
    sidecar = V1Container(
        name="sidecar",
        image=spec.sidecar.image or config.image,
        command=["weir"],
        args=sidecar_args(pool, admin_token=guarded),
        ports=[V1ContainerPort(name="http", container_port=sidecar_port)],
        env=[
            V1EnvVar(
                name="WEIR_REDIS_URL",
                value_from=V1EnvVarSource(
                    secret_key_ref=V1SecretKeySelector(
                        name=config.redis_secret, key=config.redis_secret_key
                    )
                ),
            ),
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_IP", "status.podIP"),
            *_tracing_env(config),
        ],
        resources=_resources(spec.sidecar.resources),
        volume_mounts=sidecar_mounts,
        security_context=_sidecar_security(),
        # /health answers 200 while the sidecar serves and 503 once it drains, which takes
        # the pod out of the headless Service; weights can take long to load, hence the
        # generous startup probe. Liveness only asks whether the process listens: a
        # draining sidecar must not be restarted.
        startup_probe=V1Probe(
            http_get=V1HTTPGetAction(path="/health", port="http"),
            period_seconds=probe_period,
            failure_threshold=max(1, spec.engine.startup_timeout_seconds // probe_period),
        ),
        readiness_probe=V1Probe(
            http_get=V1HTTPGetAction(path="/health", port="http"), period_seconds=5
        ),
        liveness_probe=V1Probe(
            tcp_socket=V1TCPSocketAction(port="http"),
            period_seconds=probe_period,
            failure_threshold=3,
        ),
        lifecycle=V1Lifecycle(
            pre_stop=V1LifecycleHandler(
                _exec=V1ExecAction(command=drain_command(pool, admin_token=guarded))
            )
        ),
    )
    anti_affinity = Affinity(
        pod_anti_affinity=V1PodAntiAffinity(
            preferred_during_scheduling_ignored_during_execution=[
                V1WeightedPodAffinityTerm(
                    weight=100,
                    pod_affinity_term=V1PodAffinityTerm(
                        label_selector=V1LabelSelector(match_labels={POOL_LABEL: pool.name}),
                        topology_key="kubernetes.io/hostname",
                    ),
                )
            ]
        )
    )
    template = V1PodTemplateSpec(
        metadata=V1ObjectMeta(labels=labels(pool), annotations={POLICY_HASH: policy_hash(pool)}),
        spec=V1PodSpec(
            containers=[engine, sidecar],
            service_account_name=service_account_name(pool),
            automount_service_account_token=False,
            security_context=V1PodSecurityContext(
                run_as_non_root=True if uid else None,
                seccomp_profile=V1SeccompProfile(type="RuntimeDefault"),
            ),
            affinity=anti_affinity,
            # preStop drains for up to the deadline; leave time for the engine to stop.
            termination_grace_period_seconds=spec.sidecar.drain_deadline_seconds + 30,
            volumes=volumes,
        ),
    )
    return _plain(
        V1Deployment(
            api_version="apps/v1",
            kind="Deployment",
            metadata=_meta(pool),
            spec=V1DeploymentSpec(
                replicas=replicas,
                selector=V1LabelSelector(match_labels=selector_labels(pool)),
                # Never take an engine away before its replacement serves: GPUs are scarce,
                # so surge one at a time.
                strategy=V1DeploymentStrategy(
                    type="RollingUpdate",
                    rolling_update=V1RollingUpdateDeployment(max_surge=1, max_unavailable=0),
                ),
                template=template,
            ),
        )
    )


def render_service(pool: Pool) -> dict[str, Any]:
    """Headless: routers address endpoints individually, never through a virtual IP."""
    return _plain(
        V1Service(
            api_version="v1",
            kind="Service",
            metadata=_meta(pool),
            spec=V1ServiceSpec(
                cluster_ip="None",
                selector=selector_labels(pool),
                ports=[V1ServicePort(name="http", port=pool.spec.sidecar.port, target_port="http")],
                publish_not_ready_addresses=False,
            ),
        )
    )


def render_pdb(pool: Pool) -> dict[str, Any]:
    return _plain(
        V1PodDisruptionBudget(
            api_version="policy/v1",
            kind="PodDisruptionBudget",
            metadata=_meta(pool),
            spec=V1PodDisruptionBudgetSpec(
                max_unavailable=1, selector=V1LabelSelector(match_labels=selector_labels(pool))
            ),
        )
    )


def render_servicemonitor(pool: Pool) -> dict[str, Any]:
    """Prometheus Operator's ServiceMonitor (a CRD: no client model exists for it)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _plain(_meta(pool)),
        "spec": {
            "selector": {"matchLabels": selector_labels(pool)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def render_children(
    pool: Pool, replicas: int, config: OperatorConfig, *, monitoring: bool
) -> list[dict[str, Any]]:
    """Every child of the pool, in the order they are applied (the policy and the
    ServiceAccount before the pods that use them). `monitoring`: whether the
    ServiceMonitor CRD exists in the cluster."""
    children = [
        render_service_account(pool),
        render_configmap(pool),
        render_service(pool),
        render_pdb(pool),
        render_deployment(pool, replicas, config),
    ]
    if monitoring:
        children.append(render_servicemonitor(pool))
    return children
