"""`weir bench fleet`: the long-request validation matrix in the fleet simulator.

Every scenario (or a replayed trace) under every policy — the baselines, Weir and the
oracle — on the same simulated traffic, plus a load sweep; with `--capacity`, each
policy's capacity at SLO on each scenario, found by bisection
(`fleetsim.report.slo_capacity`). Writes report.md, report.json and PNG plots to
`--out`, and prints Weir's goal ratios as figures (median and p99 over `--runs` seeds)
and the simulator's speed in simulated requests per CPU-second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weir.benchmarks._compiled_sim import CompiledSimError, run_compiled, running_compiled
from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "fleet"
HELP = "Simulate the validation matrix: Weir against the baselines on the same traffic."

DEFAULT_SWEEP = "0.5,0.75,1.0,1.25,1.5"
# A 70B-FP8 H200's whole KV (~151K tokens per engine) and a three-minute arrival window:
# long answers reach the KV's steady state within it (at 45 s only a quarter of the KV
# filled, docs/fleet-simulation.md).
DEFAULT_DURATION_S = 180.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="all", help="a scenario name, or 'all'")
    parser.add_argument("--engines", type=int, default=16, help="engines in the fleet")
    parser.add_argument("--trace", type=Path, help="replay a Mooncake JSONL or Azure CSV trace")
    parser.add_argument("--speedup", type=float, default=1.0, help="trace time compression")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fleet-report"))
    parser.add_argument(
        "--load", type=float, default=1.0, help="offered load, fraction of nominal capacity"
    )
    parser.add_argument(
        "--kv-scale",
        type=float,
        default=1.0,
        help="scale every engine's KV pool by this (request lengths stay as they are)",
    )
    parser.add_argument(
        "--drain", type=float, default=120.0, help="simulated seconds after the last arrival"
    )
    parser.add_argument(
        "--duration", type=float, default=DEFAULT_DURATION_S, help="arrival window, s"
    )
    parser.add_argument("--sweep", default=DEFAULT_SWEEP, help="loads for the sweep ('' = none)")
    parser.add_argument("--sweep-scenario", default="few_long_many_short")
    parser.add_argument("--policies", default="all", help="comma-separated, or 'all'")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="find every scenario and policy's capacity at SLO by bisection (long: "
        "about seven simulations per scenario and policy)",
    )
    parser.add_argument(
        "--capacity-target",
        type=float,
        default=0.9,
        help="share of requests that must meet their SLOs at the capacity",
    )
    parser.add_argument(
        "--capacity-tolerance",
        type=float,
        default=0.05,
        help="the search stops when the load that failed is within this fraction above "
        "the load that met the target",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="with --trace: replay it at the speedup where the best baseline sits at its "
        "capacity at SLO, found by bisection on the trace's first --calibrate-requests",
    )
    parser.add_argument("--calibrate-requests", type=int, default=5000)
    parser.add_argument(
        "--write-trace",
        type=Path,
        help="write --scenario's traffic for --engines at --load as a Mooncake JSONL trace "
        "of --trace-requests requests to this file, and exit (a synthetic trace to replay "
        "with --trace)",
    )
    parser.add_argument("--trace-requests", type=int, default=1_000_000)
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="run the simulator compiled by mypyc from the same source (same results, "
        "about 2x the speed; built once per source version into the user's cache, "
        "about two minutes on two cores; needs mypy and a C compiler)",
    )
    add_output_flags(parser)
    parser.set_defaults(runs=1)


def run(args: argparse.Namespace) -> int:
    from fleetsim.report import (
        CapacityJob,
        CellSpec,
        capacity_plot,
        capacity_rows,
        goals,
        json_safe,
        kv_plot,
        markdown_document,
        requests_per_cpu_s,
        run_capacities,
        run_cells,
        sweep_plot,
        trace_cell,
        ttft_cdf_plot,
    )
    from fleetsim.report.slo_capacity import probe_of
    from fleetsim.sim import policies
    from fleetsim.workloads import SCENARIOS

    known = list(policies())
    chosen = known if args.policies == "all" else args.policies.split(",")
    bad = [p for p in chosen if p not in known]
    sizes = (
        args.engines,
        args.runs,
        args.load,
        args.duration,
        args.kv_scale,
        args.speedup,
        args.drain,
        args.capacity_tolerance,
    )
    if bad or not min(sizes) > 0:
        raise SystemExit(
            f"bad arguments: unknown policies {bad} (known: {', '.join(known)})"
            if bad
            else "engines, runs, load, duration, kv-scale, speedup, drain and "
            "capacity-tolerance must be positive"
        )
    if not 0 < args.capacity_target <= 1:
        raise SystemExit("capacity-target must be a share within (0, 1]")
    if args.capacity and args.trace:
        raise SystemExit("--capacity searches the scenarios' loads; a trace's is its --speedup")
    if args.calibrate and not (args.trace and args.calibrate_requests > 0):
        raise SystemExit("--calibrate needs --trace and --calibrate-requests >= 1")
    if args.scenario != "all" and args.scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {args.scenario!r}; known: {', '.join(SCENARIOS)}")
    if args.write_trace:
        return _write_trace(args)
    if args.compiled and not running_compiled():
        try:
            return run_compiled(args.argv)
        except CompiledSimError as exc:
            raise SystemExit(f"--compiled: {exc}") from exc
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    seeds = [args.seed + r for r in range(args.runs)]
    loads = [float(x) for x in args.sweep.split(",") if x.strip()] if args.sweep else []

    def cell(scenario: str, policy: str, load: float, seed: int) -> CellSpec:
        return CellSpec(
            scenario,
            policy,
            load,
            seed,
            args.engines,
            args.duration,
            kv_scale=args.kv_scale,
            drain_s=args.drain,
        )

    capacities = []
    speedup = args.speedup
    if args.calibrate:
        capacities = _calibrate(args, chosen, seeds)
        best = max(capacities, key=lambda c: c.search.capacity)
        if best.search.capacity <= 0:
            raise SystemExit(
                f"--calibrate: no baseline meets {args.capacity_target:.0%} of its SLOs even "
                f"at 1/16 of the trace's rate on {args.engines} engines; give more engines"
            )
        speedup = args.speedup * best.search.capacity
    matrix: list[CellSpec] = []
    for seed in seeds:
        if args.trace:
            matrix += [
                trace_cell(args.trace, p, seed, args.engines, speedup, args.kv_scale, args.drain)
                for p in chosen
            ]
        else:
            matrix += [cell(n, p, args.load, seed) for n in names for p in chosen]
    sweep = [cell(args.sweep_scenario, p, x, args.seed) for x in loads for p in chosen]
    if args.trace:
        sweep = []
    cpu = _CpuClock()
    started = time.perf_counter()
    # A sweep point that is also a matrix cell (same scenario, load and seed) runs once.
    unique = list(dict.fromkeys([*matrix, *sweep]))
    done = dict(zip(unique, run_cells(unique, args.jobs), strict=True))
    elapsed = time.perf_counter() - started
    simulated = sum(c.summary["offered"] for c in done.values())
    matrix_cells = [done[c] for c in matrix]
    sweep_cells = [done[c] for c in sweep]
    # Goals near and past saturation: the matrix load, and every other swept load.
    goal_rows = goals(list({id(c): c for c in [*matrix_cells, *sweep_cells]}.values()))

    capacity_s = 0.0
    if args.capacity:
        jobs = []
        for n in names:
            for p in chosen:
                # Loads already run for every seed are the search's probes too.
                runs: dict[float, list[dict[str, Any]]] = {}
                for spec, c in done.items():
                    if (spec.scenario, spec.policy) == (n, p):
                        runs.setdefault(spec.load, []).append(c.summary)
                probes = tuple(
                    probe_of(load, summaries)
                    for load, summaries in runs.items()
                    if len(summaries) == len(seeds)
                )
                jobs.append(
                    CapacityJob(
                        cell(n, p, args.load, args.seed),
                        tuple(seeds),
                        args.capacity_target,
                        args.capacity_tolerance,
                        probes,
                    )
                )
        started = time.perf_counter()
        capacities = run_capacities(jobs, args.jobs)
        capacity_s = time.perf_counter() - started
        # What the searches ran themselves (the probes they were given ran above).
        simulated += sum(
            p.offered
            for c, job in zip(capacities, jobs, strict=True)
            for p in c.search.probes
            if p not in job.known
        )
    cpu_s = cpu.elapsed()

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    first = [c for c in matrix_cells if c.spec.seed == args.seed]
    plots = [ttft_cdf_plot(first, out / "ttft_cdf.png"), kv_plot(first, out / "kv_over_time.png")]
    if sweep_cells:
        plots.append(sweep_plot(sweep_cells, out / "goodput_vs_load.png"))
    if capacities:
        plots.append(
            capacity_plot(capacities, args.capacity_target, out / "attainment_vs_load.png")
        )
    params = {
        "scenario": "trace" if args.trace else args.scenario,
        "engines": args.engines,
        "load": args.load,
        "duration_s": args.duration,
        "kv_scale": args.kv_scale,
        "drain_s": args.drain,
        "seeds": seeds,
        "sweep": loads,
        "policies": chosen,
        "wall_s": round(elapsed, 1),
    }
    if args.trace:
        params["speedup"] = speedup
    if args.calibrate:
        params |= {"calibrated_on_requests": args.calibrate_requests, "given_speedup": args.speedup}
    if args.capacity or args.calibrate:
        params |= {
            "capacity_target": args.capacity_target,
            "capacity_tolerance": args.capacity_tolerance,
            "capacity_wall_s": round(capacity_s, 1),
        }
    document = {
        "params": params,
        "cells": [
            {
                "scenario": c.spec.scenario,
                "policy": c.spec.policy,
                "seed": c.spec.seed,
                "load": c.spec.load,
                **c.summary,
                "cpu_s": c.cpu_s,
                "requests_per_cpu_s": requests_per_cpu_s(c),
            }
            for c in matrix_cells
        ],
        "goals": goal_rows,
        "sweep": [{"policy": c.spec.policy, "load": c.spec.load, **c.summary} for c in sweep_cells],
        "capacity": capacity_rows(capacities),
        "capacity_curves": [
            {
                "scenario": c.scenario,
                "policy": c.policy,
                "capacity": c.search.capacity,
                "capacity_rps": c.capacity_rps,
                "limit": c.search.limit,
                "probes": [
                    {
                        "load": p.load,
                        "slo_attainment": p.attainment,
                        "goodput_rps": p.goodput_rps,
                        "rejected": p.rejected,
                        "offered": p.offered,
                    }
                    for p in c.search.probes
                ],
            }
            for c in capacities
        ],
    }
    (out / "report.json").write_text(json.dumps(json_safe(document), indent=1) + "\n")
    (out / "report.md").write_text(
        markdown_document(first, goal_rows, sweep_cells, capacities, params)
    )

    report = Report(NAME, params={**params, "out": str(out)})
    _figures(report, goal_rows)
    _capacity_figures(report, capacity_rows(capacities))
    report.add(Figure("wall time", elapsed, "s", goal="< 900", met=elapsed < 900))
    if args.capacity:
        report.add(Figure("capacity search wall time", capacity_s, "s"))
    report.add(
        Figure(
            "simulated requests per CPU-second",
            simulated / cpu_s if cpu_s > 0 else math.nan,
            "req/s",
            note=f"{simulated} requests in {cpu_s:.0f} CPU-s, every worker process",
        )
    )
    _speed_figures(report, list(done.values()))
    report.emit(args.json)
    return 0


def _calibrate(args: argparse.Namespace, chosen: Sequence[str], seeds: Sequence[int]) -> list[Any]:
    """Every chosen baseline's capacity at SLO on the trace's first requests, its load a
    multiple of the trace's rate at `--speedup` (`fleetsim.report.slo_capacity`'s
    bisection): the replay runs where the best of them sits at its capacity."""
    from fleetsim.report import CapacityJob, run_capacities, trace_cell
    from fleetsim.sim import is_baseline

    baselines = [p for p in chosen if is_baseline(p)]
    if not baselines:
        raise SystemExit("--calibrate needs a baseline among --policies")
    jobs = [
        CapacityJob(
            trace_cell(
                args.trace,
                p,
                args.seed,
                args.engines,
                args.speedup,
                args.kv_scale,
                args.drain,
                args.calibrate_requests,
            ),
            tuple(seeds),
            args.capacity_target,
            args.capacity_tolerance,
        )
        for p in baselines
    ]
    return run_capacities(jobs, args.jobs)


def _write_trace(args: argparse.Namespace) -> int:
    """A scenario's traffic as a trace: its arrival window is as long as `--trace-requests`
    take at the scenario's nominal rate for the fleet times `--load`."""
    from fleetsim.report import CellSpec
    from fleetsim.report.matrix import nominal_rps
    from fleetsim.workloads import scenario, write_trace

    if args.scenario == "all" or args.trace_requests < 1:
        raise SystemExit("--write-trace needs one --scenario and --trace-requests >= 1")
    spec = CellSpec(args.scenario, "", args.load, args.seed, args.engines, args.duration,
                    kv_scale=args.kv_scale)  # fmt: skip
    rate = nominal_rps(spec) * args.load
    window = args.trace_requests / rate
    specs = scenario(args.scenario).with_duration(window).generate(rate, args.seed)
    written = write_trace(specs[: args.trace_requests], args.write_trace)
    print(f"{args.write_trace}: {written} requests of {args.scenario} at {rate:.1f} req/s "
          f"({args.load:g} x nominal for {args.engines} engines), {window:.0f} s")  # fmt: skip
    return 0


