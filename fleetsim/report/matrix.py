"""Running the validation matrix: every scenario under every policy, plus a load sweep.

A cell is one simulation: one workload (a scenario at a load, or a trace), one policy,
one seed. Cells are independent, so they run in worker processes; each is deterministic
for its seed, so the matrix is too, whatever the number of workers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from controlplane.rules.fairness import tenant_weights
from fleetsim.report.metrics import summarize
from fleetsim.sim import FleetConfig, Simulation, engine_config_for, is_baseline, policies
from fleetsim.sim.capacity import nominal_capacity_rps
from fleetsim.workloads import RequestSpec, Scenario, read_trace, scenario

TRACE = "trace"


@dataclass(frozen=True, slots=True)
class CellSpec:
    scenario: str  # a scenario name, or TRACE
    policy: str
    load: float
    seed: int
    engines: int
    duration_s: float
    trace: str = ""
    speedup: float = 1.0
    kv_scale: float = 1.0
    drain_s: float = 300.0
    trace_limit: int = 0  # replay the trace's first requests only (0: all of them)


@dataclass(slots=True)
class Cell:
    spec: CellSpec
    summary: dict[str, Any]
    capacity_rps: float
    # CPU seconds this cell's simulation and summary took in its worker (process time,
    # not wall: the simulator's speed on a shared machine); kept out of `summary`, which
    # is a pure function of the cell.
    cpu_s: float = 0.0
    short_ttft: list[float] = field(default_factory=list)
    kv_max: list[tuple[float, float]] = field(default_factory=list)


def fleet_config(spec: CellSpec) -> FleetConfig:
    """The fleet of a cell: a scenario's P/D split, its engines' KV and its tenant quotas
    in Weir's pool policy (a trace runs on a colocated fleet without quotas)."""
    config = FleetConfig(engines=spec.engines, kv_scale=spec.kv_scale, drain_s=spec.drain_s)
    if spec.scenario == TRACE:
        return config
    s = scenario(spec.scenario)
    prefill = round(spec.engines * s.prefill_share) if s.prefill_share else 0
    config = replace(
        config,
        kv_scale=spec.kv_scale * s.kv_factor,
        prefill_engines=min(spec.engines - 1, max(1, prefill)) if prefill else 0,
        decode_kv_factor=s.decode_kv_factor,
    )
    fleet_kv = spec.engines * engine_config_for(config).total_tokens
    tenants = s.quotas_for(fleet_kv)
    return replace(config, policy=msgspec.structs.replace(config.policy, tenants=tenants))


def workload(spec: CellSpec, config: FleetConfig) -> tuple[list[RequestSpec], float, Any]:
    """The requests of a cell, the fleet's nominal capacity for them, and fleet events."""
    if spec.scenario == TRACE:
        specs = _trace(spec)
        engine = engine_config_for(replace(config, kv_scale=spec.kv_scale))
        return specs, nominal_capacity_rps(specs, engine, spec.engines), ()
    s = scenario(spec.scenario).with_duration(spec.duration_s)
    capacity = _nominal(s, spec, config)
    return s.generate(capacity * spec.load, spec.seed), capacity, s.failures


def _trace(spec: CellSpec) -> list[RequestSpec]:
    """A trace cell's requests: its load multiplies the trace's speedup (a capacity search
    over a trace compresses its time further or stretches it)."""
    return read_trace(spec.trace, speedup=spec.speedup * spec.load, limit=spec.trace_limit)


def nominal_rps(spec: CellSpec) -> float:
    """The rate (requests per second) a cell's load is a multiple of: a scenario's
    nominal capacity, or a trace's own arrival rate at its speedup."""
    if spec.scenario == TRACE:
        specs = _trace(replace(spec, load=1.0))
        window = specs[-1].arrival_s - specs[0].arrival_s
        return len(specs) / window if window > 0 else math.inf
    return _nominal(
        scenario(spec.scenario).with_duration(spec.duration_s), spec, fleet_config(spec)
    )


