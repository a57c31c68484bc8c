"""Weir's sidecars in the simulator run the live sidecar's latency model: each new request
is forecast when it reaches a sidecar, the model learns from the requests that finish, and
what it publishes is what the router's SLO-risk term reads in production."""

from __future__ import annotations

import pytest

from fleetsim.report.metrics import summarize
from fleetsim.sim import SLO, FleetConfig, Simulation, WeirPolicy
from fleetsim.workloads import scenario


def test_the_latency_model_learns_the_engines_and_its_error_is_reported() -> None:
    specs = scenario("short_in_long_out").with_duration(5.0).generate(10.0, seed=4)
    weir = WeirPolicy()
    result = Simulation(specs, weir, FleetConfig(engines=2)).run()
    finished = [f.tpot_s for f in result.flights if f.completed and f.generated > 1]
    assert finished
    for sidecar in weir.sidecars:
        state = weir._views[sidecar.index].state
        # The TPOT moved off its 20 ms prior toward the engines' real pace, and the
        # published terms are the model's own.
        assert state.predicted_tpot_s != pytest.approx(0.02)
        assert min(finished) * 0.5 <= state.predicted_tpot_s <= max(finished) * 1.5
        assert state.predicted_prefill_s_per_token > 0.0
        assert sidecar.ledger.latency.samples > 0
    judged = [f for f in result.flights if f.ttft_error >= 0]
    # Every request that reached its first token undisturbed was judged.
    assert len(judged) == sum(not f.preemptions and f.first_token_at >= 0 for f in result.flights)
    assert all(f.tpot_error >= 0 for f in judged if f.completed and f.generated > 1)
    mape = summarize(result, SLO(), 5e-5)["latency_mape"]
    assert mape["n"] == len(judged)
    assert mape["ttft"] == pytest.approx(sum(f.ttft_error for f in judged) / len(judged))
    tpot = [f.tpot_error for f in judged if f.tpot_error >= 0]
    assert mape["tpot"] == pytest.approx(sum(tpot) / len(tpot))
