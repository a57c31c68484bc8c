"""`weir bench router`: how fast the router decides, and what it adds to a stream.

1. Decision latency over a 1,000-endpoint snapshot (goal: p99 <= 50 µs in-process) and
   decisions per second on one core: the default profile (all filters, every cost-model
   scorer) over a seeded pool with mixed load, watermarks and a warm prefix index.
2. Reading a streamed `/generate` event, 64 and 4,000 tokens into a stream: its events
   are cumulative (every event carries the whole output so far), so the router reads
   their counts only; the read must cost the same however long the output (goal: the
   4,000-token read within 2× the 64-token one). And an OpenAI chunk carrying the usage
   the router asks for (its token count), which it takes out for a client that did not
   ask for it.
3. The engine-stream HTTP client's CPU per network read, decoded and cut through, against
   llhttp alone on the same reads and, with `--http-baseline FILE`, another version of
   the client (`weir.benchmarks._http_reads`).
4. Proxied streaming: reference engines and a router run as subprocesses (`weir engine`,
   `weir router`); the same streamed requests go direct to an engine and through the
   router, alternating, so the added time to first token (goal: p50 <= 1 ms) and the
   streaming throughput are measured against a baseline from the same run.
5. With `--quota-streams N`: N streams opened at once through a router with tenant quotas
   on (its own redis-server, the engine registered there, one tenant allowed N at once),
   held together, and counted: each admission is a quota charge in Redis at the same
   moment as the others', so this is where a Redis client that runs out of connections
   shows (goal: all N held, no 503).
5. With `--routers N`: the same traffic through one router and through N side by side on
   a local fleet, and the endpoints' load under each (`weir.benchmarks._replicas`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from weir.benchmarks import _replicas
from weir.benchmarks._http_reads import http_reads
from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "router"
HELP = "Routing decision latency, decisions/s per core, and proxied streaming overhead."


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser)
    parser.add_argument("--endpoints", type=int, default=1000, help="endpoints in the snapshot")
    parser.add_argument("--decisions", type=int, default=20_000, help="routing decisions per run")
    parser.add_argument(
        "--streams", type=int, default=40, help="streamed requests per path per run"
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument(
        "--skip-proxy",
        action="store_true",
        help="measure in-process figures only (no subprocesses)",
    )
    parser.add_argument(
        "--http-baseline", metavar="FILE", default="",
        help="another version of controlplane/transport/http.py (git show "
             "REV:controlplane/transport/http.py > FILE), read for read against this one",
    )  # fmt: skip
    parser.add_argument(
        "--quota-streams", type=int, default=0, metavar="N",
        help="also open N streams at once through a router with tenant quotas on (a "
             "redis-server of its own) and count how many it holds; 0 skips it",
    )  # fmt: skip
    _replicas.add_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.endpoints < 1 or args.decisions < 1 or args.runs < 1:
        raise SystemExit("--endpoints, --decisions and --runs must be positive")
    if args.quota_streams < 0:
        raise SystemExit("--quota-streams must not be negative")
    _replicas.check_flags(args)
    report = Report(
        NAME,
        params={
            "endpoints": args.endpoints,
            "decisions": args.decisions,
            "runs": args.runs,
            "streams": 0 if args.skip_proxy else args.streams,
            "tokens": args.tokens,
            "quota_streams": args.quota_streams,
            "routers": args.routers,
            **(_replicas.params(args) if args.routers else {}),
            # Latency figures from a shared machine are only comparable at similar load.
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        },
    )
    _decisions(report, args)
    _event_reads(report, args)
    http_reads(report, args.runs, args.http_baseline)
    if not args.skip_proxy:
        asyncio.run(_proxy(report, args))
    if args.quota_streams:
        asyncio.run(_quota_streams(report, args.quota_streams))
    if args.routers:
        asyncio.run(_replicas.replicas(report, args))
    report.emit(args.json)
    return 0


def _decisions(report: Report, args: argparse.Namespace) -> None:
    from controlplane.contract import EndpointState, WatermarkState
    from controlplane.routing import (
        PoolSnapshot,
        PrefixIndex,
        RouteRequest,
        RoutingContext,
        default_config,
        profile_from_config,
    )

    rng = random.Random(7)
    marks = [WatermarkState.NORMAL] * 8 + [WatermarkState.PRESSURE, WatermarkState.CRITICAL]
    states = [
        EndpointState(
            pool="bench",
            endpoint_id=f"ep-{i:05d}",
            address=f"http://10.0.{i // 250}.{i % 250}:8000",
            model="m",
            watermark=rng.choice(marks),
            kv_capacity_tokens=500_000,
            kv_used_tokens=rng.randrange(0, 400_000),
            kv_reserved_growth_tokens=rng.randrange(0, 50_000),
            waiting_prefill_tokens=rng.randrange(0, 20_000),
            running_requests=rng.randrange(0, 64),
            queued_requests=rng.randrange(0, 8),
            predicted_ttft_s=rng.uniform(0.05, 0.5),
            predicted_tpot_s=rng.uniform(0.01, 0.04),
        )
        for i in range(args.endpoints)
    ]
    snapshot = PoolSnapshot.of("bench", states, lease_deadline=1e12)
    ids = [s.endpoint_id for s in states]
    index = PrefixIndex()
    prefixes = [tuple(rng.getrandbits(63) for _ in range(16)) for _ in range(500)]
    for blocks in prefixes:
        index.record(rng.choice(ids), blocks)
    requests = [
        RouteRequest(
            request_id=f"r{i}",
            model="m",
            prompt_tokens=rng.randrange(100, 8000),
            max_new_tokens=rng.randrange(16, 2048),
            block_hashes=rng.choice(prefixes)[: rng.randrange(1, 17)],
            owners=tuple(rng.sample(ids, 2)),
            deadline_s=rng.choice((0.0, 5.0)),
        )
        for i in range(1000)
    ]
    profile = profile_from_config(default_config())
    inflight = {rng.choice(ids): rng.randrange(1, 4) for _ in range(100)}
    ctx = RoutingContext(snapshot, 0.0, inflight, sum(inflight.values()), index)
    decide, clock, cpu_clock = profile.decide, time.perf_counter_ns, time.thread_time_ns
    for request in requests:  # warm-up
        decide(request, ctx)
    loops = _calibrate(lambda: [decide(r, ctx) for r in requests], len(requests))
    wall: list[float] = []
    cpu: list[float] = []
    fixed: list[float] = []
    rates: list[float] = []
    n = len(requests)
    for _ in range(args.runs):
        run_started = time.process_time()
        for i in range(args.decisions):
            request = requests[i % n]
            started = clock()
            decide(request, ctx)
            wall.append((clock() - started) / 1000.0)
        rates.append(args.decisions / max(time.process_time() - run_started, 1e-9))
        # The same decisions on this thread's CPU clock: what a decision costs, without
        # the time a shared machine's scheduler keeps the process waiting.
        for i in range(args.decisions):
            request = requests[i % n]
            started = cpu_clock()
            decide(request, ctx)
            cpu.append((cpu_clock() - started) / 1000.0)
        # Baseline: fixed work of a decision's cost, timed alike, in the same run.
        for _ in range(args.decisions):
            started = cpu_clock()
            _fixed_work(loops)
            fixed.append((cpu_clock() - started) / 1000.0)
    median, p99 = median_p99(cpu)
    report.add(
        Figure(
            f"decision latency, {args.endpoints} endpoints (CPU)",
            median,
            "µs",
            p99=p99,
            goal="p99 <= 50 µs",
            met=p99 <= 50.0,
        )
    )
    base_median, base_p99 = median_p99(fixed)
    report.add(
        Figure(
            "baseline: fixed work of the same median (CPU)",
            base_median,
            "µs",
            p99=base_p99,
            note=f"p99/median {base_p99 / base_median:.2f} (decisions: {p99 / median:.2f}): "
            "the tail this machine adds to any work of this size",
        )
    )
    median, p99 = median_p99(wall)
    report.add(
        Figure(
            f"decision latency, {args.endpoints} endpoints (wall)",
            median,
            "µs",
            p99=p99,
            note="wall clock includes time descheduled; on a busy machine its p99 is the scheduler's",
        )
    )
    report.add(
        Figure(
            "decisions per second per core",
            median_p99(rates)[0],
            "1/s",
            note="CPU time of one core; p99 column is the slowest run's rate",
            p99=min(rates),
        )
    )


def _event_reads(report: Report, args: argparse.Namespace) -> None:
    import msgspec

    from controlplane.contract import EngineAPI
    from controlplane.stream import Splicer

    def per_read(api: EngineAPI, event: bytes) -> tuple[float, float]:
        """µs per read of `event` by a fresh stream's splicer: median and p99 of the runs."""
        raw = b"data: " + event + b"\n\n"
        samples = []
        for _ in range(args.runs):
            splicer = Splicer(api)
            started = time.thread_time_ns()
            for _ in range(reads):
                splicer.read(raw, event)
            samples.append((time.thread_time_ns() - started) / reads / 1000.0)
        return median_p99(samples)

    reads = 2000
    medians: dict[int, float] = {}
    for tokens in (64, 4000):
        event = msgspec.json.encode({
            "text": "weir " * (tokens // 5), "output_ids": list(range(1000, 1000 + tokens)),
            "meta_info": {"id": "bench", "finish_reason": None, "prompt_tokens": 12,
                          "completion_tokens": tokens, "cached_tokens": 0},
        })  # fmt: skip
        median, p99 = per_read(EngineAPI.GENERATE, event)
        medians[tokens] = median
        if tokens == 64:
            report.add(Figure("relay read, /generate event at 64 tokens", median, "µs", p99=p99))
            continue
        ratio = median / medians[64]
        report.add(
            Figure(
                "relay read, /generate event at 4,000 tokens",
                median,
                "µs",
                p99=p99,
                goal="<= 2x the 64-token read",
                met=ratio <= 2.0,
                note=f"{ratio:.2f}x the 64-token read; the event is {len(event):,} bytes",
            )
        )
    # A completions chunk as the router's upstream sends it: with the usage the router asks
    # for, which a client that did not ask for it does not receive.
    chunk = msgspec.json.encode({
        "id": "bench", "object": "text_completion", "created": 1, "model": "bench",
        "choices": [{"index": 0, "text": " weir", "logprobs": None, "finish_reason": None,
                     "matched_stop": None}],
        "usage": {"prompt_tokens": 12, "total_tokens": 76, "completion_tokens": 64,
                  "reasoning_tokens": 0},
    })  # fmt: skip
    median, p99 = per_read(EngineAPI.COMPLETIONS, chunk)
    report.add(Figure("relay read, OpenAI chunk, its usage taken out", median, "µs", p99=p99))


def _fixed_work(loops: int) -> float:
    total = 0.0
    for i in range(loops):
        total += i * 0.5
    return total


def _calibrate(work: Callable[[], object], items: int) -> int:
    """Loops of `_fixed_work` that cost what one of the `items` in `work` costs."""
    started = time.thread_time_ns()
    work()
    per_item = (time.thread_time_ns() - started) / items
    started = time.thread_time_ns()
    _fixed_work(100_000)
    per_loop = (time.thread_time_ns() - started) / 100_000
    return max(1, round(per_item / per_loop))


_WEIR = (sys.executable, "-m", "weir.cli")


@contextlib.contextmanager
def _running(*args: str, port: int) -> Iterator[str]:
    """`weir <args>` as a subprocess, until it accepts connections on `port`; its URL."""
    from weir.local.ports import wait_for_port

    proc = subprocess.Popen([*_WEIR, *args, "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _fleet() -> Iterator[tuple[str, str]]:
    """A fast reference engine and a router in front of it, as subprocesses."""
    from weir.local.ports import free_port

    with (
        _running("engine", "--model", "bench", "--speed-factor", "1000",
                 port=free_port()) as engine_url,
        _running("router", "--model", "bench", "--endpoint", engine_url,
                 "--bytes-per-token", "1", port=free_port()) as router_url,
    ):  # fmt: skip
        yield engine_url, router_url


async def _stream_once(session: object, url: str, tokens: int, i: int) -> tuple[float, float]:
    """(time to first token, output tokens per second) of one streamed completion."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    body = {
        "model": "bench", "prompt": f"request {i}: tell me about weirs", "stream": True,
        "max_tokens": tokens, "ignore_eos": True,
    }  # fmt: skip
    started = time.perf_counter()
    first = 0.0
    async with session.post(url + "/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if not first and line.startswith(b"data: {"):
                first = time.perf_counter()
    done = time.perf_counter()
    return first - started, tokens / max(done - started, 1e-9)


async def _proxy(report: Report, args: argparse.Namespace) -> None:
    import aiohttp

    direct_ttft: list[float] = []
    routed_ttft: list[float] = []
    added: list[float] = []
    direct_rate: list[float] = []
    routed_rate: list[float] = []
    with _fleet() as (engine_url, router_url):
        async with aiohttp.ClientSession() as session:
            for i in range(5):  # warm connections and code paths
                await _stream_once(session, engine_url, args.tokens, i)
                await _stream_once(session, router_url, args.tokens, i)
            for i in range(args.runs * args.streams):
                # Alternate the order so neither path always runs on a warmer engine.
                pair = [(engine_url, True), (router_url, False)]
                if i % 2:
                    pair.reverse()
                got: dict[bool, float] = {}
                for url, direct in pair:
                    ttft, rate = await _stream_once(session, url, args.tokens, i)
                    got[direct] = ttft
                    (direct_ttft if direct else routed_ttft).append(ttft * 1000)
                    (direct_rate if direct else routed_rate).append(rate)
                added.append((got[False] - got[True]) * 1000)
    for name, samples in (("TTFT direct", direct_ttft), ("TTFT via router", routed_ttft)):
        median, p99 = median_p99(samples)
        report.add(Figure(name, median, "ms", p99=p99))
    median, p99 = median_p99(added)
    report.add(
        Figure(
            "added TTFT (router - direct, paired)", median, "ms", p99=p99,
            goal="p50 <= 1 ms", met=median <= 1.0,
        )
    )  # fmt: skip
    for name, samples in (
        ("stream throughput direct", direct_rate),
        ("stream throughput via router", routed_rate),
    ):
        median, p99 = median_p99(samples)
        report.add(Figure(name, median, "tok/s", p99=min(samples), note=""))
    report.add(
        Figure(
            "throughput ratio router/direct",
            median_p99(routed_rate)[0] / median_p99(direct_rate)[0],
            "x",
        )
    )


async def _quota_streams(report: Report, streams: int) -> None:
    import tempfile
    from pathlib import Path

    import msgspec

    from controlplane.contract import EndpointState, PoolPolicy, TenantQuota
    from controlplane.store import EndpointRegistry, RedisSettings, connect
    from weir.local.ports import free_port
    from weir.local.redis_server import RedisServer

    policy = PoolPolicy(
        pool="bench", model="bench", tenants=(TenantQuota(name="bench", max_concurrency=streams),)
    )
    with (
        RedisServer() as redis_server,
        tempfile.TemporaryDirectory(prefix="weir-bench-") as folder,
        # Real-time decoding: every stream is still running when the last one starts.
        _running("engine", "--model", "bench", "--max-running-requests", str(streams),
                 "--max-total-tokens", str(streams * 5000), port=free_port()) as engine_url,
    ):  # fmt: skip
        policy_file = Path(folder) / "policy.json"
        policy_file.write_bytes(msgspec.json.encode(policy))
        client = connect(RedisSettings(url=redis_server.url))
        try:
            endpoint = EndpointState(
                pool="bench", endpoint_id="e0", address=engine_url, model="bench",
                kv_capacity_tokens=streams * 5000,
            )  # fmt: skip
            await EndpointRegistry(client, "bench").register(endpoint, ttl_s=3600)
        finally:
            await client.aclose()
        with _running("router", "--redis-url", redis_server.url, "--policy-file",
                      str(policy_file), "--bytes-per-token", "1",
                      port=free_port()) as router_url:  # fmt: skip
            await _ready(router_url)
            started = time.perf_counter()
            outcomes = await _hold(router_url, streams)
            opened_s = time.perf_counter() - started
    held = outcomes.pop("held", 0)
    refused = ", ".join(f"{n} x {why}" for why, n in sorted(outcomes.items())) or "none"
    report.add(
        Figure(
            f"streams held at once, {streams} opened together, quotas on",
            held,
            "streams",
            goal=f"all {streams}",
            met=held == streams,
            note=f"refused: {refused}; all answered within {opened_s:.2f} s",
        )
    )


async def _ready(url: str) -> None:
    """Wait until the router sees a ready endpoint (it follows the pool from Redis)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, asyncio.timeout(60):
        while True:
            async with session.get(url + "/ready") as reply:
                if reply.status == 200:
                    return
            await asyncio.sleep(0.1)


async def _hold(url: str, streams: int) -> collections.Counter[str]:
    """Open `streams` streams at once and keep each open until every one has its answer:
    'held' (streaming) or the refusal's status and reason."""
    import aiohttp

    outcomes: collections.Counter[str] = collections.Counter()
    answered = asyncio.Event()
    body = {"model": "bench", "prompt": "hold me", "stream": True, "max_tokens": 4000,
            "ignore_eos": True}  # fmt: skip

    def tell(outcome: str) -> None:
        outcomes[outcome] += 1
        if sum(outcomes.values()) == streams:
            answered.set()

    async def one(session: aiohttp.ClientSession) -> None:
        try:
            async with session.post(
                url + "/v1/completions", json=body, headers={"x-weir-tenant": "bench"}
            ) as reply:
                if reply.status != 200:
                    reason = (await reply.json()).get("error", {}).get("reason", "")
                    tell(f"{reply.status} {reason}")
                    return
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        break
                tell("held")
                await answered.wait()  # a held stream stays open until all have answered
        except aiohttp.ClientError as exc:
            if not answered.is_set():
                tell(f"failed ({type(exc).__name__})")

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.timeout(120):
        await asyncio.gather(*(one(session) for _ in range(streams)))
    return outcomes
