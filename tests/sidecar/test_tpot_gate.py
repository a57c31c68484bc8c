"""The TPOT gate on a live sidecar in front of a real reference engine: with a TPOT
objective every prediction exceeds, its admission lets one prefill at a time into the
engine, each next request goes in when the one before streams its first token (not when
its wait runs out), and every stream ends with its natural finish and exact tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from controlplane.contract import SchedulingPolicy
from engine_sidecar.policy import TPOT_OBJECTIVE
from engine_sidecar.server import SidecarConfig, serve_sidecar
from fleetsim.server import serve_engine
from tests.sidecar.conftest import engine_config, pool_policy
from tests.sidecar.streams import read_sse

REQUESTS = 6
PROMPT = 600
MAX_NEW = 24
# Far below any TPOT an engine shows: the gate is shut whenever a prefill is pending. A
# request waits at most 30 s, far longer than the test: none may time out.
GATED = msgspec.structs.replace(
    pool_policy(),
    scheduling=SchedulingPolicy(target_tpot_s=1e-6, local_queue_max_wait_s=30.0),
)


async def _one(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, Any]:
    body = {
        "input_ids": [100 + i] * PROMPT,
        "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True},
        "stream": True,
    }
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.json()
        return 200, (await read_sse(resp)).events[-1]["meta_info"]


async def test_admission_lets_one_prefill_at_a_time_into_a_slow_engine() -> None:
    async with (
        serve_engine(engine_config(speed_factor=20.0)) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool="p", policy=GATED)) as sidecar,
    ):
        ledger = sidecar.service.ledger
        most_prefilling = 0
        gated: set[str] = set()
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal most_prefilling
            while not stop.is_set():
                prefilling = sum(1 for f in ledger.flights.values() if f.prefill)
                most_prefilling = max(most_prefilling, prefilling)
                for f in ledger.flights.values():
                    if f.admission is not None and f.admission.reason == TPOT_OBJECTIVE:
                        gated.add(f.rid)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(_one(http, sidecar.url, i) for i in range(REQUESTS)))
        stop.set()
        await watcher
        assert [status for status, _ in results] == [200] * REQUESTS, results
        for _, meta in results:
            assert meta["completion_tokens"] == MAX_NEW
            assert meta["finish_reason"]["type"] == "length"
        assert most_prefilling == 1
        assert gated, "the gate held no request back: the test proves nothing"
        assert (ledger.flights, ledger.own_used, ledger.reserved, ledger.queued) == ({}, 0, 0, 0)
        assert ledger.waiting_prefill == 0
        engine.engine.check()
