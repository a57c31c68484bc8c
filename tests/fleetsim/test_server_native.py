"""SGLang's native surface over real HTTP: /generate, state, control, both API versions."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
import pytest

from fleetsim.engine import EngineModel
from fleetsim.server import RunningEngine, serve_engine
from fleetsim.server.app import EngineServer
from fleetsim.server.driver import EngineDriver, Stream
from fleetsim.server.metrics import EngineMetrics

from .conftest import FAST, small_config, submit, until


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith(("{", "[")) else text


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith(("{", "[")) else text


def gen(text: str, n: int, **extra: object) -> dict[str, object]:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, **extra}


async def test_generate_plain_and_streamed_agree(engine: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        status, plain = await post(http, f"{engine.url}/generate", gen("abc", 25, rid="p-1"))
        assert status == 200
        chunks = []
        async with http.post(
            f"{engine.url}/generate", json=gen("abc", 25, rid="s-1", stream=True)
        ) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for line in resp.content:
                if line.startswith(b"data: "):
                    chunks.append(line[6:].strip())
    assert chunks[-1] == b"[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    # Cumulative text and ids; finish_reason null until the last chunk.
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert all(a["text"] == b["text"][: len(a["text"])] for a, b in itertools.pairwise(events))
    last = events[-1]
    assert last["text"] == plain["text"]
    assert last["output_ids"] == plain["output_ids"]
    meta = plain["meta_info"]
    assert meta["id"] == "p-1"
    assert meta["finish_reason"] == {"type": "length", "length": 25}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 25)
    assert meta["e2e_latency"] >= 0
    assert last["meta_info"]["id"] == "s-1"


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
async def test_surface_differs_by_version(version: str) -> None:
    async with (
        serve_engine(small_config(), api_version=version) as eng,
        aiohttp.ClientSession() as http,
    ):
        status, info = await get(http, f"{eng.url}/get_server_info")
        assert status == 200
        assert info["version"] == version
        assert info["max_total_num_tokens"] == 16384
        assert info["page_size"] == 4
        assert info["chunked_prefill_size"] == 512
        assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 16384
        new = version == "0.5.23"
        assert (await get(http, f"{eng.url}/server_info"))[0] == (200 if new else 404)
        assert (await get(http, f"{eng.url}/ready"))[0] == (200 if new else 404)
        assert (await get(http, f"{eng.url}/get_load"))[0] == (404 if new else 200)
        assert (await get(http, f"{eng.url}/v1/loads?include=all"))[0] == (200 if new else 404)
        assert (await get(http, f"{eng.url}/health"))[0] == 200
        assert (await get(http, f"{eng.url}/health_generate"))[0] == 200
        status, model_info = await get(http, f"{eng.url}/get_model_info")
        assert status == 200
        assert model_info["is_generation"] is True
        _, metrics = await get(http, f"{eng.url}/metrics")
        assert ("sglang:kv_used_tokens{" in metrics) is new
        assert "sglang:token_usage{" in metrics
        if not new:
            # 0.5.5 pause takes no body and aborts everything.
            task = asyncio.create_task(post(http, f"{eng.url}/generate", gen("x", 100000)))
            await until(lambda: eng.engine.requests)
            assert (await post(http, f"{eng.url}/pause_generation", None))[0] == 200
            status, body = await task
            assert body["meta_info"]["finish_reason"]["type"] == "abort"
            assert (await post(http, f"{eng.url}/continue_generation", None))[0] == 200
            _, load = await get(http, f"{eng.url}/get_load")
            assert load == [
                {"rid": None, "http_worker_ipc": None, "dp_rank": None, "num_reqs": 0,
                 "num_waiting_reqs": 0, "num_tokens": 0}
            ]  # fmt: skip


async def test_loads_and_metrics_follow_running_requests(engine: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        tasks = [
            asyncio.create_task(post(http, f"{engine.url}/generate", gen(f"r{i}", 4000)))
            for i in range(3)
        ]
        await until(lambda: len(engine.engine.decoding) == 3)
        _, loads = await get(http, f"{engine.url}/v1/loads")
        rank = loads["loads"][0]
        assert rank["num_running_reqs"] == 3
        assert rank["num_used_tokens"] > 0
        assert rank["max_total_num_tokens"] == 16384
        assert 0 < rank["token_usage"] < 1
        # A prefill iteration ran since the requests arrived: the gauges were refreshed.
        _, metrics = await get(http, f"{engine.url}/metrics")
        assert 'sglang:num_running_reqs{engine_type="unified"' in metrics
        assert "sglang:num_running_reqs{" in metrics
        await post(http, f"{engine.url}/abort_request", {"rid": "", "abort_all": True})
        results = await asyncio.gather(*tasks)
        assert {r[1]["meta_info"]["finish_reason"]["type"] for r in results} == {"abort"}
        _, metrics = await get(http, f"{engine.url}/metrics")
    assert "sglang:num_aborted_requests_total" in metrics
    assert engine.engine.kv.used_pages == 0


async def test_pause_modes(engine: RunningEngine) -> None:
    model = engine.engine
    async with aiohttp.ClientSession() as http:
        url = engine.url
        _, reference = await post(http, f"{url}/generate", gen("pause me", 300, rid="ref"))
        for mode in ("in_place", "retract"):
            task = asyncio.create_task(post(http, f"{url}/generate", gen("pause me", 300)))
            await until(lambda: model.decoding and len(model.decoding[0].output_ids) >= 10)
            status, _ = await post(http, f"{url}/pause_generation", {"mode": mode})
            assert status == 200
            req = next(iter(model.requests.values()))
            held = len(req.output_ids)
            await asyncio.sleep(0.05)
            assert len(req.output_ids) == held  # nothing runs while paused
            if mode == "retract":
                assert req.computed == 0
                assert model.kv.used_pages == 0
            else:
                assert req.computed > 0
            assert (await post(http, f"{url}/continue_generation", {}))[0] == 200
            _, body = await task
            assert body["output_ids"] == reference["output_ids"]
            assert body["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
        status, _ = await post(http, f"{url}/pause_generation", {"mode": "sideways"})
        assert status == 400
        assert not model.paused


async def test_flush_cache_refused_while_running(engine: RunningEngine) -> None:
    model = engine.engine
    async with aiohttp.ClientSession() as http:
        await post(http, f"{engine.url}/generate", gen("cache me " * 20, 10))
        assert model.kv.evictable_pages > 0
        task = asyncio.create_task(post(http, f"{engine.url}/generate", gen("busy", 100000)))
        await until(lambda: model.requests)
        status, _ = await post(http, f"{engine.url}/flush_cache", None)
        assert status == 400
        await post(http, f"{engine.url}/abort_request", {"abort_all": True})
        await task
        status, text = await post(http, f"{engine.url}/flush_cache", None)
    assert status == 200
    assert text.startswith("Cache flushed")
    assert model.kv.evictable_pages == 0
    assert model.kv.free_pages == model.kv.total_pages


async def test_full_queue_answers_503() -> None:
    config = small_config(max_running_requests=1, max_queued_requests=1)
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        url = f"{eng.url}/generate"
        running = asyncio.create_task(post(http, url, gen("a", 100000)))
        await until(lambda: eng.engine.decoding)
        queued = asyncio.create_task(post(http, url, gen("b", 5)))
        await until(lambda: eng.engine.waiting)
        # SGLang aborts the newcomer with a 503: a unary request answers its HTTP error,
        # a stream carries the abort in its one event.
        status, body = await post(http, url, gen("c", 5))
        assert status == 503
        assert body["message"] == "The request queue is full."
        assert (body["object"], body["code"]) == ("error", 503)
        async with http.post(url, json=gen("s", 5, stream=True)) as resp:
            assert resp.status == 200
            events = [line async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        finish = json.loads(events[0][6:])["meta_info"]["finish_reason"]
        assert finish["status_code"] == 503
        status, body = await post(
            http, f"{eng.url}/v1/completions", {"prompt": "d", "max_tokens": 3}
        )
        assert status == 503
        assert body["object"] == "error"
        await post(http, f"{eng.url}/abort_request", {"rid": running_rid(eng)})
        assert (await running)[0] == 200
        status, body = await queued
    assert status == 200
    assert body["meta_info"]["completion_tokens"] == 5


def running_rid(eng: RunningEngine) -> str:
    return eng.engine.decoding[0].rid


async def test_priority_scheduling_runs_higher_first() -> None:
    config = small_config(max_running_requests=1, enable_priority_scheduling=True)
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        url = f"{eng.url}/generate"
        # An explicit priority: one left out ranks below every other (and is preempted).
        first = asyncio.create_task(post(http, url, gen("a", 50, rid="first", priority=0)))
        await until(lambda: eng.engine.decoding)
        low = asyncio.create_task(post(http, url, gen("b", 5, rid="low", priority=0)))
        await until(lambda: len(eng.engine.waiting) == 1)
        high = asyncio.create_task(post(http, url, gen("c", 5, rid="high", priority=10)))
        await until(lambda: len(eng.engine.waiting) == 2)
        results = await asyncio.gather(first, low, high)
    by_rid = {r[1]["meta_info"]["id"]: r[1] for r in results}
    assert by_rid["high"]["meta_info"]["e2e_latency"] < by_rid["low"]["meta_info"]["e2e_latency"]


async def test_kill_drops_connections_like_a_crash() -> None:
    async with serve_engine(small_config()) as eng, aiohttp.ClientSession() as http:
        async with http.post(f"{eng.url}/generate", json=gen("x", 100000, stream=True)) as resp:
            await resp.content.readline()
            await eng.kill()
            with pytest.raises(aiohttp.ClientError):
                async for _ in resp.content:
                    pass
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{eng.url}/health")


async def test_health_is_503_while_starting() -> None:
    async with serve_engine(small_config(startup_s=0.3)) as eng, aiohttp.ClientSession() as http:
        assert (await get(http, f"{eng.url}/health"))[0] == 503
        assert (await get(http, f"{eng.url}/ready"))[0] == 503
        statuses: list[int] = []

        async def probe() -> bool:
            statuses.append((await get(http, f"{eng.url}/health"))[0])
            return statuses[-1] == 200

        for _ in range(500):
            if await probe():
                break
            await asyncio.sleep(0.01)
        assert statuses[-1] == 200
        assert (await get(http, f"{eng.url}/ready"))[0] == 200


async def test_scheduler_gauges_refresh_on_sglang_cadence() -> None:
    """Gauges move at prefill iterations and every decode_log_interval decode steps, so
    during a long decode they lag what /v1/loads reports live."""
    config = small_config(decode_log_interval=100000, page_size=1)
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        task = asyncio.create_task(post(http, f"{eng.url}/generate", gen("abcd", 5000)))
        await until(lambda: eng.engine.decoding and len(eng.engine.decoding[0].output_ids) > 50)
        _, loads = await get(http, f"{eng.url}/v1/loads")
        _, metrics = await get(http, f"{eng.url}/metrics")
        await post(http, f"{eng.url}/abort_request", {"abort_all": True})
        await task
    used = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sglang:num_used_tokens{")
    )
    assert used == 4  # the prompt's KV, as of the prefill iteration
    assert loads["loads"][0]["num_used_tokens"] > 50


async def test_incremental_streaming_output_sends_only_new_text() -> None:
    config = small_config(incremental_streaming_output=True)
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        _, whole = await post(http, f"{eng.url}/generate", gen("inc", 60))
        events = []
        async with http.post(f"{eng.url}/generate", json=gen("inc", 60, stream=True)) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
    assert len(events) > 1
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
    assert events[-1]["meta_info"]["completion_tokens"] == 60


async def stream_events(http: aiohttp.ClientSession, url: str, body: object) -> list[Any]:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        lines = [line async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]\n"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
async def test_a_stream_publishes_one_token_per_decode_step(version: str) -> None:
    """The first chunk carries the prefill's one token and each later chunk one more, as
    SGLang streams at stream_interval 1: a step's token is published when its iteration
    ends, never with the next one's."""
    async with (
        serve_engine(small_config(), api_version=version) as eng,
        aiohttp.ClientSession() as http,
    ):
        runs = await asyncio.gather(
            *(stream_events(http, f"{eng.url}/generate", gen(f"s{i}", 40, stream=True))
              for i in range(4))
        )  # fmt: skip
    for events in runs:
        assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, 41))
        # Cumulative ids on 0.5.23, only the new one on 0.5.5.
        ids = [len(e["output_ids"]) for e in events]
        assert ids == (list(range(1, 41)) if version == "0.5.23" else [1] * 40)


