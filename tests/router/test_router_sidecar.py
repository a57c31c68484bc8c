"""The router in front of real sidecars: a sidecar that migrates a request ends its stream
with `weir.preempted`, and the router resumes it on another endpoint, spliced into the
client's stream with exactly the tokens of an uninterrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from controlplane.contract import CacheIdentity, PoolPolicy, PreemptionMode, SchedulingPolicy
from controlplane.ownership import block_hashes
from controlplane.router import RouterConfig, RunningRouter, TenantKeys, serve_router
from controlplane.routing import (
    PoolSnapshot,
    PrefixIndex,
    RouteRequest,
    RoutingContext,
    default_config,
    profile_from_config,
)
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import serve_engine
from tests.polling import until
from tests.router.conftest import MODEL

pytestmark = pytest.mark.redis
POOL = "sidecar-test"
AUTH = {"Authorization": "Bearer sk-team-a"}


async def _two_sidecars_and_a_router(
    stack: contextlib.AsyncExitStack,
    redis_url: str,
    engine: EngineConfig,
    policy: PoolPolicy | None = None,
) -> tuple[dict[str, RunningSidecar], RunningRouter]:
    """Sidecars s0 and s1, each in front of an engine of `engine`, and a router that
    sees both; all closed with `stack`."""
    sidecars = {}
    for i in range(2):
        running_engine = await stack.enter_async_context(serve_engine(engine))
        sidecars[f"s{i}"] = await stack.enter_async_context(
            serve_sidecar(
                SidecarConfig(
                    engine_url=running_engine.url, redis_url=redis_url, pool=POOL,
                    endpoint_id=f"s{i}", heartbeat_s=0.2, lease_ttl_s=5.0, policy=policy,
                )
            )
        )  # fmt: skip
    running = await serve_router(
        RouterConfig(pool=POOL, model=MODEL),
        redis_url=redis_url,
        keys=TenantKeys({"sk-team-a": "team-a"}),
    )
    stack.push_async_callback(running.close)
    view = running.router.view
    await until(lambda: len(view.snapshot.endpoints) == 2, "both sidecars")
    return sidecars, running


async def test_a_migrated_request_resumes_elsewhere_with_the_same_tokens(redis_url: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        sidecars, running = await _two_sidecars_and_a_router(
            stack, redis_url, EngineConfig(model=MODEL, max_total_tokens=200_000, speed_factor=2)
        )
        router = running.router

        body = {
            "model": MODEL, "prompt": "The weir keeper said: ", "stream": True,
            "max_tokens": 120, "ignore_eos": True,
        }  # fmt: skip
        async with aiohttp.ClientSession() as session:
            direct = await _direct(session, sidecars["s1"], body)
            async with _routed(session, running, body) as (reply, serving):
                lines = []
                async for line in reply.content:
                    lines.append(line)
                    if len(lines) == 10:
                        await _migrate(session, sidecars[serving].url)
        assert [line for line in lines if line.strip()][-1] == b"data: [DONE]\n"
        assert _text(lines) == direct
        assert len(direct) == 120
        resumed = router.metrics.registry.get_sample_value(
            "weir_router_resumes_total", {"pool": POOL, "reason": "preempted"}
        )
        assert resumed == 1


async def _migrate(session: aiohttp.ClientSession, sidecar_url: str) -> None:
    async with session.get(sidecar_url + "/weir/v1/state") as reply:
        requests = (await reply.json())["requests"]
    (rid,) = requests
    assert requests[rid]["tenant"] == "team-a"  # the API key's tenant reached the sidecar
    async with session.post(
        sidecar_url + "/weir/v1/preempt", json={"rid": rid, "mode": "migrate"}
    ) as reply:
        assert reply.status == 200, await reply.text()


@contextlib.asynccontextmanager
async def _routed(
    session: aiohttp.ClientSession, running: RunningRouter, body: dict[str, object]
) -> AsyncIterator[tuple[aiohttp.ClientResponse, str]]:
    """The streamed answer through the router, and the endpoint serving it."""
    async with session.post(running.url + "/v1/completions", json=body, headers=AUTH) as reply:
        assert reply.status == 200
        yield reply, reply.headers["x-weir-endpoint"]


async def _direct(
    session: aiohttp.ClientSession, sidecar: RunningSidecar, body: dict[str, object]
) -> str:
    """The answer straight from a sidecar, uninterrupted: what the router's must equal."""
    async with session.post(sidecar.url + "/v1/completions", json=body) as reply:
        return _text([ln async for ln in reply.content])