class _CpuClock:
    """CPU seconds of this process and of the worker processes it has waited for."""

    def __init__(self) -> None:
        self._start = self._now()

    @staticmethod
    def _now() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime

    def elapsed(self) -> float:
        return self._now() - self._start


_GOALS: tuple[tuple[str, str, str, str, Callable[[float], bool]], ...] = (
    ("goodput_ratio", "goodput vs best baseline", "x", ">= 1.5", lambda v: v >= 1.5),
    ("short_ttft_p99_ratio", "short p99 TTFT vs best", "x", "<= 0.5", lambda v: v <= 0.5),
    ("kv_exhaustion_events", "KV exhaustion events", "events", "0", lambda v: v == 0),
    (
        "low_priority_within_max_wait",
        "low-pri first token in max wait",
        "share",
        "1",
        lambda v: v >= 1.0,
    ),
    ("lost", "accepted requests lost", "requests", "0", lambda v: v == 0),
)


def _speed_figures(report: Report, cells: Sequence[Any]) -> None:
    """Per policy, the simulator's speed over its matrix and sweep cells (each cell's
    own CPU time in its worker; report.md has every cell's)."""
    for policy in dict.fromkeys(c.spec.policy for c in cells):
        mine = [c for c in cells if c.spec.policy == policy]
        requests, cpu_s = sum(c.summary["offered"] for c in mine), sum(c.cpu_s for c in mine)
        report.add(
            Figure(
                f"{policy}: simulated requests per CPU-second",
                requests / cpu_s if cpu_s > 0 else math.nan,
                "req/s",
                note=f"{requests} requests in {cpu_s:.1f} CPU-s over {len(mine)} cell(s)",
            )
        )


