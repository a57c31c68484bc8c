"""The router in front of real reference engines registered in a real Redis: streaming
passthrough, prefix affinity, watermark avoidance, lease expiry, resumption after an
engine dies mid-stream, client disconnects, and the staleness bound."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
from openai import AsyncOpenAI, AsyncStream

from controlplane.contract import CacheIdentity, RoutingPolicy, WatermarkState
from controlplane.ownership import Membership, OwnershipRing, prefix_key
from tests.polling import until
from tests.router.conftest import MODEL, Fleet, make_fleet

pytestmark = pytest.mark.redis

PREFIX = "You are a careful assistant. " * 12


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: str, **extra: object
) -> tuple[str, str]:
    """(endpoint that served it, text) of one non-streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}
    async with session.post(url + "/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        data = await reply.json()
        return reply.headers.get("x-weir-endpoint", ""), data["choices"][0]["text"]


async def test_a_streamed_chat_through_the_router_matches_the_engine(fleet: Fleet) -> None:
    messages = [{"role": "user", "content": "Tell me about weirs."}]
    engine_url = next(iter(fleet.engines.values())).url
    texts = []
    for base in (fleet.url, engine_url):
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert isinstance(stream, AsyncStream)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        texts.append("".join(pieces))
        await client.close()
    assert len(texts[0]) == 40
    assert texts[0] == texts[1]


async def test_requests_are_counted_under_their_real_finish_reason(fleet: Fleet) -> None:
    """A whole answer cut at max_tokens is `length` (not `stop`), in both APIs."""
    async with aiohttp.ClientSession() as session:
        await _complete(session, fleet.url, "count me")
        body = {"text": "count me", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        async with session.post(fleet.url + "/generate", json=body) as reply:
            assert reply.status == 200
    router = fleet.router.router
    counted = router.metrics.registry.get_sample_value(
        "weir_router_requests_total",
        {"pool": router.config.pool, "tenant": "default", "reason": "length"},
    )
    assert counted == 2


async def test_a_long_generate_stream_to_a_slow_client_arrives_whole(fleet: Fleet) -> None:
    """A client that stops reading fills the router's socket buffers: the router stops
    reading upstream meanwhile, and loses, repeats or reorders nothing."""
    body = {"text": "weir", "sampling_params": {"max_new_tokens": 2500, "ignore_eos": True},
            "stream": True}  # fmt: skip
    engine_url = next(iter(fleet.engines.values())).url
    streams = []
    for base, bufsize in ((engine_url, 2**16), (fleet.url, 1024)):
        async with (
            aiohttp.ClientSession(read_bufsize=bufsize) as session,
            session.post(base + "/generate", json=body) as reply,
        ):
            assert reply.status == 200
            await asyncio.sleep(1.0 if base == fleet.url else 0)  # megabytes wait
            frames = (await reply.read()).split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""]
        streams.append([msgspec.json.decode(f[6:]) for f in frames[:-2]])
    direct, relayed = streams
    counts = [e["meta_info"]["completion_tokens"] for e in relayed]
    assert counts == [e["meta_info"]["completion_tokens"] for e in direct]
    assert counts[-1] == 2500
    assert relayed[-1]["output_ids"] == direct[-1]["output_ids"]
    assert relayed[-1]["text"] == direct[-1]["text"]


async def test_an_adapter_goes_to_an_endpoint_serving_it_and_an_unknown_one_is_404(
    fleet: Fleet,
) -> None:
    """`lora_path` routes to the endpoints that report the adapter (and is forwarded as it
    is); one that no endpoint serves is the client's error (404), not an outage (503)."""
    await fleet.report("e1", adapters=("sql-lora",))
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            served, _text = await _complete(session, fleet.url, "q", lora_path="sql-lora")
            assert served == "e1"
        body = {"model": MODEL, "prompt": "q", "max_tokens": 8, "lora_path": "chat-lora"}
        async with session.post(fleet.url + "/v1/completions", json=body) as reply:
            assert reply.status == 404
            error = (await reply.json())["error"]
    assert (error["reason"], error["param"]) == ("unknown_adapter", "lora_path")
    assert "chat-lora" in error["message"]


def _owners(fleet: Fleet, prompt: str) -> tuple[str, str]:
    """The ring's owners of a prompt, computed here independently of the router."""
    policy = fleet.router.router.config.routing
    key = prefix_key(
        CacheIdentity(model=MODEL), prompt.encode(), policy.prefix_block_tokens,
        policy.prefix_blocks_for_owner,
    )  # fmt: skip
    ring = OwnershipRing(Membership.of(0, fleet.engines), policy.virtual_nodes)
    return ring.owners(key)


async def test_repeated_prefixes_go_to_their_primary_owner(fleet: Fleet) -> None:
    primary, _ = _owners(fleet, PREFIX)
    async with aiohttp.ClientSession() as session:
        served = [
            (await _complete(session, fleet.url, PREFIX + f"question {i}"))[0] for i in range(6)
        ]
    assert served == [primary] * 6
    router = fleet.router.router
    hits = router.metrics.registry.get_sample_value(
        "weir_router_decisions_total",
        {"pool": router.config.pool, "reason": "primary_owner", "owner_hit": "true"},
    )
    assert hits == 6


async def test_a_critical_owner_is_avoided_and_a_near_critical_one_loses_to_the_secondary(
    fleet: Fleet,
) -> None:
    primary, secondary = _owners(fleet, PREFIX)
    async with aiohttp.ClientSession() as session:
        await fleet.report(primary, watermark=WatermarkState.CRITICAL)
        served = {(await _complete(session, fleet.url, PREFIX + f"b{i}"))[0] for i in range(4)}
        assert primary not in served
        await fleet.report(
            primary, watermark=WatermarkState.PRESSURE, kv_used_tokens=170_000,
            kv_reserved_growth_tokens=20_000,
        )  # fmt: skip
        again, _ = await _complete(session, fleet.url, PREFIX + "c")
        assert again == secondary


async def test_a_failure_before_the_first_byte_retries_on_the_secondary_owner(
    fleet: Fleet,
) -> None:
    primary, secondary = _owners(fleet, PREFIX)
    await fleet.engines[primary].kill()  # its lease is still valid: the router finds out
    async with aiohttp.ClientSession() as session:
        served, text = await _complete(session, fleet.url, PREFIX + "retry me")
    assert served == secondary
    assert len(text) == 8
    router = fleet.router.router
    retries = router.metrics.registry.get_sample_value(
        "weir_router_retries_total", {"pool": router.config.pool, "reason": "connect_error"}
    )
    assert retries == 1


async def test_an_expired_lease_leaves_routing_within_its_ttl(redis_url: str) -> None:
    async with make_fleet(redis_url, engines=2, ttl_s=1.0) as fleet:
        # Keep e1 alive; e0 stops heartbeating and must drop out once its lease lapses.
        keep = asyncio.create_task(_beat(fleet, "e1"))
        try:
            router = fleet.router.router
            await until(
                lambda: all(
                    view.lease_deadline <= router.clock()
                    for view in router.view.snapshot.endpoints
                    if view.endpoint_id == "e0"
                ),
                "e0's lease to lapse",
            )
            async with aiohttp.ClientSession() as session:
                served = {
                    (await _complete(session, fleet.url, f"prompt {i} " * 10))[0] for i in range(6)
                }
            assert served == {"e1"}
            # The router's reaper then removes it from the pool, and counts the expiry.
            await until(lambda: "e0" not in router.view.snapshot.by_id, "e0 to be reaped")
            expiries = router.metrics.registry.get_sample_value(
                "weir_router_lease_expiries_total", {"pool": router.config.pool}
            )
            assert expiries == 1
        finally:
            keep.cancel()


async def _beat(fleet: Fleet, endpoint_id: str) -> None:
    while True:
        await fleet.report(endpoint_id, ttl_s=1.0)
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("api", ["chat", "completions", "generate"])
async def test_killing_the_engine_mid_stream_resumes_with_exactly_the_same_tokens(
    redis_url: str, api: str
) -> None:
    async with make_fleet(redis_url, engines=2, speed_factor=2.0) as fleet:
        path, body = _long_request(api)
        async with aiohttp.ClientSession() as session:
            direct = await _stream_text(session, fleet.engines["e1"].url + path, body, api)
            async with session.post(fleet.url + path, json=body) as reply:
                assert reply.status == 200
                serving = reply.headers["x-weir-endpoint"]
                events = []
                killed = False
                async for line in reply.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        if len(events) == 5 and not killed:
                            killed = True
                            await fleet.engines[serving].kill()
        assert killed
        assert events[-1] == b"[DONE]"
        text = _text_of(events, api)
        assert text == direct
        assert len(text) == 150
        router = fleet.router.router
        resumes = router.metrics.registry.get_sample_value(
            "weir_router_resumes_total", {"pool": router.config.pool, "reason": "broken"}
        )
        assert resumes == 1


async def test_a_stream_whose_engine_dies_resumes_on_a_critical_endpoint(redis_url: str) -> None:
    """The only other endpoint is at critical KV pressure: a new request would not be sent
    there, but a resume is an accepted stream and is (its sidecar's admission decides)."""
    async with make_fleet(redis_url, engines=2, speed_factor=2.0) as fleet:
        path, body = _long_request("completions")
        async with aiohttp.ClientSession() as session:
            direct = await _stream_text(
                session, fleet.engines["e1"].url + path, body, "completions"
            )
            async with session.post(fleet.url + path, json=body) as reply:
                serving = reply.headers["x-weir-endpoint"]
                other = next(e for e in fleet.engines if e != serving)
                events = []
                async for line in reply.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        if len(events) == 5:
                            await fleet.report(other, watermark=WatermarkState.CRITICAL)
                            await fleet.engines[serving].kill()
        assert events[-1] == b"[DONE]"
        assert _text_of(events, "completions") == direct


async def test_a_completion_prompted_by_token_ids_ends_with_an_error_event_when_its_engine_dies(
    redis_url: str,
) -> None:
    """Its prompt cannot be rebuilt from the text the client holds, so the router does not
    resume it from a prompt that is not the client's: the stream ends with a reason."""
    async with make_fleet(redis_url, engines=2, speed_factor=2.0) as fleet:
        body = {
            "model": MODEL, "stream": True, "max_tokens": 150, "ignore_eos": True,
            "prompt": list(range(5, 40)),
        }  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(fleet.url + "/v1/completions", json=body) as reply,
        ):
            assert reply.status == 200
            events: list[bytes] = []
            async for line in reply.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 5:
                        await fleet.engines[reply.headers["x-weir-endpoint"]].kill()
    assert events[-1] == b"[DONE]"
    error = msgspec.json.decode(events[-2])["error"]
    assert (error["type"], error["reason"]) == ("unavailable", "not_resumable")


