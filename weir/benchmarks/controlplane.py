"""`weir bench controlplane`: what the shared truth costs, against a real local Redis.

- heartbeats/s from one client process (pipelined, as a local fleet or simulator sends
  them) and Redis server microseconds per heartbeat from `INFO commandstats`, at 1,000 and
  10,000 endpoints; goal: 10,000 endpoints beating once a second take at most 20% of one
  Redis core;
- refreshing a reader's view after one change in a 10,000-endpoint pool (deltas from the
  change feed) against reading the full snapshot, the baseline; goal: proportional to the
  change, not to the pool;
- the fraction of prefix keys whose primary owner changes when one of N members leaves,
  times N; goal: at most 1.2;
- max/avg load per owner for Zipf(1) prefix popularity, plain and bounded-load (c = 1.25);
  goal: at most 1.25 with bounded load;
- owner lookup time for 1,000 endpoints in-process, each call timed, against a dict
  lookup of the same keys; goal: p99 at most 10 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "controlplane"
HELP = "Control plane on Redis: heartbeat cost, snapshot refresh, owner churn, load, lookups."

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from controlplane.contract import EndpointState

POOL = "bench"


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser)
    parser.add_argument(
        "--redis-url", default="", help="use this Redis (default: start a throwaway one)"
    )
    parser.add_argument(
        "--sizes", default="1000,10000", help="pool sizes for the heartbeat figures"
    )
    parser.add_argument("--members", type=int, default=1000, help="ring members (churn, lookup)")
    parser.add_argument("--keys", type=int, default=50_000, help="prefix keys sampled")
    parser.add_argument("--zipf-members", type=int, default=100, help="owners for the load figure")
    parser.add_argument("--requests", type=int, default=50_000, help="requests for the load figure")


def _state(i: int) -> EndpointState:
    from controlplane.contract import EndpointState

    return EndpointState(
        pool=POOL,
        endpoint_id=f"ep-{i:05d}",
        address=f"http://10.0.{i // 250}.{i % 250}:30000",
        model="llama-3-8b",
        kv_capacity_tokens=200_000,
        kv_used_tokens=50_000 + i,
        running_requests=12,
        queued_requests=3,
        predicted_ttft_s=0.2,
        predicted_tpot_s=0.03,
    )


async def _clear_pool(client: Redis) -> None:
    """Delete the benchmark pool's keys (and nothing else: --redis-url may be shared)."""
    from controlplane.store import PoolKeys

    async for key in client.scan_iter(match=PoolKeys(POOL).pattern, count=1000):
        await client.delete(key)


async def _redis_cpu_s(client: Redis) -> float:
    cpu = await client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def _empty_script_us(client: Redis, keys: tuple[str, ...], state: EndpointState) -> float:
    """Server µs per EVALSHA of a script that does nothing, called with a heartbeat's keys
    and arguments: the floor of any script call carrying this payload on this Redis and
    machine, for scaling the heartbeat figure to another one."""
    from controlplane.contract import encode

    args = (state.endpoint_id, state.epoch, state.version, "ready", encode(state), 60_000, 50_000)
    sha = await client.script_load("return 1")
    await client.config_resetstat()
    for _ in range(10):
        async with client.pipeline(transaction=False) as pipe:
            for _ in range(500):
                pipe.evalsha(sha, len(keys), *keys, *args)
            await pipe.execute()
    stats = await client.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec_per_call"])


async def _heartbeat_figures(url: str, sizes: list[int], runs: int, report: Report) -> None:
    import msgspec
    from redis.asyncio import Redis

    from controlplane.store import EndpointRegistry, PoolFollower, RedisSettings, connect

    client = connect(RedisSettings(url=url))
    assert isinstance(client, Redis)  # one server: the figures read its INFO
    try:
        for size in sizes:
            await _clear_pool(client)
            registry = EndpointRegistry(client, POOL)
            states: list[EndpointState] = []
            for i in range(size):
                states.append(await registry.register(_state(i), ttl_s=60))
            rates, server_us, cpu_us, empty_us = [], [], [], []
            for _ in range(runs):
                states = [msgspec.structs.replace(s, version=s.version + 1) for s in states]
                await client.config_resetstat()
                cpu_before = await _redis_cpu_s(client)
                start = time.perf_counter()
                for chunk in range(0, size, 500):
                    results = await registry.heartbeat_many(states[chunk : chunk + 500], 60)
                    assert all(r.status == "ok" for r in results), results[0]
                rates.append(size / (time.perf_counter() - start))
                cpu_us.append((await _redis_cpu_s(client) - cpu_before) / size * 1e6)
                stats = await client.info("commandstats")
                server_us.append(float(stats["cmdstat_evalsha"]["usec_per_call"]))
                empty_us.append(
                    await _empty_script_us(client, registry.keys.endpoint_keys, states[0])
                )
            med, p99 = median_p99(empty_us)
            report.add(Figure(f"Redis µs per empty EVALSHA (baseline), {size:,} endpoints",
                              med, "µs", p99=p99))  # fmt: skip
            baseline = med
            med, p99 = median_p99(cpu_us)
            report.add(Figure(f"Redis process CPU µs per heartbeat, {size:,} endpoints", med,
                              "µs", p99=p99, note="INFO cpu: includes network I/O"))  # fmt: skip
            med, p99 = median_p99(rates)
            report.add(Figure(f"heartbeats/s, {size:,} endpoints", med, "1/s", p99=p99))
            med, p99 = median_p99(server_us)
            core = size * med / 1e6
            report.add(
                Figure(
                    f"Redis µs per heartbeat, {size:,} endpoints",
                    med,
                    "µs",
                    p99=p99,
                    goal="10k/s ≤ 20% core" if size == 10_000 else "",
                    met=core <= 0.2 if size == 10_000 else None,
                    note=f"{size:,} endpoints at 1 Hz use {core:.1%} of one Redis core; "
                    f"{med / baseline:.1f}x an empty script on this Redis",
                )
            )

        # A reader of the largest pool: deltas after one change vs a full snapshot.
        registry = EndpointRegistry(client, POOL)
        follower = PoolFollower(registry)
        await follower.refresh()
        delta_ms, full_ms = [], []
        for run in range(max(runs, 5)):
            one = states[run % len(states)]
            one = msgspec.structs.replace(one, version=one.version + 1 + run)
            await registry.heartbeat(one, 60)
            start = time.perf_counter()
            refreshed = await follower.refresh()
            delta_ms.append((time.perf_counter() - start) * 1000)
            assert refreshed.applied == 1
            assert not refreshed.resynced
            start = time.perf_counter()
            await registry.snapshot()
            full_ms.append((time.perf_counter() - start) * 1000)
        d_med, d_p99 = median_p99(delta_ms)
        f_med, f_p99 = median_p99(full_ms)
        report.add(Figure("full snapshot read (baseline)", f_med, "ms", p99=f_p99,
                          note=f"{len(states):,} endpoints"))  # fmt: skip
        report.add(
            Figure(
                "view refresh after 1 change",
                d_med,
                "ms",
                p99=d_p99,
                goal="≪ full snapshot",
                met=d_med * 10 < f_med,
                note=f"{f_med / d_med:.0f}x cheaper than the full snapshot",
            )
        )
        await _clear_pool(client)
    finally:
        await client.aclose()


