"""`weir bench router --routers N`: one router against N side by side, on the same traffic.

The chart runs several router replicas per pool behind one Service, and each counts only
the requests it sent itself until the endpoints' next reports show them. This section
starts a local fleet of real processes (`weir up`'s: Redis, reference engines with small
KV pools, sidecars, N routers following the same pool) and sends the same seeded traffic
twice per run: all of it through one router, then spread round-robin over the N. Requests
share a few long system prompts (what prefix affinity keys on) with a short question of
their own, and arrive as a Poisson stream.

Every 0.1 s it reads each sidecar's `/weir/v1/state`: the requests each endpoint holds
(running or waiting there) and those waiting for admission. The figures, per router count:
max/avg endpoint load (each sample's busiest endpoint over the mean, over the samples where
the mean is at least one request), the busiest endpoint's peak per run, requests waiting at
the sidecars, time to first token at the client, and refusals (quota 429s and others).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weir.benchmarks._report import Figure, Report, median_p99

_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_SAMPLE_S = 0.1
_PREFIXES = 8
_QUOTA_REASONS = frozenset({"concurrency", "class_capacity", "input_tokens", "output_tokens"})


@dataclass(frozen=True, slots=True)
class _Request:
    at_s: float  # after the run's start
    burst: int  # the requests of one burst arrive together
    body: dict[str, Any]


@dataclass
class _Run:
    ratios: list[float] = field(default_factory=list)  # max/avg load, one per sample
    peak: int = 0  # the most requests one endpoint held at once
    waiting: list[int] = field(default_factory=list)  # waiting at the sidecars, per sample
    ttft_ms: list[float] = field(default_factory=list)
    quota_refusals: int = 0
    other_refusals: int = 0
    # burst -> endpoint -> its requests there (the router's x-weir-endpoint answer)
    landed: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


def add_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--routers", type=int, default=0, metavar="N",
        help="also send the same traffic through 1 router and through N side by side on a "
             "local fleet (Redis, reference engines, sidecars, N routers) and compare the "
             "endpoints' load; 0 skips it")  # fmt: skip
    add("--fleet-engines", type=int, default=4, help="engines in the --routers fleet")
    add("--fleet-requests", type=int, default=120, help="requests per --routers run")
    add("--fleet-rate", type=float, default=8.0, help="arrivals per second, --routers runs")
    add("--fleet-burst", type=int, default=6, help="requests arriving at once, --routers runs")
    add("--fleet-kv-tokens", type=int, default=8000,
        help="each engine's KV pool in the --routers fleet (0: the model's own, ~790K): "
             "small enough by default that a busy endpoint queues")  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    if not 0 <= args.routers <= 16:
        raise SystemExit("--routers must be between 0 and 16")
    if args.routers and (
        args.fleet_engines < 2
        or min(args.fleet_requests, args.fleet_burst) < 1
        or args.fleet_kv_tokens < 0
        or not args.fleet_rate > 0
    ):
        raise SystemExit(
            "--fleet-engines must be at least 2; --fleet-requests, --fleet-rate and "
            "--fleet-burst positive; --fleet-kv-tokens not negative"
        )


def params(args: argparse.Namespace) -> dict[str, object]:
    """The --routers fleet and traffic, for the report's header."""
    return {
        "fleet_engines": args.fleet_engines,
        "fleet_requests": args.fleet_requests,
        "fleet_rate": args.fleet_rate,
        "fleet_burst": args.fleet_burst,
        "fleet_kv_tokens": args.fleet_kv_tokens,
    }