def _long_request(api: str) -> tuple[str, dict[str, object]]:
    prompt = "Once upon a time, by the river weir, "
    if api == "chat":
        return "/v1/chat/completions", {
            "model": MODEL, "stream": True, "max_tokens": 150, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}],
        }  # fmt: skip
    if api == "completions":
        return "/v1/completions", {
            "model": MODEL, "stream": True, "max_tokens": 150, "ignore_eos": True,
            "prompt": prompt,
        }  # fmt: skip
    return "/generate", {
        "text": prompt, "stream": True,
        "sampling_params": {"max_new_tokens": 150, "ignore_eos": True},
    }  # fmt: skip


async def _stream_text(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], api: str
) -> str:
    async with session.post(url, json=body) as reply:
        assert reply.status == 200
        events = [line[6:].strip() async for line in reply.content if line.startswith(b"data: ")]
    return _text_of(events, api)


def _text_of(events: list[bytes], api: str) -> str:
    import json

    chunks = [json.loads(e) for e in events if e != b"[DONE]"]
    if api == "generate":
        return str(chunks[-1]["text"])
    if api == "chat":
        return "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def test_a_client_disconnect_aborts_the_request_in_the_engine(redis_url: str) -> None:
    async with make_fleet(redis_url, engines=1, speed_factor=1.0) as fleet:
        engine = fleet.engines["e0"].engine
        path, body = _long_request("completions")
        body["max_tokens"] = 2000
        async with aiohttp.ClientSession() as session:
            reply = await session.post(fleet.url + path, json=body)
            assert reply.status == 200
            async for line in reply.content:
                if line.startswith(b"data: "):
                    break
            assert engine.loads().num_running_reqs == 1
            reply.close()
        await until(lambda: engine.aborted_total >= 1 or not engine.has_work, "the engine abort")
        assert not engine.has_work
        assert engine.generation_tokens_total < 2000