def _text(lines: list[bytes]) -> str:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


async def test_a_client_that_leaves_while_queued_at_the_sidecar_is_cancelled_there(
    redis_url: str,
) -> None:
    """A request waiting in the sidecar's local queue leaves it at once when its client
    leaves the router (by the closed connection and by the router's /abort_request)."""
    async with contextlib.AsyncExitStack() as stack:
        # KV for one such request, not for two prompts.
        config = EngineConfig(model=MODEL, max_total_tokens=3000, speed_factor=1)
        engine = await stack.enter_async_context(serve_engine(config))
        sidecar = await stack.enter_async_context(
            serve_sidecar(
                SidecarConfig(
                    engine_url=engine.url, redis_url=redis_url, pool=POOL, endpoint_id="s0",
                    heartbeat_s=0.2, lease_ttl_s=5.0,
                )
            )
        )  # fmt: skip
        running = await serve_router(RouterConfig(pool=POOL, model=MODEL), redis_url=redis_url)
        stack.push_async_callback(running.close)
        await until(lambda: len(running.router.view.snapshot.endpoints) == 1, "the sidecar")
        body = {
            "model": MODEL, "prompt": "The weir keeper said: " * 70, "stream": True,
            "max_tokens": 1000, "ignore_eos": True,
        }  # fmt: skip
        ledger = sidecar.service.ledger
        async with aiohttp.ClientSession() as session:
            first = await session.post(running.url + "/v1/completions", json=body)
            await first.content.readline()
            second = asyncio.create_task(session.post(running.url + "/v1/completions", json=body))
            await until(lambda: ledger.queued == 1, "the second request to queue")
            second.cancel()
            # It leaves; the first streams on.
            await until(lambda: (ledger.queued, len(ledger.flights)) == (0, 1),
                        "the queued request to leave", timeout_s=5.0)  # fmt: skip
            first.close()
        cancelled = sidecar.service.metrics.registry.get_sample_value(
            "weir_sidecar_requests_finished_total",
            {"pool": POOL, "endpoint": sidecar.service.metrics.endpoint, "reason": "cancelled"},
        )
        assert cancelled == 1


async def test_a_prompt_no_sidecar_can_ever_fit_reaches_the_client_as_400(redis_url: str) -> None:
    """The sidecar's permanent refusal (a prompt over its whole KV) passes through the
    router as it is — status and body — and is not retried on another endpoint."""
    async with contextlib.AsyncExitStack() as stack:
        sidecars = []
        for i in range(2):
            config = EngineConfig(model=MODEL, max_total_tokens=1000, context_length=8192)
            engine = await stack.enter_async_context(serve_engine(config))
            sidecars.append(
                await stack.enter_async_context(
                    serve_sidecar(
                        SidecarConfig(
                            engine_url=engine.url, redis_url=redis_url, pool=POOL,
                            endpoint_id=f"s{i}", heartbeat_s=0.2, lease_ttl_s=5.0,
                        )
                    )
                )
            )  # fmt: skip
        running = await serve_router(RouterConfig(pool=POOL, model=MODEL), redis_url=redis_url)
        stack.push_async_callback(running.close)
        await until(lambda: len(running.router.view.snapshot.endpoints) == 2, "both sidecars")
        async with aiohttp.ClientSession() as session:
            for stream in (True, False):
                body = {"model": MODEL, "prompt": [7] * 3000, "max_tokens": 8, "stream": stream}
                async with session.post(running.url + "/v1/completions", json=body) as reply:
                    assert reply.status == 400
                    assert "Retry-After" not in reply.headers
                    error = (await reply.json())["error"]
                assert error["reason"] == "too_large"
                assert "3000 tokens" in error["message"]
        refusals = [
            s.service.metrics.registry.get_sample_value(
                "weir_sidecar_admission_rejections_total",
                {"pool": POOL, "endpoint": s.service.metrics.endpoint, "reason": "too_large"},
            )
            for s in sidecars
        ]
        assert sum(refusals) == 2  # one sidecar asked per request, none retried


