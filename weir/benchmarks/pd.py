"""`weir bench pd`: what the P/D path adds to a request's time to first token.

Two local fleets share one Redis, every part a process as `weir up` runs it: a mixed pool
(one reference engine and its sidecar behind a router) and a P/D pair of pools (a prefill
and a decode engine, their sidecars, the prefill pool's router and the decode pool's). The
same streamed requests go to both routers, alternating, one at a time, so each figure
pairs the two paths' answers to the same request in the same run.

The mixed path's first token comes after the prefill; the P/D path's after the prefill,
the KV's transfer (its bytes over the link, `--kv-link-bytes-per-s`), the decode engine's
first step, and the second leg's hops (router to decode sidecar to decode engine, and the
handshake with the prefill engine's bootstrap server). Reported: TTFT through each path,
the P/D path's added TTFT (per request, P/D minus mixed), the modelled transfer time of
one prompt for comparison, and end-to-end latency through each.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "pd"
HELP = "The P/D path's added time to first token against a mixed pool, in the same run."

_MODEL = "bench-pd"


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--requests", type=int, default=30, help="requests per path and run")
    add("--prompt-tokens", type=int, default=2000, help="each request's prompt (byte tokens)")
    add("--max-tokens", type=int, default=16, help="each request's answer")
    add("--speed-factor", type=float, default=1.0, help="reference engines' simulated speed")
    add("--kv-link-bytes-per-s", type=float, default=50e9,
        help="the P/D KV link (default: one 400 Gb/s NIC per GPU)")  # fmt: skip
    add_output_flags(parser)
    parser.set_defaults(runs=1)


def run(args: argparse.Namespace) -> int:
    from fleetsim.engine import TimingModel
    from weir.local.fleet import FleetConfig, LocalFleet

    sizes = (args.requests, args.prompt_tokens, args.max_tokens, args.runs)
    if min(sizes) < 1 or not (args.speed_factor > 0 and args.kv_link_bytes_per_s > 0):
        raise SystemExit(
            "bad arguments: --requests, --prompt-tokens, --max-tokens and --runs must be at "
            "least 1, --speed-factor and --kv-link-bytes-per-s positive"
        )
    engine_flags = ("--kv-link-bytes-per-s", str(args.kv_link_bytes_per_s))

    def fleet(pool: str, prefill: int, redis_url: str = "") -> FleetConfig:
        return FleetConfig(
            engines=1, prefill_engines=prefill, pool=pool, model=_MODEL, router_port=0,
            speed_factor=args.speed_factor, redis_url=redis_url, tenants=(),
            reference_args=engine_flags,
        )  # fmt: skip

    report = Report(NAME)
    report.params.update(
        requests=args.requests, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
        speed_factor=args.speed_factor, kv_link_bytes_per_s=args.kv_link_bytes_per_s,
        runs=args.runs,
    )  # fmt: skip
    with LocalFleet(fleet("mixed", 0)) as mixed, LocalFleet(fleet("pd", 1, mixed.redis_url)) as pd:
        samples = asyncio.run(_paired(mixed.router_url, pd.router_url, args))
    (mixed_ttft, pd_ttft), (mixed_e2e, pd_e2e) = samples
    added = [p - m for p, m in zip(pd_ttft, mixed_ttft, strict=True)]
    report.add(_spread("TTFT, mixed pool", mixed_ttft))
    report.add(_spread("TTFT, P/D pair", pd_ttft))
    report.add(
        _spread("P/D added TTFT", added, "per request, the P/D path's TTFT less the mixed one's")
    )
    transfer = TimingModel().kv_transfer_s(args.prompt_tokens, args.kv_link_bytes_per_s)
    report.add(
        Figure(
            "modelled KV transfer of one prompt", transfer / args.speed_factor * 1e3, "ms",
            note="its KV bytes over the link, over the speed factor",
        )
    )  # fmt: skip
    report.add(_spread("E2E, mixed pool", mixed_e2e))
    report.add(_spread("E2E, P/D pair", pd_e2e))
    report.emit(args.json)
    return 0


def _spread(name: str, samples: list[float], note: str = "") -> Figure:
    median, p99 = median_p99(samples)
    return Figure(name, median, "ms", p99=p99, note=note)


async def _paired(
    mixed: str, pd: str, args: argparse.Namespace
) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """TTFT and E2E through each router (ms), the same requests alternating between them."""
    import aiohttp

    ttft: dict[str, list[float]] = {mixed: [], pd: []}
    e2e: dict[str, list[float]] = {mixed: [], pd: []}
    async with aiohttp.ClientSession() as session:
        for i in range(args.requests * args.runs):
            prompt = (f"{i:05d} " + "the river rises against the weir; " * args.prompt_tokens)[
                : args.prompt_tokens
            ]
            for url in (mixed, pd) if i % 2 else (pd, mixed):
                first, done = await _stream(session, url, prompt, args.max_tokens)
                ttft[url].append(first * 1e3)
                e2e[url].append(done * 1e3)
    return (ttft[mixed], ttft[pd]), (e2e[mixed], e2e[pd])


async def _stream(session: object, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(time to the first content, time to the end) of one streamed completion, patient
    with a 429 (a decode pool's first handoff budget comes within a second)."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    body = {"model": _MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    for _ in range(20):
        started = time.perf_counter()
        first = 0.0
        async with session.post(url + "/v1/completions", json=body) as reply:
            if reply.status == 429:
                await asyncio.sleep(float(reply.headers.get("Retry-After", "1")))
                continue
            if reply.status != 200:
                raise RuntimeError(f"{url}: HTTP {reply.status}: {await reply.text()}")
            async for line in reply.content:
                if not first and line.startswith(b"data: {"):
                    first = time.perf_counter()
        return first - started, time.perf_counter() - started
    raise RuntimeError(f"{url}: refused 20 times")
