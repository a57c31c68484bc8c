"""A small real fleet for router tests: reference engines served in-process, registered
as endpoints in a real Redis through the control plane's registry, and a router following
the pool's change feed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest

from controlplane.contract import EndpointState, Role, RoutingPolicy
from controlplane.router import (
    RequestLimits,
    RouterConfig,
    RunningRouter,
    TenantKeys,
    serve_router,
)
from controlplane.store import EndpointRegistry, RedisSettings, connect
from fleetsim.engine import EngineConfig
from fleetsim.engine.config import DisaggregationMode
from fleetsim.server import RunningEngine, serve_engine
from tests.polling import until

MODEL = "ref-model"
POOL = "router-test"


@dataclass
class Fleet:
    registry: EndpointRegistry
    engines: dict[str, RunningEngine]
    states: dict[str, EndpointState]
    router: RunningRouter
    stack: contextlib.AsyncExitStack = field(repr=False)

    @property
    def url(self) -> str:
        return self.router.url

    async def report(self, endpoint_id: str, ttl_s: float = 30.0, **fields: object) -> None:
        """Heartbeat new state for an endpoint and wait until the router sees it."""
        state = self.states[endpoint_id]
        state = msgspec.structs.replace(state, version=state.version + 1, **fields)
        await self.registry.heartbeat(state, ttl_s)
        self.states[endpoint_id] = state
        await until(
            lambda: self._seen(endpoint_id, state.version), "the router to see the heartbeat"
        )

    def _seen(self, endpoint_id: str, version: int) -> bool:
        view = self.router.router.view.snapshot.by_id.get(endpoint_id)
        return view is not None and view.state.version >= version


@contextlib.asynccontextmanager
async def make_fleet(
    redis_url: str,
    engines: int = 3,
    *,
    ttl_s: float = 30.0,
    speed_factor: float = 20.0,
    routing: RoutingPolicy | None = None,
    pool: str = POOL,
    keys: TenantKeys | None = None,
    role: Role = Role.MIXED,
    engine: dict[str, object] | None = None,
    **router_config: object,
) -> AsyncIterator[Fleet]:
    """`engines` reference engines, each its own endpoint of `pool` (no sidecars): P/D
    pools' engines serve their half (`--disaggregation-mode` by `role`); `engine` changes
    their launch config."""
    modes: dict[Role, DisaggregationMode] = {Role.PREFILL: "prefill", Role.DECODE: "decode"}
    launch = EngineConfig(
        model=MODEL, max_total_tokens=200_000, speed_factor=speed_factor,
        disaggregation_mode=modes.get(role, "null"), disaggregation_bootstrap_port=0,
    ).replace(**(engine or {}))  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        redis = connect(RedisSettings(url=redis_url, retries=1, command_timeout_s=2.0))
        stack.push_async_callback(redis.aclose)
        registry = EndpointRegistry(redis, pool)
        running: dict[str, RunningEngine] = {}
        states: dict[str, EndpointState] = {}
        for i in range(engines):
            served = await stack.enter_async_context(serve_engine(launch))
            endpoint_id = f"e{i}"
            running[endpoint_id] = served
            state = EndpointState(
                pool=pool,
                endpoint_id=endpoint_id,
                address=served.url,
                model=MODEL,
                role=role,
                bootstrap_port=served.server.bootstrap_port if role is Role.PREFILL else 0,
                kv_capacity_tokens=launch.total_tokens,
            )
            states[endpoint_id] = await registry.register(state, ttl_s)
        config = RouterConfig(
            pool=pool,
            model=MODEL,
            routing=routing or RoutingPolicy(),
            limits=RequestLimits(),
            role=role,
            **router_config,  # type: ignore[arg-type]
        )
        router = await serve_router(config, redis_url=redis_url, keys=keys)
        stack.push_async_callback(router.close)
        fleet = Fleet(registry, running, states, router, stack)
        await until(
            lambda: len(router.router.view.snapshot.endpoints) == engines,
            "the router to see every endpoint",
        )
        yield fleet


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[Fleet]:
    async with make_fleet(redis_url) as running:
        yield running