async def test_an_abort_needs_a_live_exact_rid(engine: RunningEngine) -> None:
    """SGLang's tokenizer forwards an abort only for a rid it knows exactly; its scheduler
    then aborts every rid that starts with it."""
    model = engine.engine
    async with aiohttp.ClientSession() as http:
        tasks = {
            rid: asyncio.create_task(post(http, f"{engine.url}/generate", gen(rid, 100000, rid=rid)))
            for rid in ("job-1", "job-10", "job-2")
        }  # fmt: skip
        await until(lambda: len(model.decoding) == 3)
        assert (await post(http, f"{engine.url}/abort_request", {"rid": "job-"}))[0] == 200
        await asyncio.sleep(0.05)
        assert len(model.decoding) == 3  # a prefix alone: nothing
        assert (await post(http, f"{engine.url}/abort_request", {"rid": "job-1"}))[0] == 200
        for rid in ("job-1", "job-10"):
            _, body = await tasks[rid]
            assert body["meta_info"]["finish_reason"] == {
                "type": "abort", "message": "Aborted", "status_code": None, "err_type": None,
            }  # fmt: skip
        assert [r.rid for r in model.decoding] == ["job-2"]
        await post(http, f"{engine.url}/abort_request", {"rid": "job-2"})
        await tasks["job-2"]


