"""Weir's one contract: the wire schema every writer and reader goes through.

Endpoint state, commands, tenant quotas, handoff credits, continuations, the pool policy
and finish reasons are defined here once, with a schema version. Records are msgspec
structs: immutable, typed, strictly validated on decode. `codec` turns them into compact
bytes (msgpack for Redis, JSON for humans and HTTP) and rejects unknown schema versions and
malformed input with `SchemaError`, overwriting nothing.
"""

from controlplane.contract.codec import SchemaError, decode, decode_json, encode, encode_json
from controlplane.contract.models import (
    MAX_HOST_PREFIXES,
    SCHEMA_VERSION,
    CacheIdentity,
    Command,
    CommandKind,
    Continuation,
    EndpointState,
    EngineAPI,
    FinishReason,
    HandoffCredit,
    Lifecycle,
    Role,
    RoomReservation,
    TenantQuota,
    WatermarkState,
)
from controlplane.contract.policy import (
    AutoscalingPolicy,
    KVPolicy,
    PoolPolicy,
    PreemptionMode,
    RoutingPolicy,
    SchedulingPolicy,
)

__all__ = [
    "MAX_HOST_PREFIXES",
    "SCHEMA_VERSION",
    "AutoscalingPolicy",
    "CacheIdentity",
    "Command",
    "CommandKind",
    "Continuation",
    "EndpointState",
    "EngineAPI",
    "FinishReason",
    "HandoffCredit",
    "KVPolicy",
    "Lifecycle",
    "PoolPolicy",
    "PreemptionMode",
    "Role",
    "RoomReservation",
    "RoutingPolicy",
    "SchedulingPolicy",
    "SchemaError",
    "TenantQuota",
    "WatermarkState",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
]