def _nominal(s: Scenario, spec: CellSpec, config: FleetConfig) -> float:
    # From a large sample of the same mix (a different seed: the estimate must not depend
    # on the run's own draw), with the KV of the cell, not a scenario's small-KV engines:
    # their load is the full fleet's.
    sample = s.with_duration(200.0).generate(20.0, seed=10_000 + spec.seed)
    engine = engine_config_for(replace(config, kv_scale=spec.kv_scale))
    return nominal_capacity_rps(sample, engine, spec.engines)


def run_cell(spec: CellSpec) -> Cell:
    started = time.process_time()
    config = fleet_config(spec)
    specs, capacity, failures = workload(spec, config)
    policy = policies(spec.seed)[spec.policy]()
    sim = Simulation(specs, policy, config, failures=failures)
    result = sim.run()
    timing = sim.engine_config.timing
    per_token = (
        2.0 * timing.model.params / (timing.hardware.flops * timing.hardware.compute_efficiency)
    )
    summary = summarize(result, config.slo, per_token, tenant_weights(config.policy.tenants))
    summary["capacity_rps"] = capacity
    summary["load"] = spec.load
    short = sorted(f.ttft_s for f in result.flights if f.completed and not f.spec.is_long)
    kv = [(s.at, s.max_usage) for s in result.kv_samples]
    return Cell(spec, summary, capacity, time.process_time() - started, short, kv)


def requests_per_cpu_s(cell: Cell) -> float:
    """The simulator's speed on one cell: requests simulated per CPU-second."""
    return cell.summary["offered"] / cell.cpu_s if cell.cpu_s > 0 else math.nan


def run_cells(cells: Sequence[CellSpec], jobs: int = 1) -> list[Cell]:
    if jobs <= 1 or len(cells) <= 1:
        return [run_cell(c) for c in cells]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_cell, cells))


def goals(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """The issue's goals, per scenario and seed, for Weir against the best baseline (the
    oracle is a limit, not a baseline); refusals beside goodput for both."""
    by_key: dict[tuple[str, float, int], dict[str, dict[str, Any]]] = {}
    for cell in cells:
        key = (cell.spec.scenario, cell.spec.load, cell.spec.seed)
        by_key.setdefault(key, {})[cell.spec.policy] = cell.summary
    rows = []
    for (name, load, seed), summaries in sorted(by_key.items()):
        weir = summaries.get("weir")
        baselines = {p: s for p, s in summaries.items() if is_baseline(p)}
        if weir is None or not baselines:
            continue
        best_goodput = max(baselines.items(), key=lambda item: item[1]["goodput_rps"])
        best_ttft = min(
            baselines.items(),
            key=lambda item: _nan_last(item[1]["short_ttft_s"]["p99"]),
        )
        goodput_ratio = ratio(weir["goodput_rps"], best_goodput[1]["goodput_rps"])
        ttft_ratio = ratio(weir["short_ttft_s"]["p99"], best_ttft[1]["short_ttft_s"]["p99"])
        starve = weir["starvation"]["within_max_wait_share"]
        rows.append(
            {
                "scenario": name,
                "load": load,
                "seed": seed,
                "goodput_ratio": goodput_ratio,
                "goodput_best_baseline": best_goodput[0],
                "rejected": weir["rejected"],
                "best_baseline_rejected": best_goodput[1]["rejected"],
                "goodput_goal_met": goodput_ratio >= 1.5,
                "short_ttft_p99_ratio": ttft_ratio,
                "short_ttft_best_baseline": best_ttft[0],
                "short_ttft_goal_met": ttft_ratio <= 0.5,
                "kv_exhaustion_events": weir["kv_exhaustion_events"],
                "low_priority_within_max_wait": starve,
                "low_priority_goal_met": math.isnan(starve) or starve >= 1.0,
                "lost": weir["lost"],
            }
        )
    return rows


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is unknown or both are 0, infinite for a > 0 over 0."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


def _nan_last(value: float) -> float:
    return math.inf if math.isnan(value) else value


def trace_cell(
    path: Path,
    policy: str,
    seed: int,
    engines: int,
    speedup: float,
    kv_scale: float = 1.0,
    drain_s: float = 300.0,
    limit: int = 0,
) -> CellSpec:
    return CellSpec(
        TRACE, policy, 1.0, seed, engines, 0.0, str(path), speedup, kv_scale, drain_s, limit
    )
