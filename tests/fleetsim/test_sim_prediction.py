"""Weir's sidecars in the simulator publish the live sidecar's TPOT estimate, so the
router's SLO-risk term reads what it reads in production."""

from __future__ import annotations

import pytest

from fleetsim.sim import FleetConfig, Simulation, WeirPolicy
from fleetsim.workloads import scenario


def test_published_tpot_follows_the_requests_that_finished() -> None:
    specs = scenario("short_in_long_out").with_duration(5.0).generate(10.0, seed=4)
    weir = WeirPolicy()
    result = Simulation(specs, weir, FleetConfig(engines=2)).run()
    finished = [f.tpot_s for f in result.flights if f.completed and f.generated > 1]
    assert finished
    for sidecar in weir.sidecars:
        published = weir._views[sidecar.index].state.predicted_tpot_s
        # The smoothed estimate moved off its 20 ms prior to the engines' real pace.
        assert published != pytest.approx(0.02)
        assert min(finished) * 0.5 <= published <= max(finished) * 1.5
