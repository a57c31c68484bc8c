"""Tenant-quota decisions as pure Python: what `lua/quota_charge.lua`, `quota_release.lua`,
`holder_renew.lua` and `holder_reap.lua` decide in Redis, on a caller's clock.

The control plane charges quotas atomically in Lua (`controlplane.store.quotas`); the
fleet simulator needs the same decisions without a Redis. `QuotaLedger` holds what the
scripts keep in the pool's hashes — limits, concurrency in use per tenant and per priority
class, one token bucket per rate (levels stored as Lua's `tostring` writes them: 14
significant digits), the charges by (holder, request) and the holders' leases — and
applies the scripts' rules in the scripts' order, so it refuses for the same reason with
the same Retry-After and leaves the same balances. `tests/controlplane/
test_quota_rules_differential.py` drives both with the same random sequences.

Times are server milliseconds (integers), as in the scripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from controlplane.contract.models import TenantQuota

RATES = ("input_tokens", "output_tokens", "kv_token_seconds")
_MINUTE_MS: Final = 60_000
# Retry-After of a concurrency or class-capacity refusal: a slot may free any moment.
_SLOT_RETRY_MS: Final = 1000


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    """`reason` names the limit that refused ('' or 'duplicate' when granted);
    `retry_after_ms` is -1 when waiting cannot help (the scripts' convention)."""

    granted: bool
    reason: str
    retry_after_ms: int

    @property
    def retry_after_s(self) -> float | None:
        return None if self.retry_after_ms < 0 else self.retry_after_ms / 1000


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's charge: the amounts as charged (0: a dimension not charged)."""

    tenant: str
    priority_class: str
    concurrency: int
    input_tokens: int
    output_tokens: int
    kv_token_seconds: int

    @property
    def rates(self) -> tuple[int, int, int]:
        return (self.input_tokens, self.output_tokens, self.kv_token_seconds)


def _lua_number(value: float) -> float:
    """What a number becomes after Lua 5.1's `tostring` ("%.14g") and `tonumber`."""
    return float(f"{value:.14g}")


@dataclass(slots=True)
class _Bucket:
    level: float
    since_ms: int


@dataclass
class QuotaLedger:
    """One pool's quota state and the scripts' decisions over it."""

    quotas: dict[str, TenantQuota] = field(default_factory=dict)
    capacity: int = 0
    reserved_fraction: dict[str, float] = field(default_factory=dict)
    class_in_use: dict[str, int] = field(default_factory=dict)
    concurrency: dict[str, int] = field(default_factory=dict)
    buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    charges: dict[tuple[str, str], Charge] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)

    # -- configuration (QuotaStore.set_quota / set_capacity) ------------------------------
    def set_quota(self, quota: TenantQuota) -> None:
        """A tenant's limits; its class's reserved fraction is the last one set."""
        self.quotas[quota.name] = quota
        self.reserved_fraction[quota.priority_class] = float(quota.reserved_fraction)

    def set_capacity(self, concurrency: int) -> None:
        self.capacity = concurrency

    # -- holders ----------------------------------------------------------------------
    def renew(self, holder: str, ttl_ms: int, now_ms: int) -> int:
        """Start or renew a holder's lease; returns its expiry."""
        self.leases[holder] = now_ms + ttl_ms
        return self.leases[holder]

    def reap(self, now_ms: int) -> dict[str, int]:
        """Return the charges of every holder whose lease lapsed: {holder: charges}.
        Rate tokens stay spent."""
        reaped = {}
        for holder in sorted(h for h, lease in self.leases.items() if lease <= now_ms):
            held = [key for key in self.charges if key[0] == holder]
            for key in held:
                self._settle(self.charges.pop(key), None, now_ms)
            del self.leases[holder]
            reaped[holder] = len(held)
        return reaped

    # -- charges ----------------------------------------------------------------------
    def charge(
        self,
        tenant: str,
        holder: str,
        request_id: str,
        now_ms: int,
        *,
        concurrency: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        kv_token_seconds: int = 0,
    ) -> QuotaDecision:
        """All dimensions at once or none; idempotent per (holder, request id)."""
        key = (holder, request_id)
        if key in self.charges:
            return QuotaDecision(True, "duplicate", 0)
        quota = self.quotas.get(tenant)
        if quota is None:
            return QuotaDecision(False, "unknown_tenant", -1)
        if self.leases.get(holder, 0) <= now_ms:
            return QuotaDecision(False, "holder_expired", -1)
        klass = quota.priority_class
        if concurrency > 0:
            refusal = self._slot_refusal(quota, concurrency)
            if refusal:
                return QuotaDecision(False, refusal, _SLOT_RETRY_MS)
        amounts = (input_tokens, output_tokens, kv_token_seconds)
        levels: dict[int, float] = {}
        for j, (name, limit) in enumerate(zip(RATES, _limits(quota), strict=True)):
            if limit > 0 and amounts[j] > 0:
                if amounts[j] > limit:
                    return QuotaDecision(False, name, -1)
                levels[j] = self._level(tenant, name, limit, now_ms)
                if levels[j] < amounts[j]:
                    wait = math.ceil((amounts[j] - levels[j]) * _MINUTE_MS / limit)
                    return QuotaDecision(False, name, wait)
        for j, level in levels.items():
            self.buckets[tenant, RATES[j]] = _Bucket(_lua_number(level - amounts[j]), now_ms)
        if concurrency > 0:
            self.concurrency[tenant] = self.concurrency.get(tenant, 0) + concurrency
            self.class_in_use[klass] = self.class_in_use.get(klass, 0) + concurrency
        self.charges[key] = Charge(tenant, klass, concurrency, *amounts)
        return QuotaDecision(True, "", 0)

    def release(
        self, holder: str, request_id: str, now_ms: int, used: tuple[int, int, int] | None = None
    ) -> bool:
        """Return a charge; with `used` (input, output, KV token-seconds really spent), rate
        tokens charged beyond it are refunded. False if nothing was held."""
        charge = self.charges.pop((holder, request_id), None)
        if charge is None:
            return False
        self._settle(charge, used, now_ms)
        return True

    # -- reading ------------------------------------------------------------------------
    def bucket_left(self, tenant: str, rate: str) -> float:
        """The bucket as its tenant's last charge or refund left it (not refilled since),
        full when never touched: what `QuotaStore.usage` reads."""
        bucket = self.buckets.get((tenant, rate))
        if bucket is not None:
            return bucket.level
        quota = self.quotas.get(tenant)
        return float(_limits(quota)[RATES.index(rate)]) if quota else 0.0

    # -- the scripts' helpers -------------------------------------------------------------
    def _slot_refusal(self, quota: TenantQuota, concurrency: int) -> str:
        used = self.concurrency.get(quota.name, 0)
        if quota.max_concurrency > 0 and used + concurrency > quota.max_concurrency:
            return "concurrency"
        cap = self.capacity
        if cap <= 0:
            return ""
        # Each class first fills its reserved slots, then the shared remainder.
        reserved = {c: math.floor(f * cap) for c, f in self.reserved_fraction.items()}
        shared_used = sum(max(0, u - reserved.get(c, 0)) for c, u in self.class_in_use.items())
        mine = self.class_in_use.get(quota.priority_class, 0)
        mine_reserved = reserved.get(quota.priority_class, 0)
        extra = max(0, mine + concurrency - mine_reserved) - max(0, mine - mine_reserved)
        if shared_used + extra > cap - sum(reserved.values()):
            return "class_capacity"
        return ""

    def _level(self, tenant: str, rate: str, limit: int, now_ms: int) -> float:
        bucket = self.buckets.get((tenant, rate))
        level, since = (bucket.level, bucket.since_ms) if bucket else (float(limit), now_ms)
        return min(limit, level + (now_ms - since) * limit / _MINUTE_MS)

    def _settle(self, charge: Charge, used: tuple[int, int, int] | None, now_ms: int) -> None:
        if charge.concurrency > 0:
            self.concurrency[charge.tenant] -= charge.concurrency
            self.class_in_use[charge.priority_class] -= charge.concurrency
        quota = self.quotas.get(charge.tenant)
        if used is None or quota is None:
            return
        for rate, limit, charged, spent in zip(
            RATES, _limits(quota), charge.rates, used, strict=True
        ):
            refund = charged - spent
            if limit > 0 and refund > 0:
                level = min(limit, self._level(charge.tenant, rate, limit, now_ms) + refund)
                self.buckets[charge.tenant, rate] = _Bucket(_lua_number(level), now_ms)


def quota_refusal(reason: str, retry_after_s: float | None) -> tuple[int, str, float | None]:
    """How a router answers a refused charge: (HTTP status, reason, Retry-After). A tenant
    without a quota is forbidden; a request larger than a whole minute's allowance (no
    wait helps) is a bad request; a holder lease the control plane does not have (lost
    again after the router renewed it) is the control plane's state, not the request's:
    unavailable, retryable; anything else is an overload worth retrying."""
    if reason == "unknown_tenant":
        return 403, reason, None
    if reason == "holder_expired":
        return 503, "quota_unavailable", 1.0
    if retry_after_s is None:
        return 400, "exceeds_quota", None
    return 429, reason, retry_after_s


def _limits(quota: TenantQuota) -> tuple[int, int, int]:
    return (quota.input_tokens_per_min, quota.output_tokens_per_min, quota.kv_token_seconds_per_min)
