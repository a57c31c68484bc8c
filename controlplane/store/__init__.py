"""The control plane's shared truth in Redis.

Layout: every key of a pool is `weir:{pool}:...` (one hash tag, one Cluster slot). Every
write is a Lua script (in `lua/`, called by SHA, reloaded on NOSCRIPT) that checks the
writer's epoch and version and measures leases by Redis server time.

Errors: `FencedError` (a zombie's write: a newer epoch holds the endpoint id) and
`controlplane.contract.SchemaError` (a malformed record or an unknown schema version:
nothing is written); `ValueError` for invalid names and arguments; `redis` exceptions
when Redis stays unreachable after the client's retries.
"""

from controlplane.store.commands import CommandChannel, Delivery
from controlplane.store.connection import RedisSettings, connect
from controlplane.store.credits import CreditRefusal, CreditStore
from controlplane.store.follower import PoolFollower, Refresh
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
    PoolSnapshot,
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
    "PoolSnapshot",
    "QuotaStore",
    "Reaped",
    "RedisSettings",
    "Refresh",
    "TenantUsage",
    "connect",
    "reap_forever",
]
