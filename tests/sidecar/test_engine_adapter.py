"""The SGLang adapter against both protocol versions of the reference engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from engine_sidecar.engine import (
    EngineError,
    SGLangEngine,
    StreamEvent,
    copy_bandwidth,
    pool_bytes_per_token,
)
from engine_sidecar.server import _engine_info
from fleetsim.server import serve_engine
from tests.sidecar.conftest import MODEL, engine_config

CAPTURES = Path(__file__).parent.parent / "sglang" / "captures"


@pytest.mark.parametrize(("version", "loads_api"), [("0.5.5", "get_load"), ("0.5.23", "v1_loads")])
async def test_detects_the_version_and_uses_its_endpoints(version: str, loads_api: str) -> None:
    async with serve_engine(engine_config(speed_factor=4.0), api_version=version) as running:
        engine = SGLangEngine(running.url)
        try:
            info = await engine.server_info()
            assert (info.version, info.loads_api, info.model) == (version, loads_api, MODEL)
            assert info.kv_capacity_tokens == 8192
            body = {
                "text": "load me",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True,
                "rid": "weir-adapter-test-rid-0001",
            }
            async with engine.open("/generate", body) as stream:
                assert stream.status == 200
                events: list[StreamEvent] = []

                def take(batch: list[StreamEvent], stop: bool) -> bool:
                    events.extend(batch)
                    return stop

                await stream.push(lambda batch: take(batch, True))  # the first read only
                load = await engine.load()
                assert load.running_requests == 1
                assert load.used_tokens > 0
                await engine.abort("weir-adapter-test-rid-0001")
                await stream.push(lambda batch: take(batch, False))  # to the end
            last = msgspec.json.decode([e for e in events if not e.done][-1].data)
            assert last["meta_info"]["finish_reason"]["type"] == "abort"
            await engine.pause()
            await engine.resume()
            assert (await engine.load()).running_requests == 0
        finally:
            await engine.close()


async def test_an_engine_that_is_not_there_is_an_engine_error() -> None:
    engine = SGLangEngine("http://127.0.0.1:9")
    try:
        with pytest.raises(EngineError):
            await engine.server_info()
        with pytest.raises(EngineError):
            await engine.abort("weir-nobody")
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("flags", "tokens"),
    [
        ({}, 0),
        ({"enable_hierarchical_cache": True}, 16384),  # --hicache-ratio 2 of 8,192
        ({"enable_hierarchical_cache": True, "hicache_ratio": 0.5}, 4096),
        ({"enable_hierarchical_cache": True, "hicache_size": 1}, int(1e9 // 131072)),
    ],
)
async def test_the_host_tier_is_read_from_server_info(
    flags: dict[str, object], tokens: int
) -> None:
    async with serve_engine(engine_config(**flags)) as running:
        engine = SGLangEngine(running.url)
        try:
            info = await engine.server_info()
        finally:
            await engine.close()
    assert info.host_tier_tokens(kv_bytes_per_token=131072) == tokens


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def testpool_bytes_per_token_is_read_where_the_pool_s_size_is_precise_enough(
    version: str,
) -> None:
    """SGLang reports the KV pool in GB to 3 decimals: a 1 MB pool (the captured test
    servers') says nothing usable, a pool of GBs says its bytes a token."""
    captured = json.loads((CAPTURES / version / "get_server_info.json").read_text())["body"]
    assert pool_bytes_per_token(captured) == 0
    usage = {"kvcache": 6.554, "token_capacity": 20_000}
    assert pool_bytes_per_token({"memory_usage": usage}) == 327_700
    assert pool_bytes_per_token({"internal_states": [{"memory_usage": usage}]}) == 327_700


def test_the_host_bandwidth_is_each_rank_s_bytes_over_its_copy_time() -> None:
    """SGLang 0.5.23's families: bytes moved and copy time, both directions, per rank;
    the ranks copy their shards side by side, so their bandwidths average."""
    rank = 'cache_type="HiRadixCache",tp_rank="{r}",pp_rank="0",dp_rank="0"'
    lines = []
    for r, (nbytes, seconds) in enumerate(((4e9, 0.5), (2e9, 0.25))):
        labels = rank.format(r=r)
        lines += [
            f"sglang:load_back_bytes_total{{{labels}}} {nbytes / 2}",
            f"sglang:hicache_backup_bytes_total{{{labels}}} {nbytes / 2}",
            f"sglang:load_back_duration_seconds_sum{{{labels}}} {seconds / 2}",
            f"sglang:load_back_duration_seconds_count{{{labels}}} 3",
            f"sglang:hicache_backup_duration_seconds_sum{{{labels}}} {seconds / 2}",
            f"sglang:evicted_tokens_total{{{labels}}} 99",
        ]
    assert copy_bandwidth("\n".join(lines) + "\n") == pytest.approx(8e9)
    assert copy_bandwidth("sglang:num_running_reqs 3\n") == 0.0  # 0.5.5: none timed


async def test_an_engine_that_holds_its_server_info_unanswered_is_asked_again() -> None:
    """SGLang can accept the request and hold it while it warms up (or for good, when a
    warmup stalls): the sidecar asks again rather than wait on the one request, and gives
    up with an engine error at its deadline instead of hanging."""
    held = asyncio.Event()  # never set: an ask it holds stays unanswered
    asked, holding = 0, 1  # how many asks it holds: the first, then (0) none or (-1) all

    async def server_info(_request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked <= holding or holding < 0:
            await held.wait()
        return web.json_response(
            {"version": "0.5.23", "served_model_name": MODEL, "max_total_num_tokens": 1000}
        )

    async def loads(_request: web.Request) -> web.Response:
        return web.json_response({"loads": []})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/loads", loads)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine = SGLangEngine(f"http://127.0.0.1:{port}")
    try:
        info = await _engine_info(engine, wait_s=30.0, ask_s=0.3)
        assert (info.model, info.kv_capacity_tokens, asked) == (MODEL, 1000, 2)
        holding = -1  # and one that never answers: refused at the deadline, not hung on
        with pytest.raises(EngineError, match=r"no server info within 0\.5 s"):
            await _engine_info(engine, wait_s=0.5, ask_s=0.3)
    finally:
        held.set()  # the held handlers end: the server's shutdown does not wait on them
        await engine.close()
        await runner.cleanup()
