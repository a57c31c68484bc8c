"""How one router serves one pool: its settings, from the command line or the pool policy.

`RouterConfig` is a frozen tree, as kopf's `OperatorSettings` is: what the router is
(pool, model, role, where it listens) at the top, and one small frozen group per concern
below it, read at the use site by its dotted path (`config.upstream.connect_timeout_s`,
`config.handoff.credit_ttl_s`, `config.quotas.enforce`). A value out of range is refused
when its group is made, with a `SettingError` naming it by that path, so a bad flag or
test setting fails at once instead of as a router that never times out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.contract import KVPolicy, PoolPolicy, Role, RoutingPolicy, TenantQuota
from controlplane.router.requests import RequestLimits
from controlplane.transport import MAX_CONNECTIONS_PER_ORIGIN
from controlplane.transport.guard import ServerLimits


class SettingError(ValueError):
    """A router setting refused, named by its dotted path from `RouterConfig`
    (`upstream.max_resumes`): `weir router` reports it against the flag that gave it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.path = path


def _positive_seconds(path: str, value: float) -> None:
    if not 0 < value < math.inf:  # NaN fails too
        raise SettingError(path, f"must be a positive number of seconds, got {value!r}")


def _at_least(path: str, value: int, least: int) -> None:
    if value < least:
        raise SettingError(path, f"must be at least {least}, got {value!r}")


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    """How the router talks to its pool's endpoints (their sidecars, or fixed engines).

    `connect_timeout_s` (2 s): a connection inside a cluster is made in milliseconds; 2 s
    leaves room for one lost SYN (Linux sends it again after 1 s), and past it the request
    is tried on another endpoint before the first byte rather than waiting on a dead one.
    It also bounds the wait for a connection to come free at `max_connections`.

    `chunk_timeout_s` (120 s): the longest silence between an endpoint's bytes, the first
    included. The first can come late: a new request may wait in its sidecar's queue
    (`scheduling.local_queue_max_wait_s`, 30 s) and then for a long prompt's prefill. An
    endpoint silent past it is broken: the request is retried or resumed elsewhere.

    `max_connections` caps the connections open to one endpoint: past it a request waits
    for one to come free, up to `connect_timeout_s`, then tries another endpoint. Its
    default is the router's own connection cap (`server.max_connections`'s default): a
    client connection has at most one request upstream at a time, so the cap binds only
    on requests no client waits for (aborts) piling up on one endpoint.

    `max_resumes` (4) bounds the continuations of one stream after its first byte (an
    engine or sidecar lost, a migration): room for the sidecar's relief to hand a request
    back as often as it may preempt it (`scheduling.max_preemptions_per_request`, 3) and
    one engine lost besides. The tries before the first byte, and how long a resume waits
    for an endpoint, are the pool policy's (`routing`), shared with the simulator."""

    connect_timeout_s: float = 2.0
    chunk_timeout_s: float = 120.0
    max_connections: int = MAX_CONNECTIONS_PER_ORIGIN
    max_resumes: int = 4

    def __post_init__(self) -> None:
        _positive_seconds("upstream.connect_timeout_s", self.connect_timeout_s)
        _positive_seconds("upstream.chunk_timeout_s", self.chunk_timeout_s)
        _at_least("upstream.max_connections", self.max_connections, 1)
        _at_least("upstream.max_resumes", self.max_resumes, 0)


@dataclass(frozen=True, slots=True)
class HandoffSettings:
    """The prefill→decode handoff credit (`controlplane.router.credits`), for a pool in a
    P/D pair. A prefill pool's router (role PREFILL) takes a credit for each request's KV
    on `decode_pool`'s class before either leg starts; a decode pool's router (role
    DECODE) publishes that class's budget as its sidecars would admit, by the pool's KV
    watermarks (`kv`, the policy's). A mixed pool uses none of it.

    `kv_bytes_per_token` (131072) prices a prompt's KV in a credit: Llama-3.1-8B's in
    bf16 (32 layers × 8 KV heads × 128 dimensions × K and V × 2 bytes), the model
    `weir router` serves by default. Both routers of a pair must use the same figure.

    `credit_ttl_s` (30 s): a credit is settled when the handoff lands or the request ends,
    so it expires only when its router died mid-pair; this is how long the decode capacity
    it promised stays spoken for then. It should outlast the wait from taking a credit to
    the handoff (a prefill leg's queue wait and prefill)."""

    decode_pool: str = ""
    kv_bytes_per_token: int = 131_072
    credit_ttl_s: float = 30.0
    kv: KVPolicy = field(default_factory=KVPolicy)

    def __post_init__(self) -> None:
        _at_least("handoff.kv_bytes_per_token", self.kv_bytes_per_token, 1)
        _positive_seconds("handoff.credit_ttl_s", self.credit_ttl_s)