async def test_routing_goes_on_within_the_staleness_bound_then_fails_closed(
    fresh_redis: object,
) -> None:
    from weir.local.redis_server import RedisServer

    assert isinstance(fresh_redis, RedisServer)
    routing = RoutingPolicy(snapshot_staleness_s=1.5)
    async with make_fleet(fresh_redis.url, engines=1, routing=routing) as fleet:
        fresh_redis.stop()
        async with aiohttp.ClientSession() as session:
            served, _ = await _complete(session, fleet.url, "still routing")
            assert served == "e0"
            router = fleet.router.router
            await until(lambda: router.view.is_stale(router.clock()), "the bound to pass")
            body = {"model": MODEL, "prompt": "now refused", "max_tokens": 4}
            async with session.post(fleet.url + "/v1/completions", json=body) as reply:
                assert reply.status == 503
                error = (await reply.json())["error"]
                assert error["reason"] == "snapshot_stale"
                assert "Retry-After" in reply.headers
            async with session.get(fleet.url + "/ready") as reply:
                assert reply.status == 503
        fresh_redis.start()
        await until(lambda: not router.view.is_stale(router.clock()), "recovery")


async def test_when_every_endpoint_is_critical_requests_queue_then_flow_or_time_out(
    redis_url: str,
) -> None:
    async with make_fleet(
        redis_url, engines=2, routing=RoutingPolicy(queue_max_wait_s=1.0)
    ) as fleet:
        for endpoint_id in fleet.engines:
            await fleet.report(endpoint_id, watermark=WatermarkState.CRITICAL)
        router = fleet.router.router
        async with aiohttp.ClientSession() as session:
            # Nobody recovers: the queued request is refused when its time to live ends.
            body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 4}
            async with session.post(fleet.url + "/v1/completions", json=body) as reply:
                assert reply.status == 429
                assert (await reply.json())["error"]["reason"] == "queue_timeout"
                assert int(reply.headers["Retry-After"]) >= 1
            # A deadline shorter than the queue's time to live ends the wait sooner.
            async with session.post(
                fleet.url + "/v1/completions", json=body, headers={"x-weir-deadline-ms": "200"}
            ) as reply:
                assert reply.status == 504
                assert (await reply.json())["error"]["reason"] == "deadline"
            # A client that leaves while queued leaves the queue at once.
            leaving = asyncio.create_task(_complete(session, fleet.url, "never mind"))
            await until(lambda: len(router.dispatch.queue) == 1, "the request to queue")
            leaving.cancel()
            await until(lambda: len(router.dispatch.queue) == 0, "the queue to drop it")
            # One endpoint recovers while a request waits: it is served there.
            waiting = asyncio.create_task(_complete(session, fleet.url, "served after all"))
            await until(lambda: len(router.dispatch.queue) == 1, "the request to queue")
            await fleet.report("e1", watermark=WatermarkState.NORMAL)
            served, text = await waiting
        assert served == "e1"
        assert len(text) == 8
        assert len(router.dispatch.queue) == 0
