"""Preemption and resume against real reference engines: recompute in place, migrate to a
second engine through /weir/v1/continue, and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from controlplane.contract import encode_json
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine, serve_engine
from tests.polling import until
from tests.sidecar.conftest import MODEL, engine_config, pool_policy
from tests.sidecar.streams import Received, read_sse

# Slow enough that a request is still decoding when the test preempts it.
SLOW = {"speed_factor": 4.0}
MAX_NEW = 240


def bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "generate": (
            "/generate",
            {
                "text": "a long story about rivers",
                "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True},
            },
        ),
        "generate_ids": (
            "/generate",
            {
                "input_ids": [72, 101, 108, 108, 111, 32, 119, 101, 105, 114],
                "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True},
            },
        ),
        "completions": (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "once upon a time",
                "max_tokens": MAX_NEW,
                "ignore_eos": True,
            },
        ),
        "completions_usage": (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "once upon a time",
                "max_tokens": MAX_NEW,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "chat": (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "tell me everything"}],
                "max_tokens": MAX_NEW,
                "ignore_eos": True,
            },
        ),
    }


@pytest.fixture
async def two() -> AsyncIterator[
    tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar]
]:
    async with (
        serve_engine(engine_config(**SLOW)) as ea,
        serve_engine(engine_config(**SLOW)) as eb,
        serve_sidecar(SidecarConfig(engine_url=ea.url, pool="p", policy=pool_policy())) as sa,
        serve_sidecar(SidecarConfig(engine_url=eb.url, pool="p", policy=pool_policy())) as sb,
    ):
        yield ea, sa, eb, sb


async def uninterrupted(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> Received:
    async with http.post(url + path, json=body | {"stream": True}) as resp:
        assert resp.status == 200
        return await read_sse(resp)


def counts(received: Received) -> list[dict[str, Any]]:
    return [{k: v for k, v in u.items() if k != "prompt_tokens_details"} for u in received.usage()]


@pytest.mark.parametrize(
    "api", ["generate", "generate_ids", "completions", "completions_usage", "chat"]
)
async def test_recompute_in_place_continues_the_stream_exactly(
    two: tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar], api: str
) -> None:
    engine, sidecar, _, _ = two
    path, body = bodies()[api]
    async with aiohttp.ClientSession() as http:
        expected = await uninterrupted(http, engine.url, path, body)
        async with http.post(sidecar.url + path, json=body | {"stream": True}) as resp:
            rid = resp.headers["x-weir-request-id"]
            first = await read_sse(resp, stop_after=20)
            async with http.post(
                sidecar.url + "/weir/v1/preempt", json={"rid": rid, "mode": "recompute"}
            ) as answer:
                assert answer.status == 200, await answer.text()
            rest = await read_sse(resp)
    got = Received(first.events + rest.events, rest.done)
    assert got.done
    assert got.text() == expected.text()
    assert len(expected.text()) == MAX_NEW
    assert got.finish() == expected.finish()
    # The uninterrupted run's counts, once if asked (the prefix-cache hit is this run's).
    assert counts(got) == counts(expected)
    if api.startswith("generate"):
        texts = [e["text"] for e in got.events]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
        assert got.events[-1]["meta_info"]["completion_tokens"] == MAX_NEW
    assert sidecar.service.ledger.preemptions == 1
    assert sidecar.service.ledger.own_used == 0
    assert engine.engine.loads().num_running_reqs == 0


@pytest.mark.parametrize(
    "api", ["generate", "generate_ids", "completions", "completions_usage", "chat"]
)
async def test_migrated_request_resumes_on_another_engine_exactly(
    two: tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar], api: str
) -> None:
    engine_a, sidecar_a, engine_b, sidecar_b = two
    path, body = bodies()[api]
    async with aiohttp.ClientSession() as http:
        expected = await uninterrupted(http, engine_b.url, path, body)
        async with http.post(
            sidecar_a.url + path,
            json=body | {"stream": True},
            headers={"x-weir-migratable": "1", "x-weir-tenant": "acme"},
        ) as resp:
            rid = resp.headers["x-weir-request-id"]
            first = await read_sse(resp, stop_after=20)
            async with http.post(
                sidecar_a.url + "/weir/v1/preempt", json={"rid": rid, "mode": "migrate"}
            ) as answer:
                assert answer.status == 200
            before = await read_sse(resp)
        assert before.continuation is not None
        assert before.continuation.tenant == "acme"
        assert not before.done
        async with http.post(
            sidecar_b.url + "/weir/v1/continue", data=encode_json(before.continuation)
        ) as resp:
            assert resp.status == 200, await resp.text()
            after = await read_sse(resp)
    assert after.done
    if api.startswith("generate"):
        # /generate is cumulative: the continued stream carries the whole output.
        assert after.text() == expected.text()
        assert after.events[-1]["meta_info"]["completion_tokens"] == MAX_NEW
        assert counts(after) == counts(expected)
    else:
        spliced = Received(first.events + before.events + after.events, True)
        assert spliced.text() == expected.text()
        assert counts(spliced) == counts(expected)
    assert after.finish() == expected.finish()
    for sidecar, engine in ((sidecar_a, engine_a), (sidecar_b, engine_b)):
        assert sidecar.service.ledger.flights == {}
        assert sidecar.service.ledger.own_used == 0
        assert engine.engine.loads().num_running_reqs == 0


async def test_client_disconnect_aborts_in_the_engine_and_frees_kv(
    two: tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar],
) -> None:
    engine, sidecar, _, _ = two
    path, body = bodies()["generate"]
    idle_used = engine.engine.loads().num_used_tokens
    async with aiohttp.ClientSession() as http:
        resp = await http.post(sidecar.url + path, json=body | {"stream": True})
        await read_sse(resp, stop_after=10)
        assert engine.engine.loads().num_running_reqs == 1
        resp.close()
    assert await sidecar.service.ledger.wait_idle(10.0)
    assert sidecar.service.ledger.own_used == 0
    loads = engine.engine.loads()
    assert loads.num_running_reqs == 0
    assert loads.num_used_tokens == idle_used
    metrics = sidecar.service.metrics.exposition().decode()
    assert "weir_sidecar_cancel_to_freed_ms_count{endpoint=" in metrics
    assert 'reason="cancelled"' in metrics


async def test_abort_request_cancels_by_the_clients_rid_running_or_queued() -> None:
    """SGLang's /abort_request, as a router calls it when its client leaves: the request
    it sent with that rid is cancelled at once, whether it streams or still waits in the
    local queue (answered 404 before)."""
    async with (
        # KV for one such request and its growth, not two: the second waits its turn.
        serve_engine(engine_config(**SLOW, max_total_tokens=480)) as engine,
        serve_sidecar(
            SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy())
        ) as sidecar,
        aiohttp.ClientSession() as http,
    ):
        path, body = bodies()["generate"]
        running = await http.post(sidecar.url + path, json=body | {"stream": True, "rid": "c-1"})
        await read_sse(running, stop_after=3)
        queued = asyncio.create_task(
            http.post(sidecar.url + path, json=body | {"stream": True, "rid": "c-2"})
        )
        ledger = sidecar.service.ledger
        await until(lambda: ledger.queued == 1, "the second request to queue")
        for rid in ("c-2", "c-1", "nobody"):
            async with http.post(sidecar.url + "/abort_request", json={"rid": rid}) as answer:
                assert (answer.status, await answer.read()) == (200, b"")
        assert await ledger.wait_idle(10.0)
        assert ledger.queued == 0
        assert ledger.own_used == 0
        assert engine.engine.loads().num_running_reqs == 0
        with pytest.raises(aiohttp.ClientPayloadError):  # cut off: its client had left
            await read_sse(running)
        # A body cut off leaves aiohttp's connection held by the response: close it, or
        # it warns (ResourceWarning) whenever the collector gets to it, in a later test.
        running.close()
        with contextlib.suppress(aiohttp.ClientError):
            (await queued).close()
        cancelled = sidecar.service.metrics.registry.get_sample_value(
            "weir_sidecar_requests_finished_total",
            {"pool": "p", "endpoint": sidecar.service.metrics.endpoint, "reason": "cancelled"},
        )
        assert cancelled == 2
        async with http.post(sidecar.url + "/abort_request", data=b"{rid") as answer:
            assert answer.status == 400


async def test_preempt_refuses_what_cannot_be_preempted(
    two: tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar],
) -> None:
    _, sidecar, _, _ = two
    path, body = bodies()["generate"]
    async with aiohttp.ClientSession() as http:
        async with http.post(sidecar.url + "/weir/v1/preempt", json={"rid": "weirnope"}) as r:
            assert r.status == 404
        async with http.post(sidecar.url + "/weir/v1/preempt", json={"rid": 3}) as r:
            assert r.status == 400
        async with http.post(sidecar.url + path, json=body | {"stream": True}) as resp:
            rid = resp.headers["x-weir-request-id"]
            await read_sse(resp, stop_after=5)
            # Not marked migratable by a router: migration is refused, the stream goes on.
            async with http.post(
                sidecar.url + "/weir/v1/preempt", json={"rid": rid, "mode": "migrate"}
            ) as r:
                assert r.status == 409
            rest = await read_sse(resp)
    assert rest.done
    assert sidecar.service.ledger.preemptions == 0


async def test_deadline_ends_a_running_stream_and_frees_kv(
    two: tuple[RunningEngine, RunningSidecar, RunningEngine, RunningSidecar],
) -> None:
    engine, sidecar, _, _ = two
    path, body = bodies()["generate"]
    body = body | {"sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    async with aiohttp.ClientSession() as http:
        for bad in ("soon", "-1", "nan", "1e12"):
            async with http.post(
                sidecar.url + path, json=body, headers={"x-weir-deadline-ms": bad}
            ) as resp:
                assert resp.status == 400
        async with http.post(
            sidecar.url + path, json=body | {"stream": True}, headers={"x-weir-deadline-ms": "300"}
        ) as resp:
            got = await read_sse(resp)
    assert got.done
    assert got.events[-1]["error"]["type"] == "deadline"
    assert 0 < len(got.events) < 3000
    assert await sidecar.service.ledger.wait_idle(5.0)
    assert sidecar.service.ledger.own_used == 0
    assert engine.engine.loads().num_running_reqs == 0
    assert 'reason="deadline"' in sidecar.service.metrics.exposition().decode()