async def test_an_offloaded_request_s_host_pages_draw_its_continuation_back(
    redis_url: str,
) -> None:
    """The router keys the prompt for its sidecar; the sidecar that offloads the request
    publishes that key as held in its engine's host tier; a router that never placed the
    prompt (an empty prefix index: another replica's, or one restarted) then sends its
    continuation there over an equal endpoint without the pages. The stream, resumed
    from the host tier, ends whole with the tokens of an uninterrupted run."""
    policy = PoolPolicy(
        pool=POOL, model=MODEL,
        scheduling=SchedulingPolicy(preemption_modes=(PreemptionMode.OFFLOAD,)),
    )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        tiered = EngineConfig(
            model=MODEL, max_total_tokens=20_000, speed_factor=2, page_size=16,
            enable_hierarchical_cache=True,
        )  # fmt: skip
        sidecars, running = await _two_sidecars_and_a_router(stack, redis_url, tiered, policy)
        view = running.router.view

        prompt = "The weir keeper said: " * 20  # 440 bytes: six blocks of 64
        hashes = tuple(block_hashes(CacheIdentity(model=MODEL), prompt.encode(), 64))
        key = hashes[-1]
        body = {
            "model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 120,
            "ignore_eos": True,
        }  # fmt: skip
        async with aiohttp.ClientSession() as session:
            direct = await _direct(session, sidecars["s0"], body)
            async with _routed(session, running, body) as (reply, serving):
                service = sidecars[serving].service
                lines = [await reply.content.readline() for _ in range(10)]
                service.ledger.set_admission(False)  # its continuation waits meanwhile
                async with session.get(sidecars[serving].url + "/weir/v1/state") as state:
                    (rid,) = (await state.json())["requests"]
                async with session.post(
                    sidecars[serving].url + "/weir/v1/preempt",
                    json={"rid": rid, "mode": "offload"},
                ) as preempted:
                    assert preempted.status == 200, await preempted.text()

                def published() -> tuple[int, ...]:
                    return view.snapshot.by_id[serving].state.host_prefixes

                await until(lambda: published() == (key,), "the host pages' key published")
                # Against the other endpoint as it reports itself, and the same endpoint
                # but for the pages (the held continuation's load is not the router's
                # to weigh here).
                (other,) = (v.state for v in view.snapshot.endpoints if v.endpoint_id != serving)
                holder = msgspec.structs.replace(
                    other, endpoint_id=serving, host_prefixes=published()
                )
                snapshot = PoolSnapshot.of(POOL, [other, holder])
                continuation = RouteRequest(
                    request_id="resumed", model=MODEL, prompt_tokens=len(prompt) + 10,
                    max_new_tokens=110, block_hashes=hashes,
                )  # fmt: skip
                fresh = RoutingContext(snapshot, 0.0, prefix_index=PrefixIndex())
                decision = profile_from_config(default_config()).decide(continuation, fresh)
                assert decision.endpoint_id == serving
                service.ledger.set_admission(True)
                lines += [line async for line in reply.content]
        assert _text(lines) == direct
        assert len(direct) == 120
        await until(lambda: published() == (), "the pages back on the device")
