"""The router in front of real sidecars: a sidecar that migrates a request ends its stream
with `weir.preempted`, and the router resumes it on another endpoint, spliced into the
client's stream with exactly the tokens of an uninterrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from controlplane.router import RouterConfig, TenantKeys, serve_router
from engine_sidecar.server import SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import serve_engine
from tests.polling import until
from tests.router.conftest import MODEL

pytestmark = pytest.mark.redis
POOL = "sidecar-test"
AUTH = {"Authorization": "Bearer sk-team-a"}


async def test_a_migrated_request_resumes_elsewhere_with_the_same_tokens(redis_url: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        sidecars = {}
        for i in range(2):
            engine = await stack.enter_async_context(
                serve_engine(EngineConfig(model=MODEL, max_total_tokens=200_000, speed_factor=2))
            )
            sidecars[f"s{i}"] = await stack.enter_async_context(
                serve_sidecar(
                    SidecarConfig(
                        engine_url=engine.url, redis_url=redis_url, pool=POOL,
                        endpoint_id=f"s{i}", heartbeat_s=0.2, lease_ttl_s=5.0,
                    )
                )
            )  # fmt: skip
        running = await serve_router(
            RouterConfig(pool=POOL, model=MODEL),
            redis_url=redis_url,
            keys=TenantKeys({"sk-team-a": "team-a"}),
        )
        stack.push_async_callback(running.close)
        router = running.router
        await until(lambda: len(router.view.snapshot.endpoints) == 2, "both sidecars")

        body = {
            "model": MODEL, "prompt": "The weir keeper said: ", "stream": True,
            "max_tokens": 120, "ignore_eos": True,
        }  # fmt: skip
        async with aiohttp.ClientSession() as session:
            async with session.post(sidecars["s1"].url + "/v1/completions", json=body) as reply:
                direct = _text([ln async for ln in reply.content])
            async with session.post(
                running.url + "/v1/completions", json=body, headers=AUTH
            ) as reply:
                assert reply.status == 200
                serving = reply.headers["x-weir-endpoint"]
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
