"""Tenant quotas at the router: the one Redis round trip on the hot path.

The router charges what it knows at admission — one unit of concurrency, the prompt's
input tokens and the request's output-token limit — atomically in the control plane, so
every router replica sharing the Redis sees the same budget; the sidecar charges the KV it
reserves. When the request ends the charge is released with what it really used, so
unused output tokens flow back. Charges belong to this router's holder lease: if the
router dies, the control plane returns them once the lease lapses.

Refusals: 429 `overload` with the exhausted limit as reason and a Retry-After; 403 for a
tenant with no quota; 400 for a request larger than a whole minute's allowance (waiting
cannot help); 503 when the control plane cannot be reached (capacity fails closed), or
keeps losing this router's holder lease.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

from redis.exceptions import RedisError

from controlplane.contract import TenantQuota
from controlplane.router.errors import RouterError, bad_request, overload, unavailable
from controlplane.rules.quotas import quota_refusal
from controlplane.store import Amounts, QuotaHolder, QuotaStore

log = logging.getLogger(__name__)


class QuotaGate:
    """`policy`: the tenants' quotas this router enforces. It publishes them at start and
    again whenever the control plane has lost them (a Redis restarted without persistence
    answers `unknown_tenant` for a declared tenant).

    The router's charges are kept by a `QuotaHolder`: a release Redis does not take (an
    outage, a failover) waits in its outbox, and `keep_lease` sends it again, and
    reconciles the store's charges with the requests in flight, once Redis answers."""

    def __init__(
        self, store: QuotaStore, policy: Sequence[TenantQuota] = (), lease_ttl_s: float = 15.0
    ) -> None:
        self.store = store
        self.policy = {quota.name: quota for quota in policy}
        self.holder = f"router-{uuid.uuid4().hex[:12]}"
        self.lease_ttl_s = lease_ttl_s
        self.book = QuotaHolder(store, self.holder, lease_ttl_s)
        self.tenants: set[str] = set()

    async def publish(self) -> None:
        """Write the policy's quotas. Every replica publishes the same policy; the last
        write wins, and charges already made stay."""
        for quota in self.policy.values():
            await self.store.set_quota(quota)

    async def keep_lease(self) -> None:
        """For as long as it runs: renew the holder lease, send the releases Redis did not
        take, reconcile after a failure, and return the charges of holders (other routers,
        sidecars) whose lease lapsed. Every third of the lease's time to live, or every
        second while releases wait."""
        while True:
            try:
                await self.book.renew()
                await self.book.settle()
                if reaped := await self.store.reap_holders():
                    log.info("returned the quota charges of lapsed holders: %s", reaped)
            except (RedisError, OSError) as exc:
                log.warning(
                    "quota holder %s: the control plane did not answer (%s)", self.holder, exc
                )
            period_s = self.lease_ttl_s / 3
            await asyncio.sleep(min(period_s, 1.0) if self.book.pending else period_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """At shutdown: one attempt, bounded by `timeout_s`, at the releases still waiting."""
        await self.book.close(timeout_s)

    async def charge(
        self, tenant: str, request_id: str, input_tokens: int, output_tokens: int
    ) -> None:
        amounts = Amounts(concurrency=1, input_tokens=input_tokens, output_tokens=output_tokens)
        republish = self.publish if tenant in self.policy else None
        try:
            result = await self.book.charge(tenant, request_id, amounts, republish)
        except (RedisError, OSError) as exc:
            self.book.forget(request_id)  # refused here; released by reconciling if it landed
            raise unavailable(
                "quota_unavailable", f"tenant quotas cannot be checked: {exc}"
            ) from exc
        self.tenants.add(tenant)
        if result.granted:
            return
        status, reason, retry_after_s = quota_refusal(result.reason, result.retry_after_s)
        if status == 403:
            raise RouterError(
                403, "permission_error", reason, f"tenant {tenant!r} has no quota here"
            )
        if status == 400:
            raise bad_request(
                reason,
                f"the request is larger than tenant {tenant!r}'s whole {result.reason} "
                "allowance per minute",
            )
        assert retry_after_s is not None  # a 429 or 503 always names its wait
        if status == 503:
            raise unavailable(
                reason, "the control plane lost this router's quota lease", retry_after_s
            )
        raise overload(
            reason,
            f"tenant {tenant!r} is over its {result.reason.replace('_', ' ')} quota",
            retry_after_s,
        )

    async def release(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        """Return the charge, keeping only what was used. A release Redis does not take
        now is sent again until it does (`keep_lease`): a release lost while this router
        keeps its lease would hold the tenant's slot for good."""
        used = Amounts(input_tokens=input_tokens, output_tokens=output_tokens)
        await self.book.release(request_id, used)

    async def utilization(self) -> dict[tuple[str, str], float]:
        """(tenant, resource) -> fraction of the quota in use, for the tenants seen."""
        ratios: dict[tuple[str, str], float] = {}
        for tenant in sorted(self.tenants):
            quota = await self.store.get_quota(tenant)
            if quota is None:
                continue
            usage = await self.store.usage(tenant)
            for resource, limit, left in (
                ("input_tokens", quota.input_tokens_per_min, usage.input_tokens_left),
                ("output_tokens", quota.output_tokens_per_min, usage.output_tokens_left),
            ):
                if limit:
                    ratios[tenant, resource] = max(0.0, 1.0 - left / limit)
            if quota.max_concurrency:
                ratios[tenant, "concurrency"] = usage.concurrency / quota.max_concurrency
        return ratios
