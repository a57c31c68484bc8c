"""The sidecar's share of tenant quotas: KV token-seconds for what it reserves.

The router charges a tenant's concurrency and token rates; the sidecar charges the KV
dimension, under its own holder lease (renewed with every heartbeat, so a crashed
sidecar's charges are returned by the reaper). A request is charged once, before local
admission, for its estimated KV token-seconds — average KV held (prompt plus half the
predicted output) times the predicted decode time — and released when it leaves this
endpoint (finished, cancelled, refused, migrated away), reporting what it really used so
an early finish is refunded. Recompute in place keeps the charge: the request stays here.

A tenant the quota store does not know is not charged (the router enforces tenancy), and
an unreachable Redis does not block admission (soft on control). The tenants that have a
quota are read with every heartbeat, so a request of any other tenant reaches the engine
without a Redis round trip; a quota set meanwhile applies from the next heartbeat.
"""

from __future__ import annotations

import logging
import math
import time

from redis.exceptions import RedisError

from controlplane.store.quotas import Amounts, QuotaStore
from engine_sidecar.ledger import Flight, Ledger

log = logging.getLogger("weir.sidecar.quota")


class KVQuota:
    def __init__(self, store: QuotaStore, ledger: Ledger, holder: str, ttl_s: float) -> None:
        self.store = store
        self.ledger = ledger
        self.holder = holder
        self.ttl_s = ttl_s
        self._charged: dict[str, float] = {}  # rid → wall time of the charge
        self._unreleased: dict[str, Amounts] = {}  # releases Redis did not take yet
        # Tenants with a quota as of the last heartbeat; None until read: charge everyone.
        self._tenants: frozenset[str] | None = None

    async def renew(self) -> None:
        await self.store.renew_holder(self.holder, self.ttl_s)

    async def refresh_tenants(self) -> None:
        self._tenants = await self.store.tenants()

    def charges(self, tenant: str) -> bool:
        """Whether `tenant`'s requests are charged: it has a quota, or none are read yet."""
        return self._tenants is None or tenant in self._tenants

    def holds(self, flight: Flight) -> bool:
        """A charge for `flight` is held (its release has something to return)."""
        return flight.rid in self._charged

    def estimate(self, flight: Flight) -> int:
        rec = flight.record
        predicted = self.ledger.predict(flight)
        average_kv = rec.prompt_tokens + predicted / 2
        return max(1, math.ceil(average_kv * predicted * self.ledger.tpot_s))

    async def charge(self, flight: Flight) -> int | None:
        """None when granted (or not applicable); else the Retry-After in seconds."""
        if not self.charges(flight.record.tenant):
            return None
        amounts = Amounts(kv_token_seconds=self.estimate(flight))
        try:
            result = await self.store.charge(flight.record.tenant, self.holder, flight.rid, amounts)
            if result.reason == "holder_expired":
                await self.renew()
                result = await self.store.charge(
                    flight.record.tenant, self.holder, flight.rid, amounts
                )
        except (RedisError, OSError) as exc:
            log.warning("quota charge for %s not made: %s", flight.rid, exc)
            return None
        if result.granted:
            self._charged[flight.rid] = time.time()
            return None
        if result.reason == "unknown_tenant":
            return None
        return max(1, math.ceil(result.retry_after_s or 60))

    async def release(self, flight: Flight) -> None:
        charged_at = self._charged.pop(flight.rid, None)
        if charged_at is None:
            return
        rec = flight.record
        held_s = max(0.0, time.time() - charged_at)
        used = math.ceil((rec.prompt_tokens + rec.generated_tokens / 2) * held_s)
        self._unreleased[flight.rid] = Amounts(kv_token_seconds=used)
        await self.retry_releases()

    async def retry_releases(self) -> None:
        """Send the releases not yet taken (called again with every heartbeat)."""
        for rid, used in list(self._unreleased.items()):
            try:
                await self.store.release(self.holder, rid, used)
            except (RedisError, OSError) as exc:
                log.warning("quota release for %s failed (will retry): %s", rid, exc)
                return
            self._unreleased.pop(rid, None)

    @property
    def held(self) -> int:
        """Charges this sidecar still holds or still has to return."""
        return len(self._charged) + len(self._unreleased)
