"""How one router serves one pool: its settings, from the command line or the pool policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.contract import KVPolicy, PoolPolicy, Role, RoutingPolicy, TenantQuota
from controlplane.router.requests import RequestLimits
from controlplane.transport import MAX_CONNECTIONS_PER_ORIGIN
from controlplane.transport.guard import ServerLimits


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How one router serves one pool. `max_resumes` bounds continuations after the
    first byte (an engine or sidecar lost, a migration); the fair queue's size and time to
    live, the tries before the first byte and how long a resume waits for an endpoint are
    the pool policy's (`routing`), shared with the simulator.
    `max_upstream_connections` caps the connections open to one endpoint: past it a
    request waits for one to come free, up to `connect_timeout_s`, then tries another
    endpoint. Its default is the router's own connection cap (`server.max_connections`'s
    default): a client connection has at most one request upstream at a time, so the cap
    binds only on requests no client waits for (aborts) piling up on one endpoint."""

    pool: str = "default"
    model: str = "reference"
    host: str = "127.0.0.1"
    port: int = 0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # What the router reads from clients: body size (by default sized to the context
    # length), bytes in flight, header/body/idle timeouts, connections.
    server: ServerLimits = field(default_factory=lambda: ServerLimits(max_connections=8192))
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    profile: Mapping[str, Any] | None = None
    max_resumes: int = 4
    connect_timeout_s: float = 2.0
    chunk_timeout_s: float = 120.0
    max_upstream_connections: int = MAX_CONNECTIONS_PER_ORIGIN
    enforce_quotas: bool = False
    # A prefill pool (role PREFILL) takes a handoff credit on its decode pool's class.
    role: Role = Role.MIXED
    decode_pool: str = ""
    kv_bytes_per_token: int = 131_072
    credit_ttl_s: float = 30.0
    # A decode pool's router publishes its handoff budget as its sidecars would admit.
    kv: KVPolicy = field(default_factory=KVPolicy)
    # Tenant quotas this router publishes to the control plane at start (the pool
    # policy's); with quotas enforced, a tenant without one is refused with 403.
    tenants: tuple[TenantQuota, ...] = ()
    # Bearer token of the debug route (GET /weir/v1/requests/{id}), and the one it shows
    # the sidecars to read theirs; empty leaves the route open.
    admin_token: str = field(default="", repr=False)

    @classmethod
    def from_policy(cls, policy: PoolPolicy, **overrides: Any) -> RouterConfig:
        """The router settings of a pool policy (the operator's `<pool>-policy`
        ConfigMap): pool, model, context length, routing, role and tenant quotas, which
        are enforced when the policy declares any. `overrides` win."""
        fields: dict[str, Any] = {
            "pool": policy.pool,
            "model": policy.model,
            "limits": RequestLimits(context_length=policy.context_length),
            "routing": policy.routing,
            "role": policy.role,
            "decode_pool": policy.decode_pool,
            "kv": policy.kv,
            "tenants": policy.tenants,
            "enforce_quotas": bool(policy.tenants),
        }
        fields.update(overrides)
        return cls(**fields)
