"""Tenant quotas: concurrency, token rates, KV token-seconds and priority-class capacity.

A charge is checked and applied in one Lua script, all dimensions or none, and may cover
any subset of them: the router charges concurrency and token rates when it admits a
request, the sidecar charges KV token-seconds for what it reserves. Rates are token
buckets holding one minute's allowance, refilled continuously by Redis server time.

Every charge belongs to a holder (a router replica, a sidecar) with a lease. A holder that
crashes stops renewing; `reap_holders` then returns everything it held, so no ghost
reservation outlives its holder. Charging and releasing are idempotent per
(holder, request id): retrying either is safe. A live holder keeps its side of the account
with `controlplane.store.holder.QuotaHolder` (releases kept until Redis takes them, and
reconciled against `held`).

Priority classes: with a pool concurrency capacity set, each class keeps
`reserved_fraction * capacity` slots that only its tenants may use; the rest is shared.
The class's fraction is taken from its tenants' `TenantQuota.reserved_fraction` (give all
tenants of a class the same value; the last one set wins).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.contract import SCHEMA_VERSION, SchemaError, TenantQuota, decode, encode
from controlplane.store.connection import RedisClient
from controlplane.store.keys import PoolKeys, check_name, ttl_ms
from controlplane.store.scripts import as_text, script, server_time_ms

_CHARGE = script("quota_charge.lua", "_quota.lua")
_RELEASE = script("quota_release.lua", "_quota.lua")
_RENEW = script("holder_renew.lua")
_REAP = script("holder_reap.lua", "_quota.lua")


@dataclass(frozen=True, slots=True)
class Amounts:
    """What one request charges. Zero leaves a dimension alone."""

    concurrency: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    kv_token_seconds: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency", "input_tokens", "output_tokens", "kv_token_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**50:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class ChargeResult:
    """`reason` names the limit that refused (or 'duplicate' for a repeated charge);
    `retry_after_s` is None when waiting cannot help (unknown tenant, a request larger than
    a minute's allowance, an expired holder lease)."""

    granted: bool
    reason: str
    retry_after_s: float | None


@dataclass(frozen=True, slots=True)
class TenantUsage:
    concurrency: int
    input_tokens_left: float
    output_tokens_left: float
    kv_token_seconds_left: float


def _check_quota(quota: TenantQuota) -> None:
    if not isinstance(quota, TenantQuota):
        raise SchemaError(f"expected a TenantQuota, got {type(quota).__name__}")
    if quota.schema != SCHEMA_VERSION:
        raise SchemaError(f"TenantQuota has schema version {quota.schema}")
    check_name("tenant", quota.name)
    check_name("priority class", quota.priority_class)
    for name in (
        "max_concurrency",
        "input_tokens_per_min",
        "output_tokens_per_min",
        "kv_token_seconds_per_min",
    ):
        value = getattr(quota, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**50:
            raise SchemaError(f"TenantQuota.{name} must be a non-negative integer, got {value!r}")
    fraction = quota.reserved_fraction
    if not (isinstance(fraction, int | float) and 0 <= fraction <= 1):
        raise SchemaError(f"TenantQuota.reserved_fraction must be in [0, 1], got {fraction!r}")
    if not (
        isinstance(quota.weight, int | float) and math.isfinite(quota.weight) and quota.weight > 0
    ):
        raise SchemaError(f"TenantQuota.weight must be positive, got {quota.weight!r}")


class QuotaStore:
    """One pool's tenant quotas and the charges against them."""

    def __init__(self, redis: RedisClient, pool: str) -> None:
        self.redis = redis
        self.keys = PoolKeys(pool)

    async def set_quota(self, quota: TenantQuota) -> None:
        """Create or replace a tenant's limits (charges already made stay)."""
        _check_quota(quota)
        classes = {as_text(k): v for k, v in (await self.redis.hgetall(self.keys.classes)).items()}
        others = sum(
            float(v)
            for k, v in classes.items()
            if k.startswith("f:") and k[2:] != quota.priority_class
        )
        if others + quota.reserved_fraction > 1.0 + 1e-9:
            raise ValueError(
                f"reserved fractions of all classes would exceed 1 "
                f"({others:g} reserved by other classes + {quota.reserved_fraction:g})"
            )
        limits = (
            f"{quota.max_concurrency} {quota.input_tokens_per_min} "
            f"{quota.output_tokens_per_min} {quota.kv_token_seconds_per_min} "
            f"{quota.priority_class} {quota.reserved_fraction!r}"
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.quotas, quota.name, limits)
            pipe.hset(self.keys.quota_records, quota.name, encode(quota))
            pipe.hset(self.keys.classes, f"f:{quota.priority_class}", repr(quota.reserved_fraction))
            await pipe.execute()

    async def get_quota(self, tenant: str) -> TenantQuota | None:
        raw = await self.redis.hget(self.keys.quota_records, check_name("tenant", tenant))
        return decode(raw, TenantQuota) if isinstance(raw, bytes) else None

    async def set_capacity(self, concurrency: int) -> None:
        """The pool's concurrency capacity that class reservations divide (0: no limit)."""
        if not isinstance(concurrency, int) or concurrency < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {concurrency!r}")
        await self.redis.hset(self.keys.classes, "cap", concurrency)

    async def renew_holder(self, holder: str, ttl_s: float) -> int:
        """Start or renew `holder`'s lease; returns its expiry (server ms)."""
        lease = await _RENEW(
            self.redis,
            (self.keys.holders,),
            (check_name("holder", holder), ttl_ms("holder lease", ttl_s)),
        )
        return int(lease)

    def _charge_keys(self, holder: str) -> tuple[str, ...]:
        """The keys of the scripts that add or remove a holder's charges."""
        k = self.keys
        return (k.quotas, k.usage, k.classes, k.charges, k.holders, k.held_by(holder))

    async def charge(
        self, tenant: str, holder: str, request_id: str, amounts: Amounts
    ) -> ChargeResult:
        check_name("tenant", tenant)
        check_name("request id", request_id)
        granted, reason, retry_ms = await _CHARGE(
            self.redis,
            self._charge_keys(holder),
            (
                tenant,
                holder,
                request_id,
                amounts.concurrency,
                amounts.input_tokens,
                amounts.output_tokens,
                amounts.kv_token_seconds,
            ),
        )
        retry = int(retry_ms)
        return ChargeResult(
            bool(granted),
            as_text(reason),
            None if retry < 0 else retry / 1000,
        )

    async def release(self, holder: str, request_id: str, used: Amounts | None = None) -> bool:
        """Return a charge. With `used`, rate tokens charged beyond it are refunded (a
        request charged for max_tokens that stopped early). False if nothing was held."""
        check_name("request id", request_id)
        spent = (-1, -1, -1) if used is None else (
            used.input_tokens, used.output_tokens, used.kv_token_seconds
        )  # fmt: skip
        done = await _RELEASE(
            self.redis,
            (
                self.keys.quotas,
                self.keys.usage,
                self.keys.classes,
                self.keys.charges,
                self.keys.held_by(holder),
            ),
            (holder, request_id, *spent),
        )
        return bool(done)

    async def held(self, holder: str) -> frozenset[str]:
        """The request ids `holder` has charges for (what it reconciles against the
        requests it really has in flight)."""
        members = await self.redis.smembers(self.keys.held_by(holder))
        return frozenset(as_text(member) for member in members)

    async def reap_holders(self) -> dict[str, int]:
        """Return the charges of every holder whose lease lapsed: {holder: charges}."""
        now_ms = await server_time_ms(self.redis, self.keys.holders)
        expired = await self.redis.zrangebyscore(self.keys.holders, "-inf", now_ms)
        reaped = {}
        for raw in expired:
            holder = as_text(raw)
            n = await _REAP(
                self.redis,
                self._charge_keys(holder),
                (holder,),
            )
            if int(n) >= 0:
                reaped[holder] = int(n)
        return reaped

    async def tenants(self) -> frozenset[str]:
        """The tenants that have a quota: requests of any other tenant are not charged."""
        return frozenset(as_text(name) for name in await self.redis.hkeys(self.keys.quotas))

    async def usage(self, tenant: str) -> TenantUsage:
        """Concurrency in use and what each rate bucket held after the tenant's last charge
        or refund (not refilled since: a stable reading of what charges consumed)."""
        check_name("tenant", tenant)
        quota = await self.get_quota(tenant)
        fields = [f"{tenant}:{d}" for d in ("c", "i", "o", "k")]
        conc, i, o, k = await self.redis.hmget(self.keys.usage, fields)
        full = (
            (0, 0, 0)
            if quota is None
            else (quota.input_tokens_per_min, quota.output_tokens_per_min,
                  quota.kv_token_seconds_per_min)
        )  # fmt: skip
        return TenantUsage(
            int(conc or 0),
            float(i) if i is not None else float(full[0]),
            float(o) if o is not None else float(full[1]),
            float(k) if k is not None else float(full[2]),
        )
