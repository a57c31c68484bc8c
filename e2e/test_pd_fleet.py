"""`weir up --pd`'s fleet, every part a process (Redis, a prefill and two decode reference
engines, their sidecars, the prefill pool's router and the decode pool's): P/D end to end,
with the decode handoff credit taken, consumed and released (docs/disaggregation.md).

One fleet serves the module, its engines slowed so that a prefill (in chunks) and a KV
transfer each last long enough to be caught; the engine kill comes last."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio
from openai import OpenAI

from controlplane.store import CreditStore
from weir.local.fleet import FleetConfig, LocalFleet

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = FleetConfig().model
# Engines at a fifth of an H200's speed, KV over a 1 GB/s link: a 3,000-token prompt
# prefills in 12 chunks of ~0.1 s and its KV (393 MB) crosses in 2 s; 6,000 KV tokens
# per engine, so that two long answers fill the decode pool.
ENGINE_FLAGS = ("--chunked-prefill-size", "256", "--kv-link-bytes-per-s", "1e9", "--enable-metrics")
LONG = "the river rises against the weir; " * 88  # 3,080 byte tokens


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalFleet]:
    config = FleetConfig(
        engines=2, prefill_engines=1, router_port=0, speed_factor=0.2, kv_tokens=6000,
        reference_args=ENGINE_FLAGS,
    )  # fmt: skip
    with LocalFleet(config) as running:
        yield running


def _loads(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/loads", timeout=5) as reply:
        rank: dict[str, Any] = json.loads(reply.read())["loads"][0]
        return rank


def _metrics(url: str, family: str) -> dict[str, float]:
    """A family's series at `url`, by their labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        line.split("{", 1)[1].rsplit("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(family + "{")
    }


def _credits(fleet: LocalFleet) -> dict[str, float]:
    series = _metrics(fleet.router_url, "weir_router_handoff_credits_total")
    return {labels.split('outcome="')[1].split('"')[0]: n for labels, n in series.items()}


def _prefilled(url: str) -> float:
    """Prompt tokens the engine took from clients (its own health checks are not counted)."""
    return sum(_metrics(url, "sglang:prompt_tokens_total").values())


async def _until(what: str, check: Any, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _engines(fleet: LocalFleet) -> tuple[str, list[str]]:
    """The prefill engine's URL and the decode engines'."""
    return fleet.engine_urls[0], fleet.engine_urls[1:]


def _idle(url: str) -> bool:
    rank = _loads(url)
    pd = rank["disaggregation"]
    return rank["num_used_tokens"] == 0 and rank["num_running_reqs"] == 0 and not any(
        pd[k] for k in ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                        "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs")
    )  # fmt: skip


async def _outstanding(fleet: LocalFleet) -> int:
    client = redis.asyncio.Redis.from_url(fleet.redis_url)
    try:
        return await CreditStore(client, fleet.decode_pool).outstanding(fleet.decode_pool)
    finally:
        await client.aclose()


def test_the_openai_client_streams_through_a_pd_pair_with_exact_usage(fleet: LocalFleet) -> None:
    prefill, decode = _engines(fleet)
    before = _credits(fleet)
    prompts = [_prefilled(u) for u in (prefill, *decode)]
    with OpenAI(base_url=fleet.router_url + "/v1", api_key="unused") as client:
        with client.completions.with_streaming_response.create(
            model=MODEL, prompt=LONG[:400], max_tokens=16, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ) as response:  # fmt: skip
            endpoint = response.headers["x-weir-endpoint"]
            request_id = response.headers["x-request-id"]
            chunks = list(response.parse())
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (400, 16)
    assert len(text) == 16
    assert endpoint.startswith(fleet.decode_pool)  # the decode leg served the stream
    after = _credits(fleet)
    assert after["taken"] - before.get("taken", 0) == 1
    assert after["consumed"] - before.get("consumed", 0) == 1
    # The request's story holds both legs' sidecar stories.
    with urllib.request.urlopen(f"{fleet.router_url}/weir/v1/requests/{request_id}") as reply:
        story = json.loads(reply.read())
    events = [e["event"] for e in story["events"]]
    assert events.index("credit") < events.index("pair") < events.index("handoff")
    assert "credit_consumed" in events
    assert set(story["endpoints"]) == {"local-0", endpoint}
    assert all("events" in leg for leg in story["endpoints"].values())
    # Both legs saw the whole request: the prompt once on each side.
    taken = [_prefilled(u) - n for u, n in zip((prefill, *decode), prompts, strict=True)]
    assert taken[0] == 400
    assert sum(taken[1:]) == 400


