"""The InferencePool spec as the operator reads it, and the pool policy it implies.

The CRD (crds/inferencepool.yaml) spells fields in camelCase; the sections `kv`,
`scheduling`, `routing`, `autoscaling` and `tenants` map 1:1 onto
`controlplane.contract.PoolPolicy` (snake_case). `parse_pool` converts the keys and lets
msgspec decode straight into the contract's own structs, so the two never drift apart.

The API server validates the schema and the CEL rules, but an operator must not trust that
(an old CRD, a `kubectl replace --validate=false`, a hand-edited etcd): everything is
checked again here and a bad spec raises `InvalidPoolError` with a message fit for a condition.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from controlplane.contract import (
    AutoscalingPolicy,
    KVPolicy,
    PoolPolicy,
    Role,
    RoutingPolicy,
    SchedulingPolicy,
    TenantQuota,
)
from fleet_operator.config import MAX_UID

GROUP = "inference.weir.dev"
VERSION = "v1alpha1"
PLURAL = "inferencepools"

# The pool's Service takes its name, so it must be a DNS-1035 label (a leading digit is a
# valid object name but not a Service name); it is also the pool's control-plane id.
_POOL_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# Kubernetes' resource.Quantity syntax (the CRD's pattern for resources).
_QUANTITY = re.compile(
    r"[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?(\d+(\.\d*)?|\.\d+))?"
)
# Environment variable names every Kubernetes release accepts (the CRD's pattern).
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
# A Linux capability as Kubernetes names it, without CAP_ (the CRD's pattern).
_CAPABILITY = re.compile(r"[A-Z][A-Z0-9_]*")
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
# Free-form maps whose keys are Kubernetes' own (resource names, env values): left as is.
_OPAQUE = frozenset({"resources"})


# SGLang's KV transfer backends for P/D pools (`fake` is a decode-only benchmark harness).
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl", "ascend", "mori")


class InvalidPoolError(ValueError):
    """The spec cannot be served; the message says which field and why."""


class EnvVar(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    value: str = ""


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    source: str = ""
    served_name: str = ""
    context_length: int = 32768

    @property
    def path(self) -> str:
        return self.source or self.name

    @property
    def served(self) -> str:
        return self.served_name or self.name


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    image: str = "lmsysorg/sglang:v0.5.5"
    port: int = 30000
    tensor_parallel: int = 1
    mem_fraction_static: float = 0.0
    extra_args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = ()
    resources: dict[str, Any] = msgspec.field(default_factory=dict)
    startup_timeout_seconds: int = 1800
    # None: the operator's default (WEIR_ENGINE_RUN_AS_USER); 0 runs the engine as root.
    run_as_user: int | None = None
    # Added to a container that otherwise drops every capability (e.g. IPC_LOCK for RDMA).
    add_capabilities: tuple[str, ...] = ()
    # P/D pools (spec.role prefill or decode): SGLang's --disaggregation-bootstrap-port of
    # a prefill pool's engines, and --disaggregation-transfer-backend of both pools.
    bootstrap_port: int = 8998
    transfer_backend: str = "mooncake"


class SidecarSpec(msgspec.Struct, frozen=True, kw_only=True):
    image: str = ""
    port: int = 8000
    drain_deadline_seconds: int = 120
    log_decisions: bool = False
    resources: dict[str, Any] = msgspec.field(default_factory=dict)


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True):
    min: int = 1
    max: int = 1


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelSpec
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    sidecar: SidecarSpec = msgspec.field(default_factory=SidecarSpec)
    replicas: ReplicaSpec = msgspec.field(default_factory=ReplicaSpec)
    role: Role = Role.MIXED
    decode_pool: str = ""
    kv: KVPolicy = msgspec.field(default_factory=KVPolicy)
    scheduling: SchedulingPolicy = msgspec.field(default_factory=SchedulingPolicy)
    routing: RoutingPolicy = msgspec.field(default_factory=RoutingPolicy)
    autoscaling: AutoscalingPolicy = msgspec.field(default_factory=AutoscalingPolicy)
    tenants: tuple[TenantQuota, ...] = ()


class Pool(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed InferencePool: identity, spec and the policy its engines obey."""

    name: str
    namespace: str
    spec: PoolSpec
    policy: PoolPolicy


def snake_case(key: str) -> str:
    return _CAMEL.sub("_", key).lower()


