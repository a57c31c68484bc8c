"""Fast-forward: runs of decode-only iterations without an event each change nothing.

The engine model runs a planned run of them in one call exactly as one `step` at a time
would (tokens, pages and their order, the load report's figures, the iterations'
durations to the last bit); the simulator, with fast-forward, gives the same flights,
samples and engine figures as without it while its policy sees a fraction of the
iterations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from fleetsim.engine import EngineConfig, EngineModel
from fleetsim.report import CellSpec
from fleetsim.report.matrix import fleet_config, workload
from fleetsim.sim import FleetConfig, SimResult, Simulation, loop, policies
from fleetsim.sim.weir import WeirPolicy
from fleetsim.workloads import scenario
from tests.fleetsim.conftest import submit


def _model() -> EngineModel:
    # Pages of 4 tokens so every few iterations some request needs one; a log interval
    # that a run crosses; admission that counts on a fifth of what running requests may
    # still add (SGLang before 0.5.23 with a low new-token ratio), so the pool runs out
    # before the answers end; a cached prefix to evict on the way.
    config = EngineConfig(
        max_total_tokens=512, page_size=4, decode_log_interval=7, sglang_version="0.5.5",
        init_new_token_ratio=0.2,
    )  # fmt: skip
    model = EngineModel(config)
    cached = submit(model, "cached", "a prompt whose pages stay cached " * 3, 1, ignore_eos=True)
    now = 0.0
    while model.has_work:
        now += model.step(now).duration
    assert cached.finished
    assert model.kv.evictable_pages > 0
    for i, text in enumerate(["x" * 13, "y" * 21, "z" * 6, "w" * 9, "v" * 30]):
        submit(model, f"r{i}", text, 120, now, ignore_eos=True)
        now += model.step(now).duration
    while not model.plain_decode():
        now += model.step(now).duration
    assert len(model.decoding) == 5
    return model


def _state(model: EngineModel) -> tuple[object, ...]:
    requests = sorted(model.decoding, key=lambda r: r.rid)
    return (
        [(r.output_ids, r.hash_state, r.computed, r.page_table()) for r in requests],
        model.kv.used_pages,
        model.kv.evictable_pages,
        model.steps,
        model.decode_steps,
        model.generation_tokens_total,
        model.new_token_ratio,
        model.decode_moments,
        model.gen_throughput,
        model.loads(),
    )


def test_a_decode_run_is_the_same_iterations_one_at_a_time() -> None:
    stepped, ahead = _model(), _model()
    now = 0.0  # the clock both models' iterations start from
    durations, planned = ahead.decode_run(now, 10_000, math.inf)
    # It stops before the first iteration that would retract a request (the pool runs
    # out of pages, its cached prefix evicted, before the answers' 120 tokens).
    assert 20 < len(durations) < 110
    starts = [now]
    for duration in durations[:-1]:
        starts.append(starts[-1] + duration)
    used = ahead.decode_ahead(starts[:5], durations[:5])
    used += ahead.decode_ahead(starts[5:], durations[5:])
    assert used == planned
    for start, duration, pages in zip(starts, durations, used, strict=True):
        result = stepped.step(start)
        assert (result.duration, stepped.kv.used_pages) == (duration, pages)
        assert not result.finished
        assert not result.retracted
        assert len(result.emitted) == len(stepped.decoding)
    assert _state(ahead) == _state(stepped)
    ahead.check()
    assert ahead.kv.evictable_pages == 0
    # The next iteration is not a plain one: run one at a time, it retracts.
    assert stepped.step(starts[-1] + durations[-1]).retracted


def test_a_decode_run_ends_at_the_first_iteration_reaching_until() -> None:
    model = _model()
    everything, pages = model.decode_run(0.0, 10_000, math.inf)
    until = sum(everything[:4]) - 1e-9  # inside the fourth iteration
    assert model.decode_run(0.0, 10_000, until) == (everything[:4], pages[:4])
    assert model.decode_run(0.0, 3, math.inf) == (everything[:3], pages[:3])


def _after_steps(make: Callable[[], loop.FleetPolicy], calls: list[int]) -> loop.FleetPolicy:
    policy = make()
    after_step = policy.after_step

    def counted(engine: int, now: float) -> None:
        calls[0] += 1
        after_step(engine, now)

    policy.after_step = counted  # type: ignore[method-assign]
    return policy


def _run(name: str) -> tuple[SimResult, Simulation, int]:
    # Long answers on a few engines: most iterations only decode.
    specs = scenario("short_in_long_out").with_duration(4.0).generate(6.0, seed=2)
    calls = [0]
    policy = _after_steps(policies(seed=1)[name], calls)
    sim = Simulation(specs, policy, FleetConfig(engines=3, kv_scale=0.25, drain_s=30.0))
    return sim.run(), sim, calls[0]


def _outcome(result: SimResult) -> tuple[object, ...]:
    flights = [
        (
            f.rid,
            f.reason,
            f.generated,
            f.stream_digest,
            f.first_token_at,
            f.last_token_at,
            f.finished_at,
        )
        for f in result.flights
    ]
    return (
        flights,
        result.end_s,
        result.kv_samples,
        result.engine_seconds,
        result.high_water_s,
        result.peak_usage,
        result.exhaustion_events,
    )


@pytest.mark.parametrize("name", ["least_outstanding", "weir"])
def test_fast_forward_changes_nothing_but_how_often_the_policy_is_called(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, sim, calls = _run(name)
    iterations = sum(slot.model.steps for slot in sim.engines)
    monkeypatch.setattr(loop, "FAST_FORWARD_STEPS", 0)  # every iteration an event
    unforwarded, unforwarded_sim, every_call = _run(name)
    assert _outcome(result) == _outcome(unforwarded)
    assert sum(slot.model.steps for slot in unforwarded_sim.engines) == iterations
    assert every_call >= iterations
    assert calls < every_call / 2


def test_a_queue_that_let_nothing_out_fast_forwards_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weir's sidecar also lets its engine run ahead while requests wait in its queue,
    when its last pump let none of them out (`AdmissionQueue.settled_until`): the same
    run as every iteration an event, and that case does occur here."""
    quiet_with_a_queue = [0]
    quiet_until = WeirPolicy.quiet_until

    def counted(self: WeirPolicy, engine: int, now: float) -> float:
        until = quiet_until(self, engine, now)
        if len(self.sidecars[engine].queue) and until > now:
            quiet_with_a_queue[0] += 1
        return until

    monkeypatch.setattr(WeirPolicy, "quiet_until", counted)
    cell = CellSpec("few_long_many_short", "weir", 1.0, 0, 16, 20.0, kv_scale=0.25, drain_s=60.0)

    def run() -> SimResult:
        config = fleet_config(cell)
        specs, _, failures = workload(cell, config)
        return Simulation(specs, policies(0)["weir"](), config, failures=failures).run()

    result = run()
    assert quiet_with_a_queue[0] > 0
    monkeypatch.setattr(loop, "FAST_FORWARD_STEPS", 0)
    assert _outcome(result) == _outcome(run())
