"""Capacity at SLO: the highest offered load a policy sustains with its SLOs met.

Goodput at one load point says little about a policy that is far from saturation or far
past it. The field's measure (DistServe's "goodput") is the highest request rate at which
a policy still meets its SLOs for a given share of requests; here that share is 90 % by
default (`slo_attainment` in `fleetsim.report.metrics`), and the rate is an offered load,
a fraction of the scenario's nominal capacity (`fleetsim.sim.capacity`), so that
scenarios and fleets of any size read the same way.

The load is found by bisection rather than read off a grid: from `start` the load
doubles (or halves) until one load meets the target and another does not, then the
interval between them is halved until it is narrower than `tolerance` (relative). Every
probe is kept: they are the load-vs-attainment curve the report shows.

Attainment is not monotone in load in a simulation: each load draws its own requests,
and near the knee a handful of them decide. The search keeps two facts: `failed`, the
lowest load that missed the target, and `met`, the highest load below it that made it;
the answer is `met` once `failed ≤ met × (1 + tolerance)`. It never looks above the
lowest load that failed, so a dip it runs into bounds the answer even where higher loads
would meet the target again: the capacity is the first crossing the search meets, the
conservative reading. Several seeds per load (pooled into one attainment) lower the
noise itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from fleetsim.report.matrix import CellSpec, nominal_rps, ratio, run_cell
from fleetsim.sim import ORACLE_NAME, WEIR_NAME, is_baseline

# The search's reach, as fractions of the nominal capacity: a policy that meets the SLO
# at the highest load is reported as at least that ("above"), one that misses it at the
# lowest as below it ("below").
START = 1.0
LOWEST = 1 / 16
HIGHEST = 8.0
TARGET = 0.9
TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class Probe:
    """One offered load and what it measured (pooled over seeds)."""

    load: float
    attainment: float
    goodput_rps: float = math.nan
    rejected: int = 0
    offered: int = 0


@dataclass(frozen=True, slots=True)
class CapacitySearch:
    """`capacity` is the load found (0 when even the lowest missed the target);
    `limit` says whether it is bracketed ("") or the search's edge ("below", "above")."""

    capacity: float
    limit: str
    probes: tuple[Probe, ...]

    def at(self, load: float) -> Probe | None:
        return next((p for p in self.probes if p.load == load), None)


def search_capacity(
    measure: Callable[[float], Probe],
    *,
    target: float = TARGET,
    start: float = START,
    lowest: float = LOWEST,
    highest: float = HIGHEST,
    tolerance: float = TOLERANCE,
) -> CapacitySearch:
    """The highest load whose probe's attainment is at least `target` (see the module
    docstring for how noise is treated). `measure(load)` runs the load."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target attainment must be within (0, 1], got {target}")
    if not 0.0 < lowest <= start <= highest < math.inf:
        raise ValueError(f"need 0 < lowest <= start <= highest, got {lowest}, {start}, {highest}")
    if not 0.0 < tolerance < math.inf:
        raise ValueError(f"tolerance must be positive, got {tolerance}")
    probes: dict[float, Probe] = {}

    def meets(load: float) -> bool:
        if load not in probes:
            probes[load] = measure(load)
        return probes[load].attainment >= target  # NaN never meets it

    def result(capacity: float, limit: str) -> CapacitySearch:
        return CapacitySearch(capacity, limit, tuple(probes[x] for x in sorted(probes)))

    met, failed = 0.0, math.inf
    if meets(start):
        met = start
        while failed == math.inf:
            if met >= highest:
                return result(highest, "above")
            load = min(2.0 * met, highest)
            if meets(load):
                met = load
            else:
                failed = load
    else:
        failed = start
        while met == 0.0:
            load = failed / 2.0
            if load < lowest:
                return result(0.0, "below")
            if meets(load):
                met = load
            else:
                failed = load
    while failed > met * (1.0 + tolerance):
        load = (met + failed) / 2.0
        if meets(load):
            met = load
        else:
            failed = load
    return result(met, "")


def probe_of(load: float, summaries: Sequence[dict[str, Any]]) -> Probe:
    """One load's probe from its runs' summaries: attainment pooled over the requests of
    every seed (not a mean of ratios), goodput averaged, refusals and requests summed."""
    judged = sum(s["offered"] - s["unjudged"] for s in summaries)
    return Probe(
        load,
        sum(s["slo_met"] for s in summaries) / judged if judged else math.nan,
        sum(s["goodput_rps"] for s in summaries) / len(summaries),
        sum(s["rejected"] for s in summaries),
        sum(s["offered"] for s in summaries),
    )


@dataclass(frozen=True, slots=True)
class CapacityJob:
    """One policy's search on one scenario: every probe runs `cell` at the probe's load
    for each seed. `known` holds probes already measured (the matrix's own load)."""

    cell: CellSpec
    seeds: tuple[int, ...]
    target: float = TARGET
    tolerance: float = TOLERANCE
    known: tuple[Probe, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class Capacity:
    scenario: str
    policy: str
    nominal_rps: float  # the scenario's nominal capacity (seed of the first run)
    search: CapacitySearch

    @property
    def capacity_rps(self) -> float:
        return self.search.capacity * self.nominal_rps


def run_capacity(job: CapacityJob) -> Capacity:
    known = {p.load: p for p in job.known}

    def measure(load: float) -> Probe:
        if load in known:
            return known[load]
        cells = [run_cell(replace(job.cell, load=load, seed=seed)) for seed in job.seeds]
        return probe_of(load, [c.summary for c in cells])

    search = search_capacity(measure, target=job.target, tolerance=job.tolerance)
    spec = replace(job.cell, seed=job.seeds[0])
    return Capacity(spec.scenario, spec.policy, nominal_rps(spec), search)


def run_capacities(jobs: Sequence[CapacityJob], workers: int = 1) -> list[Capacity]:
    """Every job's search, one search per worker process at a time (a search's probes
    depend on each other; different searches do not)."""
    if workers <= 1 or len(jobs) <= 1:
        return [run_capacity(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run_capacity, jobs))


def capacity_rows(capacities: Sequence[Capacity]) -> list[dict[str, Any]]:
    """Per scenario: every policy's capacity (load, requests/s, the search's edge) and
    its fraction of the oracle's; Weir's against the best baseline's. A capacity at the
    search's lower edge counts as 0, one at its upper edge as that edge."""
    rows = []
    for name in dict.fromkeys(c.scenario for c in capacities):
        mine = {c.policy: c for c in capacities if c.scenario == name}
        oracle = mine.get(ORACLE_NAME)
        limit = oracle.search.capacity if oracle is not None else math.nan
        policies = {
            p: {
                "capacity": c.search.capacity,
                "capacity_rps": c.capacity_rps,
                "limit": c.search.limit,
                "oracle_fraction": ratio(c.search.capacity, limit),
            }
            for p, c in mine.items()
        }
        baselines = {p: c.search.capacity for p, c in mine.items() if is_baseline(p)}
        best = max(baselines, key=lambda p: baselines[p]) if baselines else ""
        weir = mine.get(WEIR_NAME)
        rows.append(
            {
                "scenario": name,
                "policies": policies,
                "best_baseline": best,
                "weir_vs_best": ratio(
                    weir.search.capacity if weir else math.nan,
                    baselines[best] if best else math.nan,
                ),
            }
        )
    return rows
