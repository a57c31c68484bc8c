"""A seeded, bounded chaos run over two engines and two sidecars: requests are added,
preempted and resumed (recomputed, or offloaded to the engines' host tier), cancelled,
migrated (the test plays the router), left to finish,
and one engine is killed and restarted mid-run. At the end nothing leaks — no KV in the
engines, no KV, reservation or queue entry in the sidecars — every request ended exactly
once, and every request that completed produced exactly the uninterrupted output."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.contract import PreemptionMode, SchedulingPolicy, TenantQuota, encode_json
from controlplane.store import PoolKeys, RedisSettings, connect
from controlplane.store.quotas import QuotaStore
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine, serve_engine, start_engine
from tests.sidecar.conftest import MODEL, engine_config, pool_policy
from tests.sidecar.streams import Received, read_sse

pytestmark = [pytest.mark.slow, pytest.mark.redis]

SEED = 20261130
REQUESTS = 36
# A host tier smaller than the pool, so that it evicts too.
CONFIG = engine_config(speed_factor=4.0, enable_hierarchical_cache=True, hicache_ratio=0.5)
POLICY = msgspec.structs.replace(
    pool_policy(),
    scheduling=SchedulingPolicy(preemption_modes=tuple(PreemptionMode)),
)


@dataclass
class Outcome:
    api: str
    body: dict[str, Any]
    action: str
    kind: str = ""  # completed | cancelled | refused | error
    text: str = ""
    posts: int = 0  # requests the sidecars saw for it (continuations count)


def _request(rng: random.Random, i: int) -> tuple[str, str, dict[str, Any]]:
    api = rng.choice(["generate", "chat", "completions"])
    max_new = rng.randint(30, 260)
    words = " ".join(rng.choice(["weir", "river", "flood", "gate", "lock"]) for _ in range(8))
    body: dict[str, Any]
    if api == "generate":
        body = {
            "text": f"{i} {words}",
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        }
        return api, "/generate", body
    if api == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i} {words}"}],
                "max_tokens": max_new, "ignore_eos": True}  # fmt: skip
        return api, "/v1/chat/completions", body
    body = {"model": MODEL, "prompt": f"{i} {words}", "max_tokens": max_new, "ignore_eos": True}
    return api, "/v1/completions", body


async def _client(
    http: aiohttp.ClientSession,
    rng: random.Random,
    i: int,
    sidecars: list[RunningSidecar],
) -> Outcome:
    api, path, body = _request(rng, i)
    action = rng.choices(["finish", "cancel", "recompute", "offload", "migrate"], [4, 2, 2, 2, 2])[
        0
    ]
    after = rng.randint(2, 25)
    home = rng.randrange(2)
    await asyncio.sleep(rng.uniform(0.0, 1.5))
    out = Outcome(api, body, action, posts=1)
    headers = {"x-weir-migratable": "1"} if action == "migrate" else {}
    resp = await http.post(sidecars[home].url + path, json=body | {"stream": True}, headers=headers)
    if resp.status in (429, 503):  # overload, or the engine is down: the router retries
        out.kind = "refused"
        resp.close()
        return out
    assert resp.status == 200, await resp.text()
    rid = resp.headers["x-weir-request-id"]
    got = await read_sse(resp, stop_after=after)
    if action == "cancel" and not got.done and got.continuation is None:
        resp.close()
        out.kind = "cancelled"
        return out
    if action in ("recompute", "offload", "migrate") and not got.done:
        async with http.post(
            sidecars[home].url + "/weir/v1/preempt", json={"rid": rid, "mode": action}
        ) as answer:
            assert answer.status in (200, 404, 409)
    events = list(got.events)
    while not got.done:
        got = await read_sse(resp)
        events += got.events
        if got.continuation is None:
            break
        # Play the router: resume on the other endpoint and splice the stream.
        resp.close()
        for _ in range(50):
            home = 1 - home
            out.posts += 1
            resp = await http.post(
                sidecars[home].url + "/weir/v1/continue", data=encode_json(got.continuation)
            )
            if resp.status not in (429, 503):
                break
            resp.close()
            await asyncio.sleep(0.1)  # Retry-After, shortened
        assert resp.status == 200, await resp.text()
    resp.close()
    stream = Received(events, got.done)
    if not got.done or (events and "error" in events[-1]):
        out.kind = "error"
        return out
    out.kind = "completed"
    out.text = stream.text()
    return out


async def _restart(engine: RunningEngine, delay_s: float) -> RunningEngine:
    await asyncio.sleep(delay_s)
    port = int(engine.url.rsplit(":", 1)[1])
    await engine.kill()
    await asyncio.sleep(0.2)
    return await start_engine(CONFIG, port=port)


def _counted(sidecar: RunningSidecar, name: str, mode: str = "") -> float:
    """A counter family's total (over the samples of `mode`, if given)."""
    text = sidecar.service.metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and mode in ("", s.labels.get("mode"))
            )
    return 0.0


