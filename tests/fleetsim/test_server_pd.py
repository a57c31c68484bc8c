"""SGLang's P/D protocol between two reference engines over loopback: the same body (with
`bootstrap_host`, `bootstrap_port`, `bootstrap_room`) sent to a prefill and a decode engine
makes one request, whose KV moves from the one to the other (docs/disaggregation.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from fleetsim.engine import Phase
from fleetsim.server import RunningEngine, serve_engine
from fleetsim.server.protocol import FAKE_BOOTSTRAP_HOST

from .conftest import small_config, until

PROMPT = [3 + i % 200 for i in range(600)]
SLOW_LINK = 2e6  # bytes/s: a 600-token prompt's KV (79 MB) takes 39 s, 0.6 s of wall time
# Ten times slower, for a test that acts mid-transfer and need not wait for its end: on a
# loaded machine the abort once came after the 0.6 s were over.
STALLED_LINK = SLOW_LINK / 10


@asynccontextmanager
async def pair(**changes: object) -> AsyncIterator[tuple[RunningEngine, RunningEngine]]:
    prefill = small_config(disaggregation_mode="prefill", disaggregation_bootstrap_port=0)
    decode = small_config(disaggregation_mode="decode")
    async with (
        serve_engine(prefill.replace(**changes)) as p,
        serve_engine(decode.replace(**changes)) as d,
    ):
        yield p, d


def body(p: RunningEngine, room: int, n: int = 20, **extra: object) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.server.bootstrap_port,
        "bootstrap_room": room,
        **extra,
    }


async def post(http: aiohttp.ClientSession, url: str, payload: object) -> tuple[int, Any]:
    async with http.post(url, json=payload) as resp:
        return resp.status, await resp.json(content_type=None)


async def events(http: aiohttp.ClientSession, url: str, payload: object) -> list[Any]:
    async with http.post(url, json=payload) as resp:
        assert resp.status == 200
        lines = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def idle(engine: RunningEngine) -> bool:
    return not engine.engine.requests and engine.engine.kv.used_pages == 0


async def test_a_pd_pair_answers_as_one_mixed_engine_would() -> None:
    async with (
        pair() as (p, d),
        serve_engine(small_config()) as mixed,
        aiohttp.ClientSession() as http,
    ):
        # The decode half may come first: it waits for pages, then for the KV.
        streamed, (status, half) = await asyncio.gather(
            events(http, f"{d.url}/generate", body(p, 41, stream=True)),
            post(http, f"{p.url}/generate", body(p, 41)),
        )
        plain = {k: v for k, v in body(p, 0).items() if not k.startswith("bootstrap")}
        _, alone = await post(http, f"{mixed.url}/generate", plain)
        await until(lambda: idle(p) and idle(d))
        pd_metrics = await (await http.get(f"{p.url}/metrics")).text()
        async with http.get(f"{p.url}/v1/loads") as resp:
            loads = await resp.json()
        async with http.get(f"{d.url}/server_info") as resp:
            info = await resp.json()
    # The prefill half answers its one token once the KV has shipped.
    assert status == 200
    assert half["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(half["output_ids"]) == 1
    # The decode half streams every token, the prefill's first.
    last = streamed[-1]
    assert last["output_ids"] == alone["output_ids"]
    assert last["output_ids"][0] == half["output_ids"][0]
    assert streamed[0]["output_ids"] == half["output_ids"]
    meta = last["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 20)
    assert meta["finish_reason"] == {"type": "length", "length": 20}
    # Its prompt was imported into pages, not computed.
    assert d.engine.imported_tokens_total == len(PROMPT)
    assert d.engine.prompt_tokens_total == len(PROMPT)
    assert loads["loads"][0]["disaggregation"]["mode"] == "prefill"
    assert loads["loads"][0]["disaggregation"]["kv_transfer_speed_gb_s"] == 50.0
    assert 'sglang:kv_transfer_latency_ms_count{engine_type="prefill"' in pd_metrics
    assert (info["disaggregation_mode"], info["disaggregation_transfer_backend"]) == (
        "decode",
        "mooncake",
    )


async def test_the_decode_half_holds_its_pages_and_says_nothing_until_the_kv_lands() -> None:
    async with pair(kv_link_bytes_per_s=SLOW_LINK) as (p, d), aiohttp.ClientSession() as http:
        async with http.post(f"{d.url}/generate", json=body(p, 7, stream=True)) as resp:
            assert resp.status == 200
            prefill = asyncio.create_task(post(http, f"{p.url}/generate", body(p, 7)))
            await until(lambda: p.engine.loads().num_inflight_reqs == 1)
            # Both pools hold the prompt while it travels; the client has headers only.
            pages = -(-len(PROMPT) // 4)
            assert d.engine.loads().num_transfer_reqs == 1
            assert d.engine.kv.used_pages == pages
            assert p.engine.kv.used_pages == pages
            assert resp.content.at_eof() is False
            assert resp.content.is_eof() is False
            assert not resp.content._buffer
            first = await resp.content.readline()
            assert json.loads(first[6:])["meta_info"]["completion_tokens"] == 1
            rest = await resp.read()
        assert (await prefill)[0] == 200
    assert rest.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_an_abort_on_either_half_mid_transfer_frees_both_and_fails_the_other(
    where: str,
) -> None:
    async with pair(kv_link_bytes_per_s=STALLED_LINK) as (p, d), aiohttp.ClientSession() as http:
        halves = asyncio.gather(
            post(http, f"{p.url}/generate", body(p, 9, rid="pre")),
            post(http, f"{d.url}/generate", body(p, 9, rid="dec")),
        )
        await until(lambda: p.engine.loads().num_inflight_reqs == 1)
        engine, rid = (p, "pre") if where == "prefill" else (d, "dec")
        assert (await post(http, f"{engine.url}/abort_request", {"rid": rid}))[0] == 200
        (p_status, p_body), (d_status, d_body) = await halves
        await until(lambda: idle(p) and idle(d))
    (aborted_status, aborted), (failed_status, failed) = (
        ((p_status, p_body), (d_status, d_body))
        if where == "prefill"
        else ((d_status, d_body), (p_status, p_body))
    )
    assert aborted_status == 200
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    # The other half learns at once, and fails with SGLang's 500.
    assert failed_status == 500
    assert "transfer failed" in failed["message"]
    p.engine.check()
    d.engine.check()


async def test_a_decode_client_that_leaves_before_its_pages_frees_everything() -> None:
    """The decode pool is full: the handoff waits for pages, and the prefill half waits in
    its bootstrap queue without prefilling. The decode client leaving ends both."""
    async with (
        pair(max_total_tokens=1024) as (p, d),
        aiohttp.ClientSession() as http,
    ):
        hog = asyncio.create_task(
            post(
                http,
                f"{d.url}/generate",
                {**body(p, 0, n=900), "bootstrap_host": FAKE_BOOTSTRAP_HOST},
            )
        )
        await until(lambda: d.engine.decoding)
        prefill = asyncio.create_task(post(http, f"{p.url}/generate", body(p, 5, n=8)))
        decode = asyncio.create_task(post(http, f"{d.url}/generate", body(p, 5, n=8)))
        await until(lambda: d.engine.loads().num_prealloc_reqs == 1)
        await until(lambda: p.engine.loads().num_bootstrap_reqs == 1)
        assert p.engine.prompt_tokens_total == 0  # nothing prefilled into a queue
        decode.cancel()
        status, answer = await prefill
        hog.cancel()
        await until(lambda: idle(p) and idle(d))
    assert status == 500
    assert "the decode side went away" in answer["message"]
    assert p.engine.prompt_tokens_total == 0


async def test_a_prefill_engine_that_dies_mid_transfer_fails_its_decode_half() -> None:
    async with pair(kv_link_bytes_per_s=SLOW_LINK) as (p, d), aiohttp.ClientSession() as http:
        decode = asyncio.create_task(post(http, f"{d.url}/generate", body(p, 3)))
        prefill = asyncio.create_task(post(http, f"{p.url}/generate", body(p, 3)))
        await until(lambda: p.engine.loads().num_inflight_reqs == 1)
        await p.kill()
        status, answer = await decode
        prefill.cancel()
        await until(lambda: idle(d))
    assert status == 500
    assert "Decode transfer failed" in answer["message"]


async def test_a_half_without_its_peer_gives_up_after_the_bootstrap_timeout() -> None:
    async with pair(bootstrap_timeout_s=0.5) as (p, d), aiohttp.ClientSession() as http:
        (p_status, p_body), (d_status, d_body) = await asyncio.gather(
            post(http, f"{p.url}/generate", body(p, 1)),
            post(http, f"{d.url}/generate", body(p, 2)),  # another room: nobody prefills it
        )
        await until(lambda: idle(p) and idle(d))
        metrics = await (await http.get(f"{p.url}/metrics")).text()
    assert "Prefill bootstrap failed" in p_body["message"]
    assert "no prefill request for bootstrap_room 2" in d_body["message"]
    assert 'sglang:num_bootstrap_failed_reqs_total{engine_type="prefill"' in metrics
    assert (p_status, d_status) == (500, 500)


async def test_pd_engines_refuse_what_is_not_half_of_a_handoff() -> None:
    async with pair() as (p, d), aiohttp.ClientSession() as http:
        plain = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        for engine in (p, d):
            status, answer = await post(http, f"{engine.url}/generate", plain)
            assert status == 400
            assert "bootstrap_room" in answer["error"]["message"]
            for bad in ({"bootstrap_room": -1}, {"bootstrap_room": "x"}, {"bootstrap_port": 0},
                        {"bootstrap_host": ""}, {"bootstrap_room": [1, 2]}):  # fmt: skip
                status, _ = await post(http, f"{engine.url}/generate", {**body(p, 3), **bad})
                assert status == 400, bad
        # SGLang's fake bootstrap host: served alone, no peer, no transfer.
        fake = {**body(p, 0, n=3), "bootstrap_host": FAKE_BOOTSTRAP_HOST}
        for engine in (p, d):
            status, answer = await post(http, f"{engine.url}/v1/completions", {
                "prompt": PROMPT, "max_tokens": 3, **{k: v for k, v in fake.items() if k.startswith("bootstrap")},
            })  # fmt: skip
            assert status == 200
            assert answer["usage"]["completion_tokens"] == 3
        # A room has one prefill request at a time.
        first = asyncio.create_task(post(http, f"{p.url}/generate", body(p, 8)))
        await until(lambda: any(r.phase is Phase.BOOTSTRAP for r in p.engine.requests.values()))
        status, answer = await post(http, f"{p.url}/generate", body(p, 8))
        assert status == 400
        assert "already in use" in answer["error"]["message"]
        await post(http, f"{p.url}/abort_request", {"rid": "", "abort_all": True})
        await first
