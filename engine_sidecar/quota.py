"""The sidecar's share of tenant quotas: KV token-seconds for what it reserves.

The router charges a tenant's concurrency and token rates; the sidecar charges the KV
dimension, under its own holder lease (renewed with every heartbeat, so a crashed
sidecar's charges are returned by the reaper). A request is charged once, before local
admission, for its estimated KV token-seconds — average KV held (prompt plus half the
predicted output) times the predicted decode time — and released when it leaves this
endpoint (finished, cancelled, refused, migrated away), reporting what it really used so
an early finish is refunded. Recompute in place keeps the charge: the request stays here.

A tenant the quota store does not know is not charged (the router enforces tenancy). The
tenants that have a quota are read with every heartbeat, so a request of any other tenant
reaches the engine without a Redis round trip; a quota set meanwhile applies from the next
heartbeat.

A charge Redis does not answer does not block admission: soft on control. The KV itself
is guarded by local admission, which fails closed, and the router has already charged the
request's concurrency and token rates (failing closed there). The KV quota is a tenant's
share over time, so a request admitted without it costs a tenant's fairness, not the
pool's capacity. Such a charge is logged and counted
(`weir_sidecar_kv_quota_charges_total{result="unavailable"}`), never skipped silently, and
the request is released when it leaves as if charged: the charge may have landed.

Releases and reconciliation are the `QuotaHolder`'s (shared with the router): a release
Redis does not take waits in its outbox and is sent again with every heartbeat.
"""

from __future__ import annotations

import logging
import math
import time

from redis.exceptions import RedisError

from controlplane.store import Amounts, QuotaHolder, QuotaStore
from engine_sidecar.ledger import Flight, Ledger
from engine_sidecar.metrics import SidecarMetrics

log = logging.getLogger("weir.sidecar.quota")


class KVQuota:
    def __init__(
        self,
        store: QuotaStore,
        ledger: Ledger,
        holder: str,
        ttl_s: float,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.holder = holder
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.book = QuotaHolder(store, holder, ttl_s)
        if metrics is not None:
            metrics.watch_quota(self.book)
        self._charged: dict[str, float] = {}  # rid → wall time of the charge
        # Tenants with a quota as of the last heartbeat; None until read: charge everyone.
        self._tenants: frozenset[str] | None = None

    async def renew(self) -> None:
        await self.book.renew()

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
            result = await self.book.charge(flight.record.tenant, flight.rid, amounts)
        except (RedisError, OSError) as exc:
            # Admitted on local admission alone (see the module's docstring); released
            # when it leaves, as the charge may have landed.
            self._charged[flight.rid] = time.time()
            self._count("unavailable")
            log.warning("quota charge for %s not made, admitted without it: %s", flight.rid, exc)
            return None
        if result.granted:
            self._charged[flight.rid] = time.time()
            self._count("granted")
            return None
        if result.reason == "unknown_tenant":
            return None
        self._count("refused")
        return max(1, math.ceil(result.retry_after_s or 60))

    async def release(self, flight: Flight) -> None:
        charged_at = self._charged.pop(flight.rid, None)
        if charged_at is None:
            return
        rec = flight.record
        held_s = max(0.0, time.time() - charged_at)
        used = math.ceil((rec.prompt_tokens + rec.generated_tokens / 2) * held_s)
        await self.book.release(flight.rid, Amounts(kv_token_seconds=used))

    async def retry_releases(self) -> None:
        """Send the releases not yet taken, and reconcile after a failure (called again
        with every heartbeat; a Redis still unreachable leaves them for the next one)."""
        try:
            await self.book.settle()
        except (RedisError, OSError) as exc:
            log.warning("%d quota releases wait for Redis: %s", self.book.pending, exc)

    async def close(self, timeout_s: float) -> None:
        """At shutdown: one attempt, bounded by `timeout_s`, at the releases still waiting."""
        await self.book.close(timeout_s)

    @property
    def held(self) -> int:
        """Charges this sidecar still holds or still has to return."""
        return len(self._charged) + self.book.pending

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.count("weir_sidecar_kv_quota_charges_total", result)
