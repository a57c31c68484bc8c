"""Tenant quotas at the router: the one Redis round trip on the hot path.

The router charges what it knows at admission — one unit of concurrency, the prompt's
input tokens and the request's output-token limit — atomically in the control plane, so
every router replica sharing the Redis sees the same budget; the sidecar charges the KV it
reserves. When the request ends the charge is released with what it really used, so
unused output tokens flow back. Charges belong to this router's holder lease: if the
router dies, the control plane returns them once the lease lapses.

Refusals: 429 `overload` with the exhausted limit as reason and a Retry-After; 403 for a
tenant with no quota; 400 for a request larger than a whole minute's allowance (waiting
cannot help); 503 when the control plane cannot be reached (capacity fails closed).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

from redis.exceptions import RedisError

from controlplane.contract import TenantQuota
from controlplane.contract.quota_rules import quota_refusal
from controlplane.gateway.errors import GatewayError, bad_request, overload, unavailable
from controlplane.store import Amounts, QuotaStore

log = logging.getLogger(__name__)


class QuotaGate:
    """`policy`: the tenants' quotas this router enforces. It publishes them at start and
    again whenever the control plane has lost them (a Redis restarted without persistence
    answers `unknown_tenant` for a declared tenant)."""

    def __init__(
        self, store: QuotaStore, policy: Sequence[TenantQuota] = (), lease_ttl_s: float = 15.0
    ) -> None:
        self.store = store
        self.policy = {quota.name: quota for quota in policy}
        self.holder = f"router-{uuid.uuid4().hex[:12]}"
        self.lease_ttl_s = lease_ttl_s
        self.tenants: set[str] = set()

    async def publish(self) -> None:
        """Write the policy's quotas. Every replica publishes the same policy; the last
        write wins, and charges already made stay."""
        for quota in self.policy.values():
            await self.store.set_quota(quota)

    async def keep_lease(self) -> None:
        """Renew the holder lease at a third of its time to live, for as long as it runs,
        and return the charges of holders (other routers, sidecars) whose lease lapsed."""
        while True:
            try:
                await self.store.renew_holder(self.holder, self.lease_ttl_s)
                if reaped := await self.store.reap_holders():
                    log.info("returned the quota charges of lapsed holders: %s", reaped)
            except (RedisError, OSError) as exc:
                log.warning("quota holder %s: cannot renew its lease (%s)", self.holder, exc)
            await asyncio.sleep(self.lease_ttl_s / 3)

    async def charge(
        self, tenant: str, request_id: str, input_tokens: int, output_tokens: int
    ) -> None:
        amounts = Amounts(concurrency=1, input_tokens=input_tokens, output_tokens=output_tokens)
        try:
            result = await self.store.charge(tenant, self.holder, request_id, amounts)
            # After Redis lost its data: the holder lease, or the quotas themselves.
            if result.reason == "holder_expired":
                await self.store.renew_holder(self.holder, self.lease_ttl_s)
                result = await self.store.charge(tenant, self.holder, request_id, amounts)
            elif result.reason == "unknown_tenant" and tenant in self.policy:
                log.warning("the control plane lost tenant quotas; publishing them again")
                await self.publish()
                result = await self.store.charge(tenant, self.holder, request_id, amounts)
        except (RedisError, OSError) as exc:
            raise unavailable(
                "quota_unavailable", f"tenant quotas cannot be checked: {exc}"
            ) from exc
        self.tenants.add(tenant)
        if result.granted:
            return
        status, reason, retry_after_s = quota_refusal(result.reason, result.retry_after_s)
        if status == 403:
            raise GatewayError(
                403, "permission_error", reason, f"tenant {tenant!r} has no quota here"
            )
        if status == 400:
            raise bad_request(
                reason,
                f"the request is larger than tenant {tenant!r}'s whole {result.reason} "
                "allowance per minute",
            )
        assert retry_after_s is not None  # a 429 always names its wait
        raise overload(
            reason,
            f"tenant {tenant!r} is over its {result.reason.replace('_', ' ')} quota",
            retry_after_s,
        )

    async def release(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        """Return the charge, keeping only what was used; retried with backoff, because a
        release lost while this router keeps its lease would hold the tenant's slot."""
        used = Amounts(input_tokens=input_tokens, output_tokens=output_tokens)
        for delay_s in (0.1, 0.5, 2.0, None):
            try:
                await self.store.release(self.holder, request_id, used)
                return
            except (RedisError, OSError) as exc:
                if delay_s is None:
                    log.warning("quota release of %s failed for good: %s", request_id, exc)
                    return
                await asyncio.sleep(delay_s)

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
