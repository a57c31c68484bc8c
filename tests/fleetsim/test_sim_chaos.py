"""The live chaos test's shape in the simulator (tests/router/test_promise_under_load.py,
`weir bench chaos`), scaled to engines at a real GPU's pace: a KV burst on small-KV
engines, an engine lost for good then a sidecar, and scenario 10 of the matrix. The
simulator runs the shipped orchestration (relief with reservations, the sidecar queue,
the router's dispatch), and gives the live test's counts: every admitted stream ends
with its natural finish and exactly its tokens, none ends `resume_failed`, and
everything preempted is resumed."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from controlplane.contract import FinishReason
from fleetsim.report.matrix import CellSpec, fleet_config, workload
from fleetsim.report.metrics import is_lost
from fleetsim.sim import FleetConfig, SimFlight, Simulation, policies
from fleetsim.sim.config import default_pool_policy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec
from fleetsim.workloads.scenarios import EngineFailure

# The dispatch core's refusal of a resume nobody took in time, as the simulator ends it.
RESUME_FAILED = "continuation found no endpoint"


def _streams(count: int, prompt: int, answer: int) -> list[RequestSpec]:
    """`count` streams asked for at once, each its own prompt, each answering `answer`
    tokens whatever its length hint (ignore_eos), from patient clients (as the live
    test's, which wait for the router's queue)."""

    def blocks(i: int) -> tuple[int, ...]:
        return tuple(range(1000 * i + 1, 1000 * i + 1 + -(-prompt // BLOCK_TOKENS)))

    return [
        RequestSpec(
            f"s{i:03d}", i / 1000, "t", 0, prompt, answer, answer, blocks(i), max_wait_s=120.0
        )
        for i in range(count)
    ]


def _preempted(flights: list[SimFlight]) -> Counter[str]:
    return sum((Counter(f.preemptions) for f in flights), Counter())


def _assert_whole(flights: list[SimFlight]) -> None:
    """Every stream ran to its natural end with exactly the tokens it asked for."""
    for f in flights:
        assert f.reason is FinishReason.LENGTH, (f.rid, f.reason, f.detail)
        assert f.generated == f.spec.generated_tokens, f.rid


@pytest.mark.parametrize("resume_wait_s", [60.0, 1.0])
def test_a_kv_burst_on_small_kv_engines_keeps_every_stream(resume_wait_s: float) -> None:
    """Four times the KV the fleet has, asked for at once: admission queues what does not
    fit, relief preempts as answers grow (into room held at a peer, or in place), and
    every stream ends whole. A resume waits behind streams that run far longer than the
    pool's resume wait: queued at an endpoint, as accepted work, it is not lost for it
    (with a 1 s wait, 3 of 12 streams were, before)."""
    specs = _streams(12, 350, 800)
    base = default_pool_policy()
    policy = msgspec.structs.replace(
        base, routing=msgspec.structs.replace(base.routing, resume_wait_s=resume_wait_s)
    )
    config = FleetConfig(engines=3, kv_tokens=3000, drain_s=600.0, policy=policy)
    result = Simulation(specs, policies()["weir"](), config).run()
    _assert_whole(result.flights)
    preempted = _preempted(result.flights)
    assert preempted["recompute"] + preempted["migrate"] > 0, "the burst never ran into relief"
    assert result.exhaustion_events == 0


def test_an_engine_and_then_a_sidecar_lost_for_good_lose_no_stream() -> None:
    """Two of three endpoints die mid-stream, one after the other, and do not come back:
    the router resumes each of their streams on what is left, token for token."""
    specs = _streams(8, 350, 500)
    config = FleetConfig(engines=3, kv_tokens=20_000, drain_s=600.0)
    failures = (EngineFailure(at_s=4.0, engine=0), EngineFailure(at_s=8.0, engine=1))
    result = Simulation(specs, policies()["weir"](), config, failures=failures).run()
    _assert_whole(result.flights)
    moved = [f for f in result.flights if "failover" in f.preemptions]
    assert moved
    assert {f.preemptions["failover"] for f in moved} <= {1, 2}


def test_scenario_10_scaled_loses_nothing_it_admitted() -> None:
    """The matrix's failure scenario on a smaller fleet: cancellations and deadlines end
    streams by their clients' choice; the two lost endpoints' streams all resume."""
    spec = CellSpec("cancel_deadline_failure", "weir", 1.0, 0, 4, 30.0, kv_scale=0.25)
    config = fleet_config(spec)
    specs, _, failures = workload(spec, config)
    assert len(failures) == 2
    result = Simulation(specs, policies(0)["weir"](), config, failures=failures).run()
    assert not [(f.rid, f.reason, f.detail) for f in result.flights if is_lost(f)]
    assert all(f.detail != RESUME_FAILED for f in result.flights)
    preempted = [f for f in result.flights if f.preemptions]
    assert _preempted(preempted)["failover"] > 0
    by_client = (FinishReason.CANCELLED, FinishReason.DEADLINE)
    assert all(f.completed or f.reason in by_client for f in preempted)