def traffic(seed: int, requests: int, rate: float, burst: int = 1) -> list[_Request]:
    """A seeded Poisson stream of bursts of `burst` requests sent at once (a client's
    fan-out), `rate` requests a second in all: each request one of a few shared system
    prompts (longer than the owner key's blocks) and a question of its own, 16 to 64
    tokens long."""
    rng = random.Random(seed)
    prefixes = [
        f"system prompt {p}: you answer questions about rivers and weirs. " * 6
        for p in range(_PREFIXES)
    ]
    at, plan = 0.0, []
    for i in range(requests):
        if i % burst == 0:
            at += rng.expovariate(rate / burst)
        body = {
            "model": _MODEL, "prompt": f"{rng.choice(prefixes)}question {seed}-{i}?",
            "max_tokens": rng.randrange(16, 65), "ignore_eos": True, "stream": True,
        }  # fmt: skip
        plan.append(_Request(at, i // burst, body))
    return plan


async def replicas(report: Report, args: argparse.Namespace) -> None:
    import aiohttp

    from weir.local.fleet import FleetConfig, LocalFleet

    config = FleetConfig(
        engines=args.fleet_engines, routers=args.routers, router_port=0, model=_MODEL,
        kv_tokens=args.fleet_kv_tokens, speed_factor=0.25,
    )  # fmt: skip
    fleet = await asyncio.to_thread(LocalFleet(config).start)
    runs: dict[int, list[_Run]] = {1: [], args.routers: []}
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            # Every router's prefix index warmed alike, so neither count starts cold.
            warm = traffic(-1, 2 * _PREFIXES * args.routers, args.fleet_rate)
            await _run(http, fleet.router_urls, fleet.sidecar_urls, warm)
            for r in range(args.runs):
                plan = traffic(r, args.fleet_requests, args.fleet_rate, args.fleet_burst)
                for count in runs:
                    urls = fleet.router_urls[:count]
                    runs[count].append(await _run(http, urls, fleet.sidecar_urls, plan))
    finally:
        await asyncio.to_thread(fleet.close)
    for count, measured in runs.items():
        _figures(report, f"{count} router{'s' if count > 1 else ''}", measured)


async def _run(
    http: Any, routers: Sequence[str], sidecars: Sequence[str], plan: Sequence[_Request]
) -> _Run:
    """Send `plan` round-robin over `routers`, sampling the sidecars until it is served
    and they hold nothing."""
    run = _Run()
    sent = asyncio.Event()
    sampler = asyncio.create_task(_sample(http, sidecars, run, sent))
    started = time.monotonic()

    async def one(i: int, request: _Request) -> None:
        await asyncio.sleep(max(0.0, started + request.at_s - time.monotonic()))
        await _stream(http, routers[i % len(routers)], request, run)

    try:
        await asyncio.gather(*(one(i, request) for i, request in enumerate(plan)))
        sent.set()
        await sampler
    finally:
        sampler.cancel()
    return run


async def _stream(http: Any, router: str, request: _Request, run: _Run) -> None:
    started = time.monotonic()
    async with http.post(router + "/v1/completions", json=request.body) as reply:
        if reply.status != 200:
            reason = (await reply.json()).get("error", {}).get("reason", "")
            if reply.status == 429 and reason in _QUOTA_REASONS:
                run.quota_refusals += 1
            else:
                run.other_refusals += 1
            return
        run.landed[request.burst][reply.headers.get("x-weir-endpoint", "")] += 1
        async for line in reply.content:
            if line.startswith(b"data: {"):
                run.ttft_ms.append((time.monotonic() - started) * 1000)
                break
        async for _ in reply.content:
            pass


async def _sample(http: Any, sidecars: Sequence[str], run: _Run, sent: asyncio.Event) -> None:
    """Each endpoint's requests every `_SAMPLE_S`, until the traffic is sent and served."""
    while True:
        states = await asyncio.gather(*(_state(http, url) for url in sidecars))
        loads = [len(s["requests"]) for s in states]
        run.waiting.append(sum(int(s["queued"]) for s in states))
        run.peak = max(run.peak, *loads)
        mean = sum(loads) / len(loads)
        if mean >= 1.0:
            run.ratios.append(max(loads) / mean)
        if sent.is_set() and not any(loads):
            return
        await asyncio.sleep(_SAMPLE_S)


async def _state(http: Any, sidecar: str) -> dict[str, Any]:
    async with http.get(sidecar + "/weir/v1/state") as reply:
        state: dict[str, Any] = await reply.json()
        return state


def _figures(report: Report, label: str, runs: Sequence[_Run]) -> None:
    ratios = [ratio for run in runs for ratio in run.ratios]
    if ratios:
        median, p99 = median_p99(ratios)
        report.add(Figure(f"{label}: max/avg endpoint load", median, "x", p99=p99,
                          note=f"{len(ratios)} samples with a mean of 1 or more"))  # fmt: skip
    most = [max(burst.values()) for run in runs for burst in run.landed.values()]
    if most:
        median, p99 = median_p99(most)
        report.add(Figure(f"{label}: most of one burst on one endpoint", median, "requests",
                          p99=p99, note=f"mean {statistics.fmean(most):.2f}"))  # fmt: skip
    median, p99 = median_p99([run.peak for run in runs])
    report.add(Figure(f"{label}: busiest endpoint's peak (per run)", median, "requests", p99=p99))
    median, p99 = median_p99([w for run in runs for w in run.waiting])
    report.add(Figure(f"{label}: waiting at the sidecars", median, "requests", p99=p99))
    ttft = [t for run in runs for t in run.ttft_ms]
    if ttft:
        median, p99 = median_p99(ttft)
        report.add(Figure(f"{label}: TTFT", median, "ms", p99=p99))
    quota = [run.quota_refusals for run in runs]
    others = [run.other_refusals for run in runs]
    report.add(
        Figure(
            f"{label}: quota refusals (per run)", statistics.median(quota), "requests",
            p99=max(quota), note=f"other refusals per run: {others}",
        )
    )  # fmt: skip
