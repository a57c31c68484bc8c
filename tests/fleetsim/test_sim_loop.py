"""The fleet simulator end to end: real engine models, real policy code, virtual time."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from controlplane.contract import FinishReason
from fleetsim.engine import EngineConfig, EngineModel
from fleetsim.report.matrix import CellSpec, fleet_config, workload
from fleetsim.sim import FleetConfig, Simulation, WeirPolicy, engine_config_for, policies
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec, prompt_token_bytes, read_trace, scenario
from fleetsim.workloads.scenarios import EngineFailure


def _outcome(result_flights: list) -> list[tuple[str, str, float, float, int]]:  # type: ignore[type-arg]
    return [
        (f.rid, str(f.reason), round(f.ttft_s, 9), round(f.e2e_s, 9), f.generated)
        for f in result_flights
    ]


@pytest.mark.parametrize("name", ["least_outstanding", "weir", "oracle"])
def test_a_run_is_deterministic_for_a_seed(name: str) -> None:
    specs = scenario("few_long_many_short").with_duration(6.0).generate(12.0, seed=3)
    runs = [
        Simulation(specs, policies(seed=1)[name](), FleetConfig(engines=3)).run() for _ in range(2)
    ]
    assert _outcome(runs[0].flights) == _outcome(runs[1].flights)
    assert all(f.done for f in runs[0].flights)


def test_one_engine_light_load_every_policy_gives_the_same_latencies() -> None:
    # Requests far apart: nothing ever waits for anything, so routing, admission and
    # engine flags cannot matter.
    specs = [
        RequestSpec(
            f"r{i}",
            20.0 * i,
            "t",
            i % 3,
            (1 + i % 4) * BLOCK_TOKENS,
            20 + 7 * i,
            512,
            tuple(range(100 * i, 100 * i + 1 + i % 4)),
        )
        for i in range(6)
    ]
    outcomes = {
        name: _outcome(Simulation(specs, make(), FleetConfig(engines=1)).run().flights)
        for name, make in policies().items()
    }
    reference = outcomes.pop("round_robin")
    weir = outcomes.pop("weir")
    # Alone on its engine a request gains nothing from knowing lengths or fresh views.
    assert outcomes.pop("oracle") == weir
    assert all(r[1] == "stop" for r in reference)
    for name, outcome in outcomes.items():
        assert outcome == reference, name
    # Weir's engines cut prefills into iterations of a bounded time (so decodes keep
    # flowing beside long prompts): alone, a prompt pays a few iterations' overhead.
    for mine, theirs in zip(weir, reference, strict=True):
        assert mine[0::4] == theirs[0::4]
        assert mine[2] == pytest.approx(theirs[2], rel=0.1)
        assert mine[3] == pytest.approx(theirs[3], rel=0.05)


def test_with_unbounded_kv_weir_admission_never_refuses() -> None:
    specs = scenario("short_in_long_out").with_duration(5.0).generate(20.0, seed=2)
    config = FleetConfig(engines=2, kv_tokens=4_000_000)
    result = Simulation(specs, policies()["weir"](), config).run()
    assert {f.reason for f in result.flights} <= {FinishReason.STOP, FinishReason.LENGTH}
    assert all(not f.preemptions for f in result.flights)
    assert result.exhaustion_events == 0


def test_simulated_throughput_is_the_engine_models_own() -> None:
    """A 64-sequence decode batch through the simulator takes exactly the virtual time the
    engine model stepped alone takes (the figure `weir bench engine` reports)."""
    specs = [RequestSpec(f"d{i}", 0.0, "t", 0, 256, 200, 200, (10_000 + i,)) for i in range(64)]
    config = FleetConfig(engines=1)
    result = Simulation(specs, policies()["round_robin"](), config).run()
    assert all(f.reason is FinishReason.LENGTH for f in result.flights)

    model = EngineModel(engine_config_for(config))
    for spec in specs:
        model.submit(
            model.make_request(spec.request_id, prompt_token_bytes(spec), 200, ignore_eos=True),
            0.0,
        )
    now = tokens = 0.0
    while model.has_work:
        step = model.step(now)
        now += step.duration
        tokens += len(step.emitted)
    assert tokens == sum(f.generated for f in result.flights) == 64 * 200
    assert max(f.finished_at for f in result.flights) == pytest.approx(now, rel=1e-9)


def test_trace_replay_reuses_the_traces_prefixes(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 200 * i,
            "input_length": 3 * BLOCK_TOKENS,
            "output_length": 30,
            "hash_ids": [1, 2, 100 + i],
        }
        for i in range(20)
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = read_trace(path)
    for name in ("sglang_cache_aware", "weir"):
        result = Simulation(specs, policies()[name](), FleetConfig(engines=2)).run()
        assert all(f.completed for f in result.flights), name
        assert sum(f.cached_tokens for f in result.flights) >= 15 * 2 * BLOCK_TOKENS, name


def test_an_engine_failure_loses_baseline_requests_but_not_weirs() -> None:
    specs = scenario("short_in_long_out").with_duration(6.0).generate(16.0, seed=5)
    failure = (EngineFailure(at_s=4.0, engine=1),)
    lost = {}
    for name in ("least_outstanding", "weir"):
        result = Simulation(
            specs, policies()[name](), FleetConfig(engines=3), failures=failure
        ).run()
        lost[name] = sum(f.reason is FinishReason.ERROR for f in result.flights)
        if name == "weir":
            moved = [f for f in result.flights if "failover" in f.preemptions]
            assert moved
            assert all(f.completed for f in moved)
            # A continuation resumes where the stream stopped: exactly the whole answer.
            assert all(f.generated == f.spec.generated_tokens for f in moved)
    assert lost["least_outstanding"] > 0
    assert lost["weir"] == 0


def test_a_prompt_past_the_sidecars_margin_runs_alone_in_the_simulator() -> None:
    """A 19,456-token prompt for a 100-token answer on a 20,000-token engine: past
    capacity minus the emergency band, within the whole KV. The simulated sidecar runs
    the live admission: the prompt waits while the chats ahead of it drain, then runs
    alone and streams its whole answer (it used to be refused as too_large). Its client
    is patient (30 s): the simulated pool sheds an interactive one after `SHED_AFTER_S`
    in the queue, sooner than the chats drain."""
    specs = [
        RequestSpec(f"s{i}", 0.1 * i, "t", 0, 1024, 200, 200, (10 * i, 10 * i + 1))
        for i in range(8)
    ]
    big = RequestSpec(
        "big", 0.5, "t", 0, 19_456, 100, 100, tuple(range(1000, 1038)), max_wait_s=30.0
    )
    config = FleetConfig(engines=1, kv_tokens=20_000, drain_s=60.0)
    result = Simulation([*specs, big], policies()["weir"](), config).run()
    flights = {f.rid: f for f in result.flights}
    alone = flights["big"]
    assert (alone.reason, alone.generated) == (FinishReason.LENGTH, 100)
    # Nothing ran beside it: every chat admitted before it finished before its first token.
    for spec in specs:
        chat = flights[spec.request_id]
        assert chat.completed
        assert chat.finished_at <= alone.first_token_at or chat.first_token_at >= alone.finished_at


def test_weirs_engines_let_a_short_request_pass_a_long_one_they_cannot_fit() -> None:
    """Two long answers decoding hold most of the engine's admission budget (SGLang's
    clipped output limit, 4,096 tokens each). A low-priority long request waiting five
    seconds does not fit what is left; a high-priority short one that comes then does.
    Weir's engines order by the priority the sidecar sent and do not age it themselves:
    the short one goes first. (With the engine ageing it too, the long request headed
    the queue after two seconds and, not fitting, stopped the short one behind it until
    a long answer ended: preemption_crossing's short p50 TTFT of 25 s.)"""
    config = WeirPolicy().tune(EngineConfig(max_total_tokens=10_000, page_size=1), FleetConfig())
    model = EngineModel(config)
    now = 0.0
    for rid in ("long-a", "long-b", "long-waiting"):
        model.submit(model.make_request(rid, [1, 2, 3], 8000, ignore_eos=True, priority=0), now)
    while now < 5.0:
        now += model.step(now).duration
    waiting = {r.rid for r in model.waiting}
    assert waiting == {"long-waiting"}  # the two decode; the third does not fit
    short = model.make_request("short", [4, 5, 6], 8, ignore_eos=True, priority=2)
    model.submit(short, now)
    for _ in range(20):
        now += model.step(now).duration
    assert len(short.output_ids) == 8  # it ran to its end
    assert {r.rid for r in model.waiting} == {"long-waiting"}


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("few_long_many_short", "weir"),
        ("few_long_many_short", "oracle"),
        ("few_long_many_short", "llmd_weighted"),
        ("pd_no_decode_credit", "weir"),
        ("cancel_deadline_failure", "weir"),
        ("preemption_crossing", "weir"),
    ],
)
def test_a_run_leaves_no_reference_cycles(name: str, policy: str) -> None:
    # `Simulation.run` turns the cyclic collector off while its events run: that holds
    # only while they make no reference cycles, which would pile up for the run's length.
    # These cells preempt, migrate, hand off, cancel, miss deadlines and lose an engine.
    cell = CellSpec(name, policy, 1.5, 0, 4, 12.0, kv_scale=0.25, drain_s=60.0)
    config = fleet_config(cell)
    specs, _, failures = workload(cell, config)
    sim = Simulation(specs, policies(0)[policy](), config, failures=failures)
    gc.collect()
    gc.disable()  # nor may the collector run between the run and the count
    try:
        sim.run()
        assert gc.collect() == 0
    finally:
        gc.enable()