async def test_seeded_chaos_leaks_nothing_and_ends_every_request_once(redis_url: str) -> None:
    rng = random.Random(SEED)
    redis = connect(RedisSettings(url=redis_url))
    await QuotaStore(redis, "p").set_quota(
        TenantQuota(name="default", kv_token_seconds_per_min=10**12)
    )
    engine_a = await start_engine(CONFIG)
    restarted: RunningEngine | None = None

    def config(engine: RunningEngine, endpoint: str) -> SidecarConfig:
        return SidecarConfig(
            engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id=endpoint,
            policy=POLICY, heartbeat_s=0.2,
        )  # fmt: skip

    try:
        async with (
            serve_engine(CONFIG) as engine_b,
            serve_sidecar(config(engine_a, "a")) as sa,
            serve_sidecar(config(engine_b, "b")) as sb,
            aiohttp.ClientSession() as http,
        ):
            restart = asyncio.create_task(_restart(engine_a, 0.8))
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(_client(http, rng, i, [sa, sb]) for i in range(REQUESTS))), 120
            )
            restarted = await restart
            for sidecar in (sa, sb):
                assert await sidecar.service.ledger.wait_idle(10.0)
                await sidecar.service.settled()
                ledger = sidecar.service.ledger
                assert (ledger.own_used, ledger.reserved, ledger.queued) == (0, 0, 0)
                assert ledger.waiting_prefill == 0
            for engine in (restarted, engine_b):
                loads = engine.engine.loads()
                assert (loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens) == (
                    0,
                    0,
                    0,
                )
                engine.engine.check()
            # No KV quota charge is left in Redis.
            assert await redis.hlen(PoolKeys("p").charges) == 0
            assert sa.service.quota is not None
            assert sb.service.quota is not None
            assert sa.service.quota.held == sb.service.quota.held == 0
            # Every request the sidecars saw ended exactly once.
            finished = "weir_sidecar_requests_finished"
            assert _counted(sa, finished) + _counted(sb, finished) == sum(o.posts for o in outcomes)
            preempted = "weir_sidecar_preemptions"
            assert _counted(sa, preempted, "offload") + _counted(sb, preempted, "offload") > 0
            kinds = {o.kind for o in outcomes}
            assert "completed" in kinds
            assert "cancelled" in kinds
            assert sa.service.ledger.preemptions + sb.service.ledger.preemptions > 0
            # Completed requests produced exactly the uninterrupted output.
            async with serve_engine(engine_config()) as oracle:
                for o in outcomes:
                    if o.kind != "completed":
                        continue
                    path = {"generate": "/generate", "chat": "/v1/chat/completions",
                            "completions": "/v1/completions"}[o.api]  # fmt: skip
                    async with http.post(oracle.url + path, json=o.body | {"stream": True}) as r:
                        expected = await read_sse(r)
                    assert o.text == expected.text(), (o.api, o.action)
    finally:
        await redis.aclose()
        await engine_a.close()
        if restarted is not None:
            await restarted.close()