def _ownership_figures(args: argparse.Namespace, report: Report) -> None:
    from controlplane.ownership import Membership, OwnershipRing

    rng = random.Random(42)
    n = args.members
    members = Membership.of(1, (f"ep-{i:05d}" for i in range(n)))
    start = time.perf_counter()
    ring = OwnershipRing(members)
    build_ms = (time.perf_counter() - start) * 1000
    keys = [rng.getrandbits(64) for _ in range(args.keys)]

    churn = []
    for _ in range(args.runs):
        leaver = rng.choice(members.members)
        after = OwnershipRing(Membership.of(2, (m for m in members.members if m != leaver)))
        moved = sum(ring.owners(k)[0] != after.owners(k)[0] for k in keys)
        churn.append(moved / len(keys) * n)
    med, worst = median_p99(churn)
    report.add(Figure(f"owner churn x N, one of {n:,} leaves", med, "x 1/N", p99=worst,
                      goal="≤ 1.2", met=med <= 1.2,
                      note=f"{args.runs} random leavers; p99 column is the worst"))  # fmt: skip

    # Zipf(1) popularity over prefixes; each request adds one unit of load to its owner.
    owners = Membership.of(1, (f"ep-{i:03d}" for i in range(args.zipf_members)))
    small = OwnershipRing(owners)
    prefixes = [rng.getrandbits(64) for _ in range(10_000)]
    weights = [1 / (rank + 1) for rank in range(len(prefixes))]
    stream = rng.choices(prefixes, weights, k=args.requests)
    plain: Counter[str] = Counter(small.owners(k)[0] for k in stream)
    bounded: Counter[str] = Counter()
    for total, key in enumerate(stream):
        bounded[small.bounded_owners(key, bounded, total, c=1.25)[0]] += 1
    average = args.requests / len(owners)
    report.add(Figure("max/avg load, Zipf(1), plain ring", max(plain.values()) / average, "x",
                      note=f"{len(owners)} owners, {args.requests:,} requests"))  # fmt: skip
    ratio = max(bounded.values()) / average
    report.add(Figure("max/avg load, Zipf(1), bounded c=1.25", ratio, "x",
                      goal="≤ 1.25", met=ratio <= 1.25 + 1 / average))  # fmt: skip

    lookups, baseline = [], []
    table = dict.fromkeys(keys, ("a", "b"))
    clock = time.perf_counter_ns
    for _ in range(args.runs):
        for k in keys:
            t0 = clock()
            ring.owners(k)
            lookups.append(clock() - t0)
        for k in keys:
            t0 = clock()
            table.get(k)
            baseline.append(clock() - t0)
    b_med, b_p99 = median_p99([ns / 1000 for ns in baseline])
    med, p99 = median_p99([ns / 1000 for ns in lookups])
    report.add(Figure("dict lookup (baseline, timer included)", b_med, "µs", p99=b_p99))
    report.add(Figure(f"owner lookup, {n:,} endpoints", med, "µs", p99=p99,
                      goal="p99 ≤ 10 µs", met=p99 <= 10,
                      note=f"{ring.vnodes} vnodes; ring built in {build_ms:.0f} ms; "
                           f"p99 {p99 / b_p99:.1f}x the dict baseline"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from weir.local.redis_server import RedisServer

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.runs < 1 or not sizes or min(sizes) < 1:
        raise SystemExit("--runs and --sizes must be positive")
    report = Report(NAME, params={"runs": args.runs, "sizes": args.sizes,
                                  "members": args.members, "keys": args.keys})  # fmt: skip
    if args.redis_url:
        asyncio.run(_heartbeat_figures(args.redis_url, sizes, args.runs, report))
    else:
        with RedisServer() as server:
            asyncio.run(_heartbeat_figures(server.url, sizes, args.runs, report))
    _ownership_figures(args, report)
    report.emit(args.json)
    return 0