def _snake_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {snake_case(k): (v if k in _OPAQUE else _snake_keys(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_snake_keys(v) for v in value]
    return value


def parse_pool(name: str, namespace: str, spec: Mapping[str, Any]) -> Pool:
    """Decode and check an InferencePool spec; raise `InvalidPoolError` naming the problem."""
    if not _POOL_NAME.fullmatch(name):
        raise InvalidPoolError(
            f"pool name {name!r} must be a DNS-1035 label: lowercase letters, digits and '-', "
            "starting with a letter, at most 63 characters"
        )
    try:
        parsed = msgspec.convert(_snake_keys(spec), PoolSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidPoolError(f"spec: {exc}") from exc
    _check(parsed)
    try:
        policy = PoolPolicy(
            pool=name,
            model=parsed.model.served,
            role=parsed.role,
            decode_pool=parsed.decode_pool,
            context_length=parsed.model.context_length,
            kv=parsed.kv,
            scheduling=parsed.scheduling,
            routing=parsed.routing,
            autoscaling=parsed.autoscaling,
            tenants=parsed.tenants,
        )
    except ValueError as exc:
        raise InvalidPoolError(str(exc)) from exc
    return Pool(name=name, namespace=namespace, spec=parsed, policy=policy)


def _check(spec: PoolSpec) -> None:
    """The rules the CRD states in its schema and CEL, and a few it cannot."""
    problems: list[str] = []
    if not spec.model.name:
        problems.append("model.name must not be empty")
    if spec.model.context_length < 1:
        problems.append("model.contextLength must be positive")
    if not 0 <= spec.replicas.min <= spec.replicas.max:
        problems.append(
            f"replicas must satisfy 0 <= min <= max, got min={spec.replicas.min} "
            f"max={spec.replicas.max}"
        )
    if spec.engine.tensor_parallel < 1:
        problems.append("engine.tensorParallel must be at least 1")
    if not 0.0 <= spec.engine.mem_fraction_static <= 1.0:
        problems.append("engine.memFractionStatic must lie in [0, 1]")
    if spec.engine.port == spec.sidecar.port:
        problems.append("engine.port and sidecar.port must differ")
    if spec.role is Role.PREFILL and not spec.decode_pool:
        problems.append("a prefill pool must name its decode pool (spec.decodePool)")
    if spec.role is not Role.PREFILL and spec.decode_pool:
        problems.append("only a prefill pool names a decode pool")
    if spec.engine.bootstrap_port in (spec.engine.port, spec.sidecar.port):
        problems.append("engine.bootstrapPort must differ from engine.port and sidecar.port")
    if spec.engine.transfer_backend not in TRANSFER_BACKENDS:
        problems.append(
            f"engine.transferBackend must be one of {', '.join(TRANSFER_BACKENDS)}, got "
            f"{spec.engine.transfer_backend!r}"
        )
    if spec.kv.page_size < 1:
        problems.append("kv.pageSize must be at least 1")
    problems += [
        f"engine.env: {e.name!r} is not a valid environment variable name"
        for e in spec.engine.env
        if not _ENV_NAME.fullmatch(e.name)
    ]
    if spec.engine.run_as_user is not None and not 0 <= spec.engine.run_as_user <= MAX_UID:
        problems.append(f"engine.runAsUser must lie in [0, {MAX_UID}]")
    problems += [
        f"engine.addCapabilities: {c!r} is not a capability name (like IPC_LOCK, without CAP_)"
        for c in spec.engine.add_capabilities
        if not _CAPABILITY.fullmatch(c) or c.startswith("CAP_") or c == "ALL"
    ]
    for where, resources in (
        ("engine.resources", spec.engine.resources),
        ("sidecar.resources", spec.sidecar.resources),
    ):
        problems += _resource_problems(where, resources)
    names = [t.name for t in spec.tenants]
    if len(set(names)) != len(names):
        problems.append("tenant names must be unique")
    if any(t.weight <= 0 for t in spec.tenants):
        problems.append("tenant weights must be positive")
    if sum(t.reserved_fraction for t in spec.tenants) > 1.0:
        problems.append("tenants' reservedFraction must sum to at most 1")
    if problems:
        raise InvalidPoolError("; ".join(problems))


def _resource_problems(where: str, resources: Mapping[str, Any]) -> list[str]:
    """`resources` is free-form in the CRD; accept only limits/requests of quantities."""
    problems = []
    for key, quantities in resources.items():
        if key not in ("limits", "requests"):
            problems.append(f"{where}.{key}: only limits and requests are allowed")
        elif not isinstance(quantities, Mapping):
            problems.append(f"{where}.{key} must map resource names to quantities")
        else:
            problems += [
                f"{where}.{key}.{name}: {value!r} is not a Kubernetes quantity"
                for name, value in quantities.items()
                if isinstance(value, bool)
                or not isinstance(value, str | int)
                or not _QUANTITY.fullmatch(str(value))
            ]
    return problems