@pytest.mark.parametrize("stage", ["prefill", "transfer"])
async def test_a_cancel_mid_prefill_or_mid_transfer_frees_both_sides_and_the_credit(
    fleet: LocalFleet, stage: str
) -> None:
    prefill, decode = _engines(fleet)
    released = _credits(fleet).get("released", 0)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 8, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        reply = asyncio.create_task(http.post(fleet.router_url + "/v1/completions", json=body))
        if stage == "prefill":
            await _until("the prefill to run", lambda: _loads(prefill)["num_running_reqs"] == 1)
        else:
            await _until(
                "the KV to be on its way",
                lambda: _loads(prefill)["disaggregation"]["prefill_inflight_queue_reqs"] == 1,
            )
        # The decode side holds pages for the prompt while the KV is computed or moves.
        holding = [u for u in decode if _loads(u)["disaggregation"]["decode_transfer_queue_reqs"]]
        assert len(holding) == 1
        assert _loads(holding[0])["num_used_tokens"] >= len(LONG)
        assert await _outstanding(fleet) > 0
        reply.cancel()
    await _until("both sides to free the KV", lambda: all(_idle(u) for u in (prefill, *decode)))
    await _until("the credit to come back", lambda: _credits(fleet)["released"] > released)
    assert await _outstanding(fleet) == 0


async def test_a_full_decode_pool_makes_the_prefill_wait_for_a_credit(fleet: LocalFleet) -> None:
    """Long answers fill both decode engines: the next request is refused with a credit's
    Retry-After before any prefill (the prefill engine sees nothing of it); once they end,
    the same request is served."""
    prefill, decode = _engines(fleet)
    hog = {"model": MODEL, "prompt": LONG[:2500], "max_tokens": 3000, "ignore_eos": True,
           "stream": True}  # fmt: skip
    probe = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        hogs = [asyncio.create_task(_hold(http, fleet.router_url, hog)) for _ in decode]
        await _until("both decode engines to decode", lambda: all(
            _loads(u)["num_running_reqs"] for u in decode))  # fmt: skip

        async def refused() -> bool:
            async with http.post(fleet.router_url + "/v1/completions", json=probe) as reply:
                body = await reply.json()
                return reply.status == 429 and body["error"]["reason"] == "decode_credit"

        for _ in range(200):  # until the decode pool's usage reaches its budget
            prefilled = _prefilled(prefill)
            if await refused():
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("a full decode pool kept promising room")
        assert _prefilled(prefill) == prefilled  # the refused request never prefilled
        for task in hogs:
            task.cancel()
        for _ in range(200):
            async with http.post(fleet.router_url + "/v1/completions", json=probe) as reply:
                if reply.status == 200:
                    answer = await reply.json()
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the freed decode pool never took the request")
    assert len(answer["choices"][0]["text"]) == 4


async def _hold(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with http.post(url + "/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        async for _ in reply.content:
            pass


async def test_a_decode_engine_killed_mid_stream_resumes_the_stream(fleet: LocalFleet) -> None:
    """Last: it leaves one decode engine. The killed engine's sidecar hands the request
    back; the router pairs it again (the prefill engine recomputes prompt and answer so
    far) on the other decode engine, and the client's stream goes on."""
    _, decode = _engines(fleet)
    body = {"model": MODEL, "prompt": LONG[:300], "max_tokens": 120, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage, error = "", None, None
    before = await asyncio.to_thread(_metrics, fleet.router_url, "weir_router_resumes_total")
    async with (
        aiohttp.ClientSession() as http,
        http.post(fleet.router_url + "/v1/completions", json=body) as reply,
    ):
        assert reply.status == 200
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            error = chunk.get("error") or error
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text += choice.get("text") or ""
            if len(text) == 20:
                busy = next(i for i, u in enumerate(decode) if _loads(u)["num_running_reqs"])
                await asyncio.to_thread(fleet.kill, f"engine-{busy + 1}")
    assert error is None
    assert usage is not None
    assert usage["completion_tokens"] == 120
    assert len(text) == 120
    after = await asyncio.to_thread(_metrics, fleet.router_url, "weir_router_resumes_total")
    resumed = 'pool="local",reason="preempted"'
    assert after[resumed] - before[resumed] == 1
