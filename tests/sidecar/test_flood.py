"""A flood of long outputs: the watermark rises, admission stops and relief preempts
before the engine runs out of KV, so the engine never has to retract on its own."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from controlplane.contract import WatermarkState
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine, serve_engine
from tests.sidecar.conftest import engine_config, pool_policy
from tests.sidecar.streams import read_sse

REQUESTS = 24
MAX_NEW = 500
# A 15 % emergency band: room for the relief loop to act on a loaded test machine before
# the engine itself would run out (the policy's thresholds, not a timing assumption).
FLOOD_POLICY = pool_policy(low_watermark=0.6, high_watermark=0.75, emergency_watermark=0.85)


async def _one(
    http: aiohttp.ClientSession, url: str, i: int, declared: bool = True
) -> tuple[int, Any]:
    """One long answer: `declared` fixed-length (ignore_eos), else one that only cannot
    stop early (min_new_tokens), whose growth SGLang's admission discounts."""
    fixed = {"ignore_eos": True} if declared else {"min_new_tokens": MAX_NEW}
    body = {
        "text": f"request {i}: write at length about weirs and rivers",
        "sampling_params": {"max_new_tokens": MAX_NEW, **fixed},
        "stream": True,
    }
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.json()
        last = (await read_sse(resp)).events[-1]
        return (200, last["meta_info"]) if "meta_info" in last else (500, last)


async def _flood(engine: RunningEngine, sidecar: RunningSidecar) -> tuple[list[Any], int]:
    peak = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sidecar.service.ledger.watermark.rank)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(_one(http, sidecar.url, i) for i in range(REQUESTS)))
    stop.set()
    await watcher
    return results, peak


async def test_flood_of_long_outputs_never_exhausts_the_engine() -> None:
    # The same flood straight at an engine overflows its KV: it retracts. (SGLang 0.5.23
    # reserves an ignore_eos request's whole output, so this flood's requests only cannot
    # stop early, and arrive a step apart: admission counts the running ones' growth at
    # the new-token ratio and admits more than fits.)
    async with serve_engine(engine_config(speed_factor=4.0)) as bare:

        async def arriving(http: aiohttp.ClientSession, i: int) -> tuple[int, Any]:
            while bare.engine.steps < i:  # noqa: ASYNC110 - the engine has no step event
                await asyncio.sleep(0.001)
            return await _one(http, bare.url, i, declared=False)

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(arriving(http, i) for i in range(REQUESTS)))
        assert bare.engine.retracted_total > 0
    async with (
        # Slower decode steps than the bare run: the relief loop shares a loaded test
        # machine's CPU with the engine, the clients and the other tests.
        serve_engine(engine_config(speed_factor=2.0)) as engine,
        serve_sidecar(
            SidecarConfig(engine_url=engine.url, pool="p", policy=FLOOD_POLICY)
        ) as sidecar,
    ):
        results, peak = await _flood(engine, sidecar)
        stats = (sidecar.service.ledger.preemptions, [r[0] for r in results])
        assert engine.engine.retracted_total == 0, stats
        assert peak >= WatermarkState.CRITICAL.rank
        finished = [meta for status, meta in results if status == 200]
        refused = [body for status, body in results if status != 200]
        assert all(body["error"]["type"] == "overload" for body in refused), refused
        assert finished, "some requests must complete"
        for meta in finished:
            assert meta["completion_tokens"] == MAX_NEW
            assert meta["finish_reason"]["type"] == "length"
        ledger = sidecar.service.ledger
        assert (ledger.flights, ledger.own_used, ledger.reserved, ledger.queued) == ({}, 0, 0, 0)
        assert ledger.preemptions > 0 or refused  # relief or admission had to act
        engine.engine.check()