async def test_a_paused_0523_engine_needs_a_json_body_to_continue(engine: RunningEngine) -> None:
    """0.5.23 validates the pause and continue bodies: an empty one is refused with 400
    and changes nothing. Requests that arrive while paused wait outside the queue, as in
    SGLang's tokenizer manager."""
    model = engine.engine
    url = engine.url
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/pause_generation", data=b"") as resp:
            assert resp.status == 400
        assert not model.paused
        assert (await post(http, f"{url}/pause_generation", {"mode": "in_place"}))[0] == 200
        task = asyncio.create_task(post(http, f"{url}/generate", gen("held", 5)))
        await until(lambda: engine.driver.held)
        assert not model.requests
        _, loads = await get(http, f"{url}/v1/loads")
        assert loads["loads"][0]["queues"]["paused"] == 1
        async with http.post(f"{url}/continue_generation", data=b"") as resp:
            assert resp.status == 400
            assert (await resp.json())["type"] == "Bad Request"
        assert model.paused
        assert (await post(http, f"{url}/continue_generation", {}))[0] == 200
        status, body = await task
    assert (status, body["meta_info"]["completion_tokens"]) == (200, 5)


async def test_health_answers_once_the_engine_produced_output(engine: RunningEngine) -> None:
    """SGLang's /health sends a one-token generation and passes once any output came back
    after it asked; a paused engine produces none and fails the check."""
    engine.server.health_timeout_s = 1.5
    async with aiohttp.ClientSession() as http:
        assert (await get(http, f"{engine.url}/health"))[0] == 200
        await post(http, f"{engine.url}/pause_generation", {"mode": "in_place"})
        assert (await get(http, f"{engine.url}/health"))[0] == 503
        assert not engine.driver.held  # the check's request went with it
        await post(http, f"{engine.url}/continue_generation", {})
        assert (await get(http, f"{engine.url}/health_generate"))[0] == 200


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
async def test_steps_that_coalesce_keep_only_the_last_step_s_ids_on_0_5_5(version: str) -> None:
    """Several decode steps in one chunk (the client read slower than the engine wrote):
    0.5.23's cumulative ids hold every token; 0.5.5's hold only the latest step's, as
    SGLang 0.5.5's tokenizer manager sends them (a stream reads only the last of the
    outputs queued for it), so the ids of the steps before are lost to the client."""
    config = small_config()
    model = EngineModel(config)
    metrics = EngineMetrics(model, version)
    server = EngineServer(model, EngineDriver(model, metrics, FAST), metrics, version)
    req = submit(model, "slow-reader", "coalesce", 10)
    stream = Stream(req, streaming=True)
    now, chunks = 0.0, []
    for tokens in (1, 4, 10):  # the client reads after the 1st, 4th and 10th token
        while len(req.output_ids) < tokens:
            now += model.step(now).duration
            stream.publish(finished=req.finished)
        chunks += server._native_chunk(stream, last=stream.finished)
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]  # type: ignore[index]
    ids = [c["output_ids"] for c in chunks]  # type: ignore[index]
    assert counts == [1, 4, 10]
    if version == "0.5.23":
        assert ids == [req.output_ids[:1], req.output_ids[:4], req.output_ids[:10]]
    else:
        assert ids == [req.output_ids[:1], req.output_ids[3:4], req.output_ids[9:10]]
