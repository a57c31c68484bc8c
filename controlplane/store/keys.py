"""The Redis key layout: every key of a pool carries the pool's hash tag.

`weir:{pool}:...` puts all of a pool's keys in one Redis Cluster slot, so every Lua script
touches a single slot and runs unchanged on a standalone server, behind Sentinel or on a
cluster. Names (and TTLs, which every script takes) are validated here because a name with a brace, a glob character or a space
would break the hash tag, pattern scans or the scripts' space-separated metadata.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_POOL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}")


def check_pool(pool: str) -> str:
    """Return `pool` if it is a valid pool name (Kubernetes-like, at most 63 characters)."""
    if not isinstance(pool, str) or not _POOL.fullmatch(pool):
        raise ValueError(f"invalid pool name {pool!r}: use letters, digits, '.', '_', '-'")
    return pool


def check_name(kind: str, name: str) -> str:
    """Return `name` if it is a valid endpoint id, tenant, holder, class or command id."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid {kind} {name!r}: 1-253 characters of letters, digits and ._:/@-")
    return name


def ttl_ms(what: str, ttl_s: float, max_s: float = 86_400) -> int:
    """`ttl_s` in whole milliseconds (at least 1), if it is a finite number in (0, max_s]."""
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and 0 < ttl_s <= max_s):
        raise ValueError(f"{what} ttl must be in (0, {max_s:g}] seconds, got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """All keys of one pool."""

    pool: str

    def __post_init__(self) -> None:
        check_pool(self.pool)

    def _key(self, suffix: str) -> str:
        return f"weir:{{{self.pool}}}:{suffix}"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of the pool."""
        return self._key("*")

    # endpoints and the change feed (see lua/_feed.lua for the counters)
    @property
    def counters(self) -> str:
        return self._key("counters")

    @property
    def state(self) -> str:
        return self._key("state")

    @property
    def leases(self) -> str:
        return self._key("leases")

    @property
    def changes(self) -> str:
        return self._key("changes")

    @property
    def endpoint_keys(self) -> tuple[str, str, str, str]:
        """KEYS[1..4] of every endpoint script: state, leases, counters, changes."""
        return (self.state, self.leases, self.counters, self.changes)

    # hot-prefix overrides
    @property
    def hot(self) -> str:
        return self._key("hot")

    @property
    def hot_expiry(self) -> str:
        return self._key("hotexp")

    # tenant quotas (see lua/quota_charge.lua)
    @property
    def quotas(self) -> str:
        return self._key("quotas")

    @property
    def quota_records(self) -> str:
        """tenant -> TenantQuota (msgpack), as it was set."""
        return self._key("quotarecords")

    @property
    def usage(self) -> str:
        return self._key("usage")

    @property
    def classes(self) -> str:
        return self._key("classes")

    @property
    def charges(self) -> str:
        return self._key("charges")

    @property
    def holders(self) -> str:
        return self._key("holders")

    def held_by(self, holder: str) -> str:
        return self._key(f"held:{check_name('holder', holder)}")

    # prefill -> decode handoff credits (see lua/credit_issue.lua)
    @property
    def credits(self) -> str:
        return self._key("credits")

    @property
    def credit_expiry(self) -> str:
        return self._key("creditexp")

    @property
    def credit_budget(self) -> str:
        return self._key("creditbudget")

    # command channel
    def commands(self, endpoint_id: str) -> str:
        return self._key(f"cmd:{check_name('endpoint id', endpoint_id)}")

    def command_id(self, command_id: str) -> str:
        return self._key(f"cmdid:{check_name('command id', command_id)}")