def _capacity_figures(report: Report, rows: Sequence[dict[str, Any]]) -> None:
    for row in rows:
        name = row["scenario"]
        versus = row["weir_vs_best"]
        if row["best_baseline"] and not math.isnan(versus):
            report.add(
                Figure(
                    f"{name}: capacity at SLO vs best baseline",
                    versus,
                    "x",
                    goal=">= 1.5",
                    met=versus >= 1.5,
                    note=row["best_baseline"],
                )
            )
        weir = row["policies"].get("weir")
        if weir is not None and not math.isnan(weir["oracle_fraction"]):
            report.add(Figure(f"{name}: Weir capacity / oracle", weir["oracle_fraction"], "x"))


def _figures(report: Report, rows: list[dict[str, Any]]) -> None:
    for scenario, load in dict.fromkeys((str(r["scenario"]), float(r["load"])) for r in rows):
        name = f"{scenario}@{load:.0%}"
        mine = [r for r in rows if r["scenario"] == scenario and r["load"] == load]
        for key, label, unit, goal, ok in _GOALS:
            values = [float(r[key]) for r in mine if math.isfinite(float(r[key]))]
            if not values:
                continue
            median, p99 = median_p99(values)
            report.add(Figure(f"{name}: {label}", median, unit, p99, goal, ok(median)))
