"""Prefill->decode handoff credits: decode capacity promised to a prefill, until expiry.

In a disaggregated pool the router admits a prefill only with a credit: KV bytes on a
decode class that no other prefill can be promised meanwhile. The decode side consumes the
credit when the request arrives; an unconsumed credit expires by Redis server time and its
bytes return to the class's budget, so a lost prefill never strands decode capacity.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from controlplane.contract import HandoffCredit
from controlplane.store.connection import RedisClient
from controlplane.store.keys import PoolKeys, check_name, ttl_ms
from controlplane.store.scripts import as_text, script

_ISSUE = script("credit_issue.lua", "_credit.lua")
_CONSUME = script("credit_consume.lua", "_credit.lua")
_EXPIRE = script("credit_expire.lua", "_credit.lua")


@dataclass(frozen=True, slots=True)
class CreditRefusal:
    """Why no credit was issued; `retry_after_s` is None when waiting cannot help."""

    reason: str
    retry_after_s: float | None


def _positive_int(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**62:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class CreditStore:
    """One pool's handoff credits and the decode classes' budgets."""

    def __init__(self, redis: RedisClient, pool: str, *, sweep_limit: int = 100) -> None:
        self.redis = redis
        self.pool = pool
        self.keys = PoolKeys(pool)
        self.sweep_limit = sweep_limit

    @property
    def _keys(self) -> tuple[str, str, str]:
        return (self.keys.credits, self.keys.credit_expiry, self.keys.credit_budget)

    async def set_budget(
        self, decode_class: str, kv_bytes: int, largest_bytes: int | None = None
    ) -> None:
        """How many KV bytes outstanding credits may promise on `decode_class`, and the
        most one credit may promise: the room of the class's largest endpoint, since a
        handoff lands on one engine (None: no such bound). Both are set at once."""
        check_name("decode class", decode_class)
        _non_negative_int("kv_bytes", kv_bytes)
        if largest_bytes is not None:
            _non_negative_int("largest_bytes", largest_bytes)
        key = self.keys.credit_budget
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, f"cap:{decode_class}", kv_bytes)
            if largest_bytes is None:
                pipe.hdel(key, f"max:{decode_class}")
            else:
                pipe.hset(key, f"max:{decode_class}", largest_bytes)
            await pipe.execute()

    async def outstanding(self, decode_class: str) -> int:
        raw = await self.redis.hget(
            self.keys.credit_budget, f"out:{check_name('decode class', decode_class)}"
        )
        return int(raw or 0)

    async def issue(
        self, decode_class: str, kv_bytes: int, ttl_s: float, credit_id: str = ""
    ) -> HandoffCredit | CreditRefusal:
        """Promise `kv_bytes` on `decode_class` for `ttl_s`. Issuing again under the same
        `credit_id` returns the credit already held (a retried call promises nothing twice)."""
        check_name("decode class", decode_class)
        _positive_int("kv_bytes", kv_bytes)
        lifetime_ms = ttl_ms("credit", ttl_s, max_s=3600)
        credit_id = check_name("credit id", credit_id or uuid.uuid4().hex)
        reply = await _ISSUE(
            self.redis,
            self._keys,
            (credit_id, decode_class, kv_bytes, lifetime_ms, self.sweep_limit),
        )
        if int(reply[0]) == 1:
            return HandoffCredit(
                credit_id=credit_id,
                pool=self.pool,
                decode_class=as_text(reply[2]),
                kv_bytes=int(reply[3]),
                expires_at=int(reply[1]) / 1000,
            )
        wait = int(reply[2]) if len(reply) > 2 else -1
        return CreditRefusal(as_text(reply[1]), None if wait < 0 else wait / 1000)

    async def consume(self, credit_id: str) -> HandoffCredit | CreditRefusal:
        """Take a credit (once). Refused as 'expired' or 'unknown' otherwise."""
        reply = await _CONSUME(self.redis, self._keys, (check_name("credit id", credit_id),))
        if int(reply[0]) != 1:
            return CreditRefusal(as_text(reply[1]), None)
        return HandoffCredit(
            credit_id=credit_id,
            pool=self.pool,
            decode_class=as_text(reply[1]),
            kv_bytes=int(reply[2]),
            expires_at=int(reply[3]) / 1000,
        )

    async def expire(self) -> int:
        """Expire lapsed credits now (issue sweeps too); returns how many."""
        return int(await _EXPIRE(self.redis, self._keys, (self.sweep_limit,)))
