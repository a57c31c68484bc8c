"""`weir bench sidecar`: what the sidecar costs on the request path, and how fast it tells
the control plane about KV.

The engine is the reference engine, served in this process, or with `--engine sglang`
SGLang's own server (`launch_server`, a process group of its own), or one already serving
at `--engine-url` (nothing else should use it while the benchmark runs). The sidecar runs as its
own process (`weir sidecar`, as in a pod), so its CPU time can be read on its own. Figures,
each against a baseline measured in the same run:

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

The workload fits the engine's KV pool (`max_total_num_tokens` from its server info): the
concurrent streams hold at most a quarter of it, and the probe's prompt a tenth, counted by
the engine's own tokenizer. The reference engine's pool holds the defaults; SGLang's in the
CPU tests (4,096 tokens) cuts the streams to 64 tokens, which also keeps a run short there
(its CPU engine decodes about a hundred tokens a second on two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99
from weir.local.sglang_flags import add_sglang_flags

NAME = "sidecar"
HELP = (
    "Sidecar overhead vs direct-to-engine: added TTFT, CPU per chunk (vs a byte relay), "
    "KV publish delay."
)

# A process's CPU-time clock, as clock_getcpuclockid(3) makes it on Linux (Python has no
# binding): nanoseconds, where /proc's utime and stime count 10 ms ticks.
_PROCESS_CPU_CLOCK = 2
# The idle window: one whole heartbeat (the sidecar's --heartbeat-s 1) and two engine polls
# (every 0.5 s), so it holds the sidecar's periodic work in proportion.
_IDLE_WINDOW_S = 1.0
# The publication probe's sizes where the KV pool allows them (the reference engine's):
# 3,600 tokens move its 262,144 by 1.4 %, over the 1 % at which the sidecar publishes.
_PROBE_TOKENS = 3600
_PROBE_MAX_NEW_TOKENS = 20_000


class _Served(NamedTuple):
    """A process in front of the engine: where it serves, and its pid for /proc."""

    url: str
    pid: int


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser)
    add = parser.add_argument
    add("--requests", type=int, default=30, help="TTFT probes per path per run")
    add("--streams", type=int, default=16, help="concurrent streams for CPU")
    add("--stream-tokens", type=int, default=400,
        help="tokens per stream (fewer where the streams would hold over a quarter of "
             "the engine's KV pool)")  # fmt: skip
    add("--probes", type=int, default=10, help="publication probes per run")
    add("--engine", choices=("reference", "sglang"), default="reference",
        help="the engine measured in front of: the reference engine, or SGLang's server")  # fmt: skip
    add("--model", default="", help="with --engine sglang: the weights' path")
    add("--engine-url", default="",
        help="measure in front of this engine, already serving, instead of starting one "
             "(--engine says which kind it is)")  # fmt: skip
    add_sglang_flags(
        parser,
        startup_timeout_s=300.0,
        startup_help="with --engine sglang: how long its server may take to become healthy",
    )


def _cpu_s(pid: int) -> float:
    """CPU seconds used by process `pid`, all its threads together."""
    return time.clock_gettime((~pid << 3) | _PROCESS_CPU_CLOCK)


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
    await asyncio.sleep(_IDLE_WINDOW_S)
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


async def _publication(
    http: Any, registry: Any, url: str, body: dict[str, Any], tokens: int
) -> float:
    """Seconds from sending a KV-moving request (a prompt of `tokens` tokens) to a Redis
    reader seeing the change. The reader watches from the moment the request is sent: the
    response's headers come with the engine's first token, which a slow engine sends long
    after the sidecar published. The request decodes for long, and is cancelled once seen
    (which frees its KV again)."""
    await _until_published(registry, lambda used: used == 0)
    start = time.perf_counter()
    sent = asyncio.create_task(_send(http, url, body))
    try:
        used = await _until_published(registry, lambda used: used >= tokens or sent.done())
        seen = time.perf_counter() - start
        if used < tokens:
            sent.result()  # raises the refusal, if that is why it ended
            raise RuntimeError("the probe ended before its KV was published")
    finally:
        sent.cancel()
        await asyncio.wait({sent})
    return seen


async def _send(http: Any, url: str, body: dict[str, Any]) -> None:
    """A `/generate` request, read to its end."""
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"probe refused: HTTP {resp.status} {await resp.text()}")
        await resp.read()


async def _until_published(registry: Any, check: Callable[[int], bool]) -> int:
    """Wait, on the change feed, until the endpoint's published KV in use satisfies
    `check`; returns it."""
    while True:
        snap = await registry.snapshot()
        state = snap.endpoints.get("bench-0")
        if state is not None and check(state.kv_used_tokens):
            used: int = state.kv_used_tokens
            return used
        await registry.wait_for_change(snap.position, 1000)


class _Workload(NamedTuple):
    """What the runs send, sized to the engine's KV pool."""

    engine: str  # which engine, for the report
    ttft: dict[str, Any]
    stream: dict[str, Any]
    probe: dict[str, Any]
    probe_tokens: int  # the probe's prompt, as the engine's tokenizer counts it


