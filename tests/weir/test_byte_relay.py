"""The byte relay `weir bench sidecar` measures as its floor, against the real reference
engine, and the benchmark's report of it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from fleetsim.engine import EngineConfig
from fleetsim.server import serve_engine
from weir.local.ports import free_port, wait_for_port

# No prefix cache: a repeated request reports no cached tokens, so its events repeat too.
CONFIG = EngineConfig(
    model="m", max_total_tokens=8192, speed_factor=200.0, disable_radix_cache=True
)
BODY = {
    "text": "relay me",
    "rid": "byte-relay-test",
    "sampling_params": {"max_new_tokens": 12},
    "stream": True,
}


@asynccontextmanager
async def byte_relay(upstream: str) -> AsyncIterator[str]:
    """The relay as its own process in front of `upstream`; asserts it exits cleanly on
    SIGTERM."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.benchmarks._byte_relay",
        "--port", str(port), "--upstream", upstream.removeprefix("http://"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_for_port, port, "127.0.0.1", 30.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, err = await proc.communicate()
    assert (proc.returncode, out, err) == (0, b"", b"")


async def sse_events(http: aiohttp.ClientSession, url: str) -> list[Any]:
    """The `data:` events of a streamed /generate, decoded, less the engine's measured
    `e2e_latency` (a clock reading, not part of what the engine decided)."""
    events: list[Any] = []
    async with http.post(url + "/generate", json=BODY) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data:"):
                data = line.removeprefix(b"data:").strip()
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    for event in events:  # what the clock says differs from one request to the next
        if isinstance(event, dict):
            meta = event["meta_info"]
            for key in [k for k in meta if k.endswith(("_time", "_ts", "_latency", "_throughput"))]:
                del meta[key]
    return events


async def test_a_stream_through_the_relay_is_the_engines_own_and_keeps_its_connection() -> None:
    opened, reused = [], []
    trace = aiohttp.TraceConfig()

    async def on_create(_: Any, __: SimpleNamespace, params: Any) -> None:
        opened.append(params)

    async def on_reuse(_: Any, __: SimpleNamespace, params: Any) -> None:
        reused.append(params)

    trace.on_connection_create_end.append(on_create)
    trace.on_connection_reuseconn.append(on_reuse)
    async with (
        serve_engine(CONFIG) as engine,
        byte_relay(engine.url) as relay,
        aiohttp.ClientSession() as direct,
        aiohttp.ClientSession(trace_configs=[trace]) as relayed,
    ):
        expected = await sse_events(direct, engine.url)
        first = await sse_events(relayed, relay)
        second = await sse_events(relayed, relay)
    assert expected[-1] == "[DONE]"
    assert expected[-2]["meta_info"]["completion_tokens"] == 12
    assert first == expected
    assert second == expected
    assert (len(opened), len(reused)) == (1, 1)  # the second request rode the first's socket


def test_bench_sidecar_reports_the_byte_relay_floor() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weir.cli", "bench", "sidecar", "--runs", "1", "--requests", "2",
         "--streams", "2", "--stream-tokens", "20", "--probes", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    floor = figures["byte relay CPU per chunk (floor)"]
    above = figures["CPU per chunk above the byte relay"]
    sidecar = figures["CPU per streamed chunk"]
    assert (floor["unit"], floor["goal"], floor["met"]) == ("µs", "", None)
    assert (above["unit"], above["goal"], above["met"]) == ("µs", "", None)
    assert above["value"] == pytest.approx(sidecar["value"] - floor["value"])  # one run, one pair
    assert sidecar["goal"] == "≤ 30 µs"
    assert "above" in sidecar["note"]