@dataclass(frozen=True, slots=True)
class QuotaSettings:
    """Tenant quotas. `tenants` are the ones this router publishes to the control plane at
    start (the pool policy's); `enforce` admits each request against its tenant's quota
    there, and refuses a tenant without one with 403. Off by default: a router on fixed
    engines has no control plane to count in; `RouterConfig.from_policy` turns it on when
    the policy declares tenants."""

    enforce: bool = False
    tenants: tuple[TenantQuota, ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for quota in self.tenants:
            if quota.name in seen:  # two quotas for one tenant: neither could be the one
                raise SettingError("quotas.tenants", f"names tenant {quota.name!r} twice")
            seen.add(quota.name)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How one router serves one pool: which pool and model, in which role (what its
    endpoints do: mixed, or one half of a P/D pair), where it listens, and its groups.
    `admin_token` is the bearer token of the debug route (GET /weir/v1/requests/{id}),
    and the one it shows the sidecars to read theirs; empty leaves the route open.
    `profile` is a routing profile (`controlplane.routing`) in place of the one the pool
    policy's `routing` makes."""

    pool: str = "default"
    model: str = "reference"
    role: Role = Role.MIXED
    host: str = "127.0.0.1"
    port: int = 0
    admin_token: str = field(default="", repr=False)
    # What the router reads from clients: context length and the bytes of a token in its
    # estimates (`limits`); body size (by default sized to the context length), bytes in
    # flight, header/body/idle timeouts, connections (`server`).
    limits: RequestLimits = field(default_factory=RequestLimits)
    server: ServerLimits = field(default_factory=lambda: ServerLimits(max_connections=8192))
    # How it places requests (the pool policy's, shared with the simulator): the fair
    # queue's size and time to live, the tries before the first byte, the resume wait.
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    profile: Mapping[str, Any] | None = None
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    handoff: HandoffSettings = field(default_factory=HandoffSettings)
    quotas: QuotaSettings = field(default_factory=QuotaSettings)

    def __post_init__(self) -> None:
        for path in ("pool", "model", "host"):
            if not getattr(self, path):
                raise SettingError(path, "must not be empty")
        if not 0 <= self.port <= 65_535:
            raise SettingError("port", f"must be in [0, 65535] (0: a free one), got {self.port}")
        decode_pool = self.handoff.decode_pool
        if self.role is Role.PREFILL and not decode_pool:
            raise SettingError("handoff.decode_pool", "must name the decode pool of a prefill pool")
        if self.role is not Role.PREFILL and decode_pool:
            raise SettingError(
                "handoff.decode_pool",
                f"is only for a prefill pool, got {decode_pool!r} for a {self.role} pool",
            )
        if decode_pool == self.pool:
            raise SettingError("handoff.decode_pool", f"must be another pool than {self.pool!r}")

    @classmethod
    def from_policy(cls, policy: PoolPolicy, **overrides: Any) -> RouterConfig:
        """The router settings of a pool policy (the operator's `<pool>-policy`
        ConfigMap): pool, model, role, context length, routing, the decode pool and KV
        watermarks of a P/D pair, and tenant quotas, which are enforced when the policy
        declares any. `overrides` (top-level fields or whole groups) win."""
        fields: dict[str, Any] = {
            "pool": policy.pool,
            "model": policy.model,
            "role": policy.role,
            "limits": RequestLimits(context_length=policy.context_length),
            "routing": policy.routing,
            "handoff": HandoffSettings(decode_pool=policy.decode_pool, kv=policy.kv),
            "quotas": QuotaSettings(enforce=bool(policy.tenants), tenants=policy.tenants),
        }
        fields.update(overrides)
        return cls(**fields)
