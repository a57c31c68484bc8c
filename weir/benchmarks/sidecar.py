"""`weir bench sidecar`: what the sidecar costs on the request path, and how fast it tells
the control plane about KV.

A reference engine serves in this process; the sidecar runs as its own process
(`weir sidecar`, as in a pod), so its CPU can be read from /proc. Figures, each against a
baseline measured in the same run:

- added time to first token: streaming `/generate` TTFT through the sidecar minus TTFT
  straight to the engine, requests alternating between the two (goal p50 ≤ 1 ms);
- CPU per streamed chunk: the sidecar process's CPU time over the chunks it relayed, with
  its idle CPU over the same wall time subtracted (goal ≤ 30 µs). Its baseline is the
  machine's floor: the same streams through a byte relay (`_byte_relay`, its own process
  in front of the same engine, forwarding bytes and nothing else), measured the same way
  in every run, relay and sidecar taking turns to go first. The absolute figure moves
  with the machine from day to day; the relay's figure, and the sidecar's above it (paired
  per run), say how much is the sidecar's own;
- KV change → publication: from sending a request whose prompt moves KV by more than 1 %
  until a Redis reader sees the endpoint's new `kv_used_tokens` (goal ≤ 100 ms); the
  baseline is one Redis round trip from the same reader.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "sidecar"
HELP = (
    "Sidecar overhead vs direct-to-engine: added TTFT, CPU per chunk (vs a byte relay), "
    "KV publish delay."
)

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class _Served(NamedTuple):
    """A process in front of the engine: where it serves, and its pid for /proc."""

    url: str
    pid: int


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser)
    parser.add_argument("--requests", type=int, default=30, help="TTFT probes per path per run")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams for CPU")
    parser.add_argument("--stream-tokens", type=int, default=400, help="tokens per stream")
    parser.add_argument("--probes", type=int, default=10, help="publication probes per run")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


async def _ttft(http: Any, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with http.post(url + "/generate", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data:"):
                elapsed = time.perf_counter() - start
                await resp.read()
                return elapsed
    raise RuntimeError("stream ended without a token")


async def _stream_chunks(http: Any, url: str, body: dict[str, Any]) -> int:
    chunks = 0
    async with http.post(url + "/generate", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data:"):
                chunks += 1
    return chunks


async def _cpu_per_chunk(
    http: Any, url: str, pid: int, body: dict[str, Any], streams: int
) -> float:
    """CPU seconds per streamed chunk of process `pid` serving `streams` concurrent streams
    at `url`, less its idle CPU rate over the same wall time."""
    idle_start, idle_cpu = time.perf_counter(), _cpu_s(pid)
    await asyncio.sleep(0.5)
    idle_rate = (_cpu_s(pid) - idle_cpu) / (time.perf_counter() - idle_start)
    start, cpu = time.perf_counter(), _cpu_s(pid)
    counts = await asyncio.gather(*(_stream_chunks(http, url, body) for _ in range(streams)))
    busy = _cpu_s(pid) - cpu - idle_rate * (time.perf_counter() - start)
    return max(0.0, busy) / max(1, sum(counts))


@asynccontextmanager
async def _process(*argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process for the block; terminated and reaped however the block ends."""
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def _publication(http: Any, registry: Any, url: str, prompt: str) -> float:
    """Seconds from sending a KV-moving request to a Redis reader seeing the change. The
    request decodes for long, and is cancelled once seen (which frees its KV again)."""
    await _until_published(registry, lambda used: used == 0)
    snap = await registry.snapshot()
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 20_000, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"probe refused: HTTP {resp.status} {await resp.text()}")
        while True:
            if snap.endpoints["bench-0"].kv_used_tokens >= len(prompt):
                seen = time.perf_counter() - start
                break
            await registry.wait_for_change(snap.position, 1000)
            snap = await registry.snapshot()
        resp.close()
    return seen


async def _until_published(registry: Any, check: Any) -> None:
    """Wait, on the change feed, until the endpoint's published state satisfies `check`."""
    while True:
        snap = await registry.snapshot()
        state = snap.endpoints.get("bench-0")
        if state is not None and check(state.kv_used_tokens):
            return
        await registry.wait_for_change(snap.position, 1000)


