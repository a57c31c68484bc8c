"""Running a router: the aiohttp server, and the feed that keeps its pool view current."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from controlplane.contract import Role
from controlplane.router.app import Router
from controlplane.router.config import RouterConfig
from controlplane.router.credits import HandoffGate, publish_budget
from controlplane.router.pool import PoolView, RingOwners, StoreFeed, static_endpoints
from controlplane.router.quotas import QuotaGate
from controlplane.router.tenants import TenantKeys
from controlplane.store import (
    CreditStore,
    EndpointRegistry,
    PoolFollower,
    QuotaStore,
    RedisClient,
    RedisSettings,
    cancel_loops,
    connect,
    reap_forever,
)


@dataclass
class RunningRouter:
    router: Router
    url: str
    _runner: web.AppRunner
    _tasks: list[asyncio.Task[None]]
    _redis: RedisClient | None

    async def close(self) -> None:
        await cancel_loops(self._tasks)
        await self._runner.cleanup()  # ends requests, and waits for their quota releases
        if self.router.quotas is not None:
            await self.router.quotas.close()  # bounded, even with Redis down
        if self._redis is not None:
            await self._redis.aclose()


async def serve_router(
    config: RouterConfig,
    *,
    redis_url: str = "",
    endpoints: Sequence[str] = (),
    keys: TenantKeys | None = None,
) -> RunningRouter:
    """Start a router on `config.host:config.port` (0: a free port) for the pool in the
    control plane at `redis_url`, or for the fixed engine URLs `endpoints`."""
    if bool(redis_url) == bool(endpoints):
        raise ValueError("give exactly one of redis_url (the control plane) or endpoints")
    clock = time.monotonic
    redis: RedisClient | None = None
    feed: StoreFeed | None = None
    quotas: QuotaGate | None = None
    tasks: list[asyncio.Task[None]] = []
    credits: HandoffGate | None = None
    decode_view: PoolView | None = None
    decode_feed: StoreFeed | None = None
    handoff = config.handoff
    if (config.quotas.enforce or config.role is Role.PREFILL) and not redis_url:
        raise ValueError("quotas and handoff credits live in the control plane: give redis_url")
    if endpoints:
        view = PoolView(config.pool, math.inf)
        view.update(static_endpoints(config.pool, config.model, endpoints), clock())
    else:
        view = PoolView(config.pool, config.routing.snapshot_staleness_s)
        redis = connect(RedisSettings.from_url(redis_url, client_name="weir-router"))
        owners = RingOwners(config.routing.virtual_nodes)
        feed = StoreFeed(PoolFollower(EndpointRegistry(redis, config.pool)), view, clock,
                         owners_for=owners)  # fmt: skip
        if config.quotas.enforce:
            quotas = QuotaGate(QuotaStore(redis, config.pool), config.quotas.tenants)
            await quotas.publish()
            await quotas.store.renew_holder(quotas.holder, quotas.lease_ttl_s)
        if config.role is Role.PREFILL:
            # The decode pool keeps the budget; its name is the credit class. Its
            # endpoints are this router's too: each request's decode leg goes to one.
            credits = HandoffGate(
                CreditStore(redis, handoff.decode_pool), handoff.decode_pool,
                handoff.kv_bytes_per_token, handoff.credit_ttl_s,
            )  # fmt: skip
            decode_view = PoolView(handoff.decode_pool, config.routing.snapshot_staleness_s)
            decode_feed = StoreFeed(
                PoolFollower(EndpointRegistry(redis, handoff.decode_pool)), decode_view, clock
            )
    router = Router(config, view, keys, clock, quotas, credits, decode_view)
    runner = web.AppRunner(
        router.app(),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=router.guard.limits.idle_timeout_s,
    )
    await runner.setup()
    await router.guard.start(runner, host=config.host, port=config.port)
    port = runner.addresses[0][1]
    loop = asyncio.get_running_loop()
    if feed is not None:
        tasks.append(loop.create_task(feed.run()))
        # Any number of reapers may run; each router's keeps leases honest without an
        # operator (a local fleet), and the feed then reports the removals.
        tasks.append(loop.create_task(reap_forever(feed.follower.registry, 1.0)))
    if decode_feed is not None:
        tasks.append(loop.create_task(decode_feed.run()))
    if quotas is not None:
        tasks.append(loop.create_task(quotas.keep_lease()))
    if redis is not None and config.role is Role.DECODE:
        budget = publish_budget(
            CreditStore(redis, config.pool), view, clock, handoff.kv, handoff.kv_bytes_per_token
        )
        tasks.append(loop.create_task(budget))
    return RunningRouter(router, f"http://{config.host}:{port}", runner, tasks, redis)
