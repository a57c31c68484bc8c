"""The control plane's shared truth in Redis.

Every write is a Lua script (in `lua/`, a header naming KEYS/ARGV/return; called by SHA,
reloaded on NOSCRIPT) that checks the writer's epoch and version and measures leases and
expiries by Redis server time, never a client clock.

Key layout: every key of a pool is `weir:{pool}:<name>`: one hash tag, so one Redis Cluster
slot and single-slot scripts.

    counters      hash    inc (feed incarnation), mv (membership version), epoch, hv
    state         hash    <endpoint> -> 'epoch version lifecycle lease_ms',
                          <endpoint># -> EndpointState (msgpack)
    leases        zset    endpoint -> lease expiry (server ms), for the reaper
    changes       stream  the change feed, entry ids 0-<seq> (see lua/_feed.lua)
    hot, hotexp   hash, zset   hot-prefix overrides and their expiries
    quotas, quotarecords, usage, classes, charges, holders, held:<holder>   tenant quotas
    credits, creditexp, creditbudget                                        handoff credits
    cmd:<endpoint>, cmdid:<command id>                                      command channel

Public pieces: `connect(RedisSettings)` (a `RedisClient`: standalone, behind Sentinel or
a Redis Cluster) and `redact_url` (a URL fit to log);
`EndpointRegistry` (register, heartbeat, drain, deregister, reap, snapshot, changes, hot
prefixes); `PoolFollower` (a reader's view kept current from the feed); `EndpointLease` (a
sidecar's side of its lease) and `reap_forever`; `QuotaStore` and `QuotaHolder` (a
holder's side of its charges: releases kept until Redis takes them, reconciliation);
`CreditStore`; `CommandChannel`.

Errors: `FencedError` (a zombie's write: a newer epoch holds the endpoint id) and
`controlplane.contract.SchemaError` (a malformed record or an unknown schema version:
nothing is written); `ValueError` for invalid names and arguments; `redis` exceptions
when Redis stays unreachable after the client's retries.
"""

from controlplane.store.commands import CommandChannel, Delivery
from controlplane.store.connection import (
    RedisClient,
    RedisSettings,
    cancel_loops,
    connect,
    redact_url,
)
from controlplane.store.credits import CreditRefusal, CreditStore
from controlplane.store.follower import PoolFollower, Refresh
from controlplane.store.holder import QuotaHolder
from controlplane.store.keys import PoolKeys
from controlplane.store.lease import EndpointLease, reap_forever
from controlplane.store.quotas import Amounts, ChargeResult, QuotaStore, TenantUsage
from controlplane.store.registry import (
    EndpointRegistry,
    FencedError,
    HeartbeatResult,
    HeartbeatStatus,
    Reaped,
)
from controlplane.store.snapshot import (
    Change,
    ChangeBatch,
    ChangeKind,
    FeedPosition,
    StoredPool,
)

__all__ = [
    "Amounts",
    "Change",
    "ChangeBatch",
    "ChangeKind",
    "ChargeResult",
    "CommandChannel",
    "CreditRefusal",
    "CreditStore",
    "Delivery",
    "EndpointLease",
    "EndpointRegistry",
    "FeedPosition",
    "FencedError",
    "HeartbeatResult",
    "HeartbeatStatus",
    "PoolFollower",
    "PoolKeys",
    "QuotaHolder",
    "QuotaStore",
    "Reaped",
    "RedisClient",
    "RedisSettings",
    "Refresh",
    "StoredPool",
    "TenantUsage",
    "cancel_loops",
    "connect",
    "reap_forever",
    "redact_url",
]
