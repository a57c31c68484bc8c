"""Offload in the simulator: Weir's relief on engines with a host tier resumes its victims
from host pages (their prefix evicted from the device by other work meanwhile) instead of
recomputing them, and every request still produces exactly what it would unpressured."""

from __future__ import annotations

import msgspec
import pytest

from controlplane.contract import PreemptionMode
from fleetsim.engine.tokens import TokenFunction, prefix_hash
from fleetsim.report.relief_modes import workload
from fleetsim.sim import FleetConfig, SimFlight, SimResult, Simulation, engine_config_for
from fleetsim.sim.weir import WeirPolicy
from fleetsim.workloads import prompt_token_bytes

M = PreemptionMode


def run(kv_tokens: int, host_tier: bool, modes: tuple[PreemptionMode, ...]) -> SimResult:
    fleet = FleetConfig(engines=1, kv_tokens=kv_tokens, drain_s=600.0)
    scheduling = msgspec.structs.replace(fleet.policy.scheduling, preemption_modes=modes)
    policy = msgspec.structs.replace(fleet.policy, scheduling=scheduling)
    engines = engine_config_for(fleet).replace(enable_hierarchical_cache=host_tier)
    # Six long requests whose outputs outrun their hint, and chats churning the cache.
    specs = workload(6, 80, chat_gap_s=0.6)
    return Simulation(specs, WeirPolicy(policy), fleet, engine_config=engines).run()


@pytest.fixture(scope="module")
def runs() -> dict[str, SimResult]:
    return {
        "unpressured": run(4_000_000, False, (M.RECOMPUTE,)),
        # Room for five of the long requests' prompts and outputs, not six.
        "offload": run(54_000, True, (M.RECOMPUTE, M.OFFLOAD)),
        "recompute": run(54_000, False, (M.RECOMPUTE,)),
    }


def outputs_of(flight: SimFlight) -> tuple[int, int]:
    """What a request streamed: how many tokens, and their digest."""
    return flight.generated, flight.stream_digest


def outputs(result: SimResult) -> dict[str, tuple[int, int]]:
    return {f.rid: outputs_of(f) for f in result.flights}


def uninterrupted(flight: SimFlight) -> tuple[int, int]:
    """What the token function gives the flight's prompt, run uninterrupted."""
    tokens, _ = TokenFunction().run(prefix_hash(prompt_token_bytes(flight.spec)), flight.generated)
    return flight.generated, prefix_hash(tokens)


def test_offloaded_victims_resume_from_the_host_tier(runs: dict[str, SimResult]) -> None:
    offload, recompute = runs["offload"], runs["recompute"]
    offloaded = [f for f in offload.flights if "offload" in f.preemptions]
    recomputed = [f for f in recompute.flights if "recompute" in f.preemptions]
    assert offloaded
    assert recomputed
    # Without a host tier the victims' prefixes were evicted while they waited and were
    # computed again (7,170 tokens for two victims); with one, only what did not fill a
    # page was.
    assert sum(f.recomputed_tokens for f in recompute.flights) > 5_000
    assert sum(f.recomputed_tokens for f in offload.flights) < 16 * len(offloaded)


def test_every_request_produces_what_it_would_unpressured(runs: dict[str, SimResult]) -> None:
    """Under pressure many chats give up waiting (one engine, its KV held by the long
    requests); every request that completes has the unpressured run's tokens, and every
    long one, preempted or not, completes."""
    reference = outputs(runs["unpressured"])
    assert all(str(f.reason) == "stop" for f in runs["unpressured"].flights)
    assert not any(f.preemptions for f in runs["unpressured"].flights)
    for name in ("offload", "recompute"):
        done = [f for f in runs[name].flights if str(f.reason) == "stop"]
        assert {f.rid for f in done} >= {f"long{i}" for i in range(6)}, name
        assert {f.rid: outputs_of(f) for f in done} == {f.rid: reference[f.rid] for f in done}
        preempted = [f for f in done if f.preemptions]
        assert preempted, name
        assert all(outputs_of(f) == uninterrupted(f) for f in preempted), name