async def _prompt_tokens(http: Any, engine_url: str, text: str) -> int:
    """`text`'s length in tokens, as the engine's tokenizer counts it."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(engine_url + "/generate", json=body) as resp:
        reply = await resp.json()
    return int(reply["meta_info"]["prompt_tokens"])


async def _workload(
    args: argparse.Namespace, report: Report, http: Any, engine_url: str
) -> _Workload:
    """The workload for this engine's KV pool, its sizes added to the report's parameters:
    the streams hold at most a quarter of the pool, and the probe's prompt a tenth (or
    _PROBE_TOKENS), found by scaling a first guess (a token a byte) to the engine's count."""
    async with http.get(engine_url + "/get_server_info") as resp:
        info = await resp.json()
    capacity = int(info["max_total_num_tokens"])
    stream_tokens = max(1, min(args.stream_tokens, capacity // (4 * args.streams)))
    target = min(_PROBE_TOKENS, capacity // 10)
    guess = max(1, target // len("kv "))
    repeats = max(1, guess * target // await _prompt_tokens(http, engine_url, "kv " * guess))
    prompt = "kv " * repeats
    probe_tokens = await _prompt_tokens(http, engine_url, prompt)
    engine = "reference" if args.engine == "reference" else f"SGLang {info.get('version')}"
    report.params.update(engine=engine, kv_capacity_tokens=capacity,
                         stream_tokens=stream_tokens, probe_tokens=probe_tokens)  # fmt: skip
    return _Workload(
        engine=engine,
        ttft={"text": "hello", "sampling_params": {"max_new_tokens": 2}, "stream": True},
        stream={
            "text": "stream",
            "sampling_params": {"max_new_tokens": stream_tokens, "ignore_eos": True},
            "stream": True,
        },
        probe={
            "text": prompt,
            "sampling_params": {
                "max_new_tokens": min(_PROBE_MAX_NEW_TOKENS, capacity // 4),
                "ignore_eos": True,
            },
            "stream": True,
        },
        probe_tokens=probe_tokens,
    )


@asynccontextmanager
async def _engine(args: argparse.Namespace) -> AsyncIterator[str]:
    """The measured engine's URL for the block."""
    if args.engine_url:
        yield args.engine_url.rstrip("/")
        return
    if args.engine == "sglang":
        from weir.local.sglang import serve_sglang

        async with serve_sglang(
            args.sglang_python, args.model, args.engine_args, args.startup_timeout_s
        ) as url:
            yield url
        return
    from fleetsim.engine import EngineConfig
    from fleetsim.server import serve_engine

    config = EngineConfig(model="bench/model", max_total_tokens=262_144, speed_factor=100.0)
    async with serve_engine(config) as engine:
        yield engine.url


async def _bench(args: argparse.Namespace, report: Report) -> None:
    import aiohttp

    from controlplane.store import EndpointRegistry, RedisSettings, connect
    from weir.local.ports import free_port, wait_for_port
    from weir.local.redis_server import RedisServer

    # Terminated, the benchmark unwinds as when interrupted, so its child processes end too.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    port, relay_port = free_port(), free_port()
    with RedisServer() as redis_server:
        async with _engine(args) as engine_url:
            sidecar_argv = (
                "-m", "weir.cli", "sidecar",
                "--engine-url", engine_url, "--port", str(port),
                "--redis-url", redis_server.url, "--pool", "bench",
                "--endpoint-id", "bench-0", "--heartbeat-s", "1", "--log-level", "WARNING",
            )  # fmt: skip
            relay_argv = (
                "-m", "weir.benchmarks._byte_relay",
                "--port", str(relay_port), "--upstream", engine_url.removeprefix("http://"),
            )  # fmt: skip
            async with _process(*sidecar_argv) as sidecar, _process(*relay_argv) as relay:
                redis = connect(RedisSettings(url=redis_server.url))
                try:
                    for p in (port, relay_port):
                        await asyncio.to_thread(wait_for_port, p, "127.0.0.1", 60.0)
                    registry = EndpointRegistry(redis, "bench")
                    await _until_published(registry, lambda used: True)
                    async with aiohttp.ClientSession() as http:
                        work = await _workload(args, report, http, engine_url)
                        await _runs(
                            args, report, http, work, engine_url,
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
    work: _Workload,
    engine_url: str,
    sidecar: _Served,
    relay: _Served,
    registry: Any,
) -> None:
    for url in (engine_url, sidecar.url, relay.url):  # warm connections and caches
        await _ttft(http, url, work.ttft)
    added: list[float] = []
    direct: list[float] = []
    cpu_per_chunk: list[float] = []
    relay_per_chunk: list[float] = []
    above_relay: list[float] = []
    publish: list[float] = []
    round_trip: list[float] = []
    for i in range(args.runs):
        d, s = [], []
        for _ in range(args.requests):
            d.append(await _ttft(http, engine_url, work.ttft))
            s.append(await _ttft(http, sidecar.url, work.ttft))
        direct.append(statistics.median(d))
        added.append(statistics.median(s) - statistics.median(d))
        # Relay and sidecar take turns going first, so neither always meets a warmer machine.
        cpu: dict[_Served, float] = {}
        for served in (relay, sidecar) if i % 2 == 0 else (sidecar, relay):
            cpu[served] = await _cpu_per_chunk(
                http, served.url, served.pid, work.stream, args.streams
            )
        cpu_per_chunk.append(cpu[sidecar])
        relay_per_chunk.append(cpu[relay])
        above_relay.append(cpu[sidecar] - cpu[relay])
        for _ in range(args.probes):
            publish.append(
                await _publication(http, registry, sidecar.url, work.probe, work.probe_tokens)
            )
            start = time.perf_counter()
            await registry.snapshot()
            round_trip.append(time.perf_counter() - start)
    ms, us = 1e3, 1e6
    med, p99 = median_p99(added)
    direct_ms = statistics.median(direct) * ms
    report.add(Figure("added TTFT", med * ms, "ms", p99 * ms, "p50 ≤ 1 ms", med * ms <= 1.0,
                      note=f"direct-to-engine TTFT p50 {direct_ms:.2f} ms ({work.engine})"))  # fmt: skip
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


def _refuse(message: str) -> int:
    sys.stderr.write(f"weir bench sidecar: {message}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    from weir.local.sglang import SGLangStartError, check_launch

    if args.engine_url:
        if args.model or args.sglang_python or args.engine_args:
            return _refuse("--engine-url measures an engine already serving: it takes no "
                           "--model, --sglang-python or --engine-arg")  # fmt: skip
        # The byte relay baseline speaks plain HTTP to host:port, as the sidecar in a pod does.
        if not args.engine_url.startswith("http://"):
            return _refuse(f"--engine-url must be an http:// URL, not {args.engine_url!r}")
    elif args.engine == "sglang":
        try:
            check_launch(args.sglang_python, args.model)
        except ValueError as exc:
            return _refuse(str(exc))
    elif args.model or args.sglang_python or args.engine_args:
        return _refuse("--model, --sglang-python and --engine-arg go with --engine sglang")
    report = Report(
        NAME,
        params={
            "engine": args.engine,
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
    except SGLangStartError as exc:
        sys.stderr.write(f"weir bench sidecar: {exc}\n")
        return 1
    report.emit(args.json)
    return 0
