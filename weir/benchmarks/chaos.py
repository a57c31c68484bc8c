"""`weir bench chaos`: Weir's promise where it is tested hardest, on a local fleet of real
processes (`weir up`'s: Redis, reference engines with small KV pools, sidecars, router).

Three scenarios per run, each on a fresh fleet: a **KV burst** (every stream at once,
asking about twice the KV the fleet has, so admission queues, relief preempts and
migrates), an **engine killed** for good mid-stream, and a **sidecar killed** mid-stream
(SIGKILL, as a crashed pod's). For each: the streams admitted, those that ended whole
(their natural finish and exactly the text an uninterrupted run gives, checked against
an engine with room for everything), those that failed, the sidecars' preemptions, the
router's resumes, and the longest pause a client saw between two chunks (p99 over the
streams). Summarised over `--runs` as median and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "chaos"
HELP = "streams through a KV burst, an engine kill and a sidecar kill: every one whole?"
_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_SCENARIOS = ("kv burst", "engine killed", "sidecar killed")


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--streams", type=int, default=24, help="streams in the KV burst")
    add("--kill-streams", type=int, default=8, help="streams when a part is killed")
    add("--max-tokens", type=int, default=1500, help="each burst stream's answer")
    add("--kv-tokens", type=int, default=6000, help="each engine's KV pool, in tokens")
    add("--speed-factor", type=float, default=40.0, help="engine speed over real time")
    add_output_flags(parser)
    parser.set_defaults(runs=3)


@dataclass
class _Stream:
    text: str = ""
    finish: str = ""
    failed: bool = False
    admitted: bool = False
    chunk_times: list[float] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # five chunks in

    @property
    def longest_pause_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class _Outcome:
    admitted: int
    whole: int
    failed: int
    preempted: float
    resumed: float
    pause_p99_s: float


def _body(i: int, max_tokens: int) -> dict[str, Any]:
    prompt = f"{i:03d} " + "the river rises against the weir, " * 10
    return {"model": _MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip


async def _stream(http: Any, url: str, body: dict[str, Any], out: _Stream) -> _Stream:
    async with http.post(url + "/v1/completions", json=body) as reply:
        if reply.status != 200:
            out.failed = True
            return out
        out.admitted = True
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            out.chunk_times.append(time.monotonic())
            if len(out.chunk_times) == 5:
                out.started.set()
            if "error" in chunk:
                out.failed = True
            for choice in chunk.get("choices") or ():
                out.text += choice.get("text") or ""
                out.finish = choice.get("finish_reason") or out.finish
    return out


async def _expected(http: Any, url: str, bodies: Sequence[dict[str, Any]]) -> list[str]:
    """Each request's uninterrupted text, a few at a time (an engine with room)."""
    gate = asyncio.Semaphore(2)

    async def one(body: dict[str, Any]) -> str:
        async with gate:
            return (await _stream(http, url, body, _Stream())).text

    return list(await asyncio.gather(*(one(b) for b in bodies)))


async def _scenario(args: argparse.Namespace, scenario: str, expected_url: str) -> _Outcome:
    import aiohttp

    from weir.local.exposition import counter
    from weir.local.fleet import FleetConfig, LocalFleet

    burst = scenario == "kv burst"
    n = args.streams if burst else args.kill_streams
    max_tokens = args.max_tokens if burst else args.max_tokens // 3
    # A killed part should leave room on the survivor: the count of resumes stays clean.
    kv = args.kv_tokens if burst else args.kv_tokens * 4
    bodies = [_body(i, max_tokens) for i in range(n)]
    config = FleetConfig(engines=2, router_port=0, model=_MODEL, speed_factor=args.speed_factor,
                         kv_tokens=kv)  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        expected = await _expected(http, expected_url, bodies)
        fleet = await asyncio.to_thread(LocalFleet(config).start)
        try:
            streams = [_Stream() for _ in bodies]
            running = asyncio.gather(
                *(
                    _stream(http, fleet.router_url, b, s)
                    for b, s in zip(bodies, streams, strict=True)
                )
            )
            if not burst:
                await asyncio.gather(*(s.started.wait() for s in streams))
                part = "engine-0" if scenario == "engine killed" else "sidecar-0"
                await asyncio.to_thread(fleet.kill, part)
            await running
            preempted = 0.0
            for url in fleet.sidecar_urls:
                with contextlib.suppress(aiohttp.ClientError):  # the killed one
                    preempted += await counter(http, url, "weir_sidecar_preemptions_total")
            resumed = await counter(http, fleet.router_url, "weir_router_resumes_total")
        finally:
            await asyncio.to_thread(fleet.close)
    whole = sum(
        s.admitted and not s.failed and s.finish == "length" and s.text == expected[i]
        for i, s in enumerate(streams)
    )
    pauses = [s.longest_pause_s for s in streams if s.admitted]
    return _Outcome(
        admitted=sum(s.admitted for s in streams),
        whole=whole,
        failed=sum(s.failed for s in streams),
        preempted=preempted,
        resumed=resumed,
        pause_p99_s=median_p99(pauses)[1] if pauses else 0.0,
    )


async def _bench(args: argparse.Namespace, report: Report) -> None:
    from fleetsim.engine import EngineConfig
    from fleetsim.server import serve_engine

    roomy = EngineConfig(model=_MODEL, max_total_tokens=200_000, speed_factor=200.0)
    outcomes: dict[str, list[_Outcome]] = {name: [] for name in _SCENARIOS}
    async with serve_engine(roomy) as oracle:
        for _ in range(args.runs):
            for name in _SCENARIOS:
                outcomes[name].append(await _scenario(args, name, oracle.url))
    for name, runs in outcomes.items():
        lost = [o.admitted - o.whole for o in runs]
        med, p99 = median_p99(lost)
        report.add(Figure(f"{name}: admitted streams not whole", med, "streams", p99, "0",
                          p99 == 0, note=_note(runs)))  # fmt: skip
        med, p99 = median_p99([o.pause_p99_s * 1e3 for o in runs])
        report.add(Figure(f"{name}: longest pause between chunks (p99 of streams)", med, "ms", p99))


def _note(runs: Sequence[_Outcome]) -> str:
    last = runs[-1]
    return (
        f"last run: {last.admitted} admitted, {last.whole} whole, {last.failed} failed, "
        f"{last.preempted:g} preempted by sidecars, {last.resumed:g} resumed by the router"
    )


def run(args: argparse.Namespace) -> int:
    report = Report(
        NAME,
        params={
            "runs": args.runs,
            "streams": args.streams,
            "kill_streams": args.kill_streams,
            "max_tokens": args.max_tokens,
            "kv_tokens": args.kv_tokens,
            "speed_factor": args.speed_factor,
        },
    )
    asyncio.run(_bench(args, report))
    report.emit(args.json)
    return 0
