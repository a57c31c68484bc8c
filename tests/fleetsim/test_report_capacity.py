"""Capacity at SLO: the bisection over load on toy attainment curves, and how capacities
are read against the oracle and the baselines (`test_report_bench.py` runs real
searches through `weir bench fleet --capacity`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from fleetsim.report import Capacity, CapacitySearch, Probe, capacity_rows, search_capacity
from fleetsim.report.slo_capacity import HIGHEST, probe_of


def _counted(curve: Callable[[float], float]) -> tuple[Callable[[float], Probe], list[float]]:
    loads: list[float] = []

    def measure(load: float) -> Probe:
        loads.append(load)
        return Probe(load, curve(load))

    return measure, loads


def _logistic(knee: float) -> Callable[[float], float]:
    """Attainment falling smoothly through 0.9 at exactly `knee`."""
    return lambda x: 1.0 / (1.0 + math.exp(12.0 * (x - knee)) / 9.0)


def _holds(search: CapacitySearch, target: float, tolerance: float) -> None:
    """What the search promises: the capacity met the target, a load within tolerance
    above it did not, and no load at or below it failed."""
    loads = [p.load for p in search.probes]
    assert loads == sorted(set(loads))
    assert search.at(search.capacity) is not None
    failing = [p.load for p in search.probes if not p.attainment >= target]
    assert all(x > search.capacity for x in failing)
    assert min(failing) <= search.capacity * (1 + tolerance)


@pytest.mark.parametrize("knee", [0.3, 1.37, 3.1])
def test_a_monotone_curve_gives_its_exact_capacity_within_tolerance(knee: float) -> None:
    curve = _logistic(knee)
    assert curve(knee) == pytest.approx(0.9)
    measure, loads = _counted(curve)
    search = search_capacity(measure, tolerance=0.02)
    assert search.limit == ""
    assert knee / 1.02 <= search.capacity <= knee
    _holds(search, 0.9, 0.02)
    assert len(loads) == len(set(loads)) <= 10  # each load once, logarithmically many


def test_the_edges_of_the_search_are_reported_as_bounds() -> None:
    always = search_capacity(lambda x: Probe(x, 1.0))
    assert (always.capacity, always.limit) == (HIGHEST, "above")
    never = search_capacity(lambda x: Probe(x, 0.5))
    assert (never.capacity, never.limit) == (0.0, "below")
    unknown = search_capacity(lambda x: Probe(x, math.nan))  # no request could be judged
    assert unknown.limit == "below"


def test_a_noisy_curve_gives_a_crossing_inside_the_noise_band() -> None:
    """Attainment that wobbles ±4 points around a line through 0.9 at 2.0: the answer is a
    crossing the search saw — met there, failed just above, nothing failed below — and
    it lies where the noise allows one (between the loads where line ∓ noise cross)."""
    amplitude = 0.04

    def curve(x: float) -> float:
        return 0.9 - 0.2 * (x - 2.0) + amplitude * math.sin(23.0 * x)

    search = search_capacity(lambda x: Probe(x, curve(x)), tolerance=0.05)
    _holds(search, 0.9, 0.05)
    earliest, latest = 2.0 - amplitude / 0.2, 2.0 + amplitude / 0.2
    assert earliest / 1.05 <= search.capacity <= latest


def test_a_dip_the_search_runs_into_is_the_capacity() -> None:
    """Conservative by rule: a load that missed the target bounds the answer even when
    loads above it would meet it again (noise, or a real dip)."""
    search = search_capacity(lambda x: Probe(x, 0.5 if 0.9 <= x <= 1.1 else 1.0))
    assert search.limit == ""
    assert 0.9 / 1.05 <= search.capacity < 0.9
    assert search.at(1.0) is not None
    assert search.at(2.0) is None  # never looked past the failure


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target": 0.0}, "target"),
        ({"target": 1.5}, "target"),
        ({"start": 0.01}, "lowest <= start"),
        ({"highest": math.inf}, "lowest <= start"),
        ({"tolerance": 0.0}, "tolerance"),
        ({"tolerance": math.nan}, "tolerance"),
    ],
)
def test_bad_search_bounds_are_refused(change: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        search_capacity(lambda x: Probe(x, 1.0), **change)


def test_seeds_are_pooled_by_request_not_averaged_by_run() -> None:
    small = {"offered": 10, "unjudged": 0, "slo_met": 10, "goodput_rps": 1.0, "rejected": 0}
    large = {"offered": 100, "unjudged": 10, "slo_met": 45, "goodput_rps": 3.0, "rejected": 7}
    probe = probe_of(1.5, [small, large])
    assert probe == Probe(1.5, 55 / 100, 2.0, 7, 110)


def test_capacities_are_read_against_the_oracle_and_the_best_baseline() -> None:
    def found(policy: str, capacity: float, limit: str = "") -> Capacity:
        return Capacity("s", policy, 10.0, CapacitySearch(capacity, limit, ()))

    rows = capacity_rows(
        [
            found("round_robin", 0.5),
            found("llmd_weighted", 0.8),
            found("max_tokens_reserve", 0.0, "below"),
            found("weir", 1.2),
            found("oracle", 1.6),
        ]
    )
    (row,) = rows
    assert row["best_baseline"] == "llmd_weighted"  # the oracle is no baseline
    assert row["weir_vs_best"] == pytest.approx(1.5)
    weir = row["policies"]["weir"]
    assert (weir["capacity_rps"], weir["oracle_fraction"]) == (12.0, pytest.approx(0.75))
    assert row["policies"]["max_tokens_reserve"]["oracle_fraction"] == 0.0
    assert row["policies"]["oracle"]["oracle_fraction"] == 1.0