async def _bench(args: argparse.Namespace, report: Report) -> None:
    import aiohttp

    from controlplane.store import EndpointRegistry, RedisSettings, connect
    from fleetsim.engine import EngineConfig
    from fleetsim.server import serve_engine
    from weir.local.ports import free_port, wait_for_port
    from weir.local.redis_server import RedisServer

    # Terminated, the benchmark unwinds as when interrupted, so its child processes end too.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    config = EngineConfig(model="bench/model", max_total_tokens=262_144, speed_factor=100.0)
    port, relay_port = free_port(), free_port()
    with RedisServer() as redis_server:
        async with serve_engine(config) as engine:
            sidecar_argv = (
                "-m", "weir.cli", "sidecar",
                "--engine-url", engine.url, "--port", str(port),
                "--redis-url", redis_server.url, "--pool", "bench",
                "--endpoint-id", "bench-0", "--heartbeat-s", "1", "--log-level", "WARNING",
            )  # fmt: skip
            relay_argv = (
                "-m", "weir.benchmarks._byte_relay",
                "--port", str(relay_port), "--upstream", engine.url.removeprefix("http://"),
            )  # fmt: skip
            async with _process(*sidecar_argv) as sidecar, _process(*relay_argv) as relay:
                redis = connect(RedisSettings(url=redis_server.url))
                try:
                    for p in (port, relay_port):
                        await asyncio.to_thread(wait_for_port, p, "127.0.0.1", 60.0)
                    registry = EndpointRegistry(redis, "bench")
                    await _until_published(registry, lambda used: True)
                    async with aiohttp.ClientSession() as http:
                        await _runs(
                            args, report, http, engine.url,
                            _Served(f"http://127.0.0.1:{port}", sidecar.pid),
                            _Served(f"http://127.0.0.1:{relay_port}", relay.pid),
                            registry,
                        )  # fmt: skip
                finally:
                    await redis.aclose()


async def _runs(
    args: argparse.Namespace,
    report: Report,
    http: Any,
    engine_url: str,
    sidecar: _Served,
    relay: _Served,
    registry: Any,
) -> None:
    ttft_body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}, "stream": True}
    stream_body = {
        "text": "stream",
        "sampling_params": {"max_new_tokens": args.stream_tokens, "ignore_eos": True},
        "stream": True,
    }
    for url in (engine_url, sidecar.url, relay.url):  # warm connections and caches
        await _ttft(http, url, ttft_body)
    added: list[float] = []
    direct: list[float] = []
    cpu_per_chunk: list[float] = []
    relay_per_chunk: list[float] = []
    above_relay: list[float] = []
    publish: list[float] = []
    round_trip: list[float] = []
    prompt = "kv " * 1200  # 3600 byte tokens: > 1 % of capacity
    for i in range(args.runs):
        d, s = [], []
        for _ in range(args.requests):
            d.append(await _ttft(http, engine_url, ttft_body))
            s.append(await _ttft(http, sidecar.url, ttft_body))
        direct.append(statistics.median(d))
        added.append(statistics.median(s) - statistics.median(d))
        # Relay and sidecar take turns going first, so neither always meets a warmer machine.
        cpu: dict[_Served, float] = {}
        for served in (relay, sidecar) if i % 2 == 0 else (sidecar, relay):
            cpu[served] = await _cpu_per_chunk(
                http, served.url, served.pid, stream_body, args.streams
            )
        cpu_per_chunk.append(cpu[sidecar])
        relay_per_chunk.append(cpu[relay])
        above_relay.append(cpu[sidecar] - cpu[relay])
        for _ in range(args.probes):
            publish.append(await _publication(http, registry, sidecar.url, prompt))
            start = time.perf_counter()
            await registry.snapshot()
            round_trip.append(time.perf_counter() - start)
    ms, us = 1e3, 1e6
    med, p99 = median_p99(added)
    report.add(Figure("added TTFT", med * ms, "ms", p99 * ms, "p50 ≤ 1 ms", med * ms <= 1.0,
                      note=f"direct-to-engine TTFT p50 {statistics.median(direct) * ms:.2f} ms"))  # fmt: skip
    med, p99 = median_p99(cpu_per_chunk)
    floor, floor_p99 = median_p99(relay_per_chunk)
    above, above_p99 = median_p99(above_relay)
    note = f"{above * us:+.0f} µs above the byte relay"
    if floor > 0:
        note = f"{med / floor:.1f}× the byte relay; {above * us:+.0f} µs above it"
    report.add(Figure("CPU per streamed chunk", med * us, "µs", p99 * us, "≤ 30 µs",
                      med * us <= 30, note=note))  # fmt: skip
    report.add(Figure("byte relay CPU per chunk (floor)", floor * us, "µs", floor_p99 * us))
    report.add(Figure("CPU per chunk above the byte relay", above * us, "µs", above_p99 * us))
    med, p99 = median_p99(publish)
    rt, _ = median_p99(round_trip)
    report.add(Figure("KV change → publication", med * ms, "ms", p99 * ms, "≤ 100 ms",
                      med * ms <= 100, note=f"baseline Redis snapshot read {rt * ms:.2f} ms"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    report = Report(
        NAME,
        params={
            "runs": args.runs,
            "requests": args.requests,
            "streams": args.streams,
            "stream_tokens": args.stream_tokens,
            "probes": args.probes,
        },
    )
    try:
        asyncio.run(_bench(args, report))
    except asyncio.CancelledError:  # by SIGTERM
        return 128 + signal.SIGTERM
    report.emit(args.json)
    return 0
