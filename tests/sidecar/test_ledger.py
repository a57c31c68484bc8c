"""The live KV ledger: sums by deltas, watermark, local queue order and refusals."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.contract import (
    EngineAPI,
    FinishReason,
    KVPolicy,
    PoolPolicy,
    SchedulingPolicy,
    TenantQuota,
    WatermarkState,
)
from controlplane.rules.fairness import kv_cost, kv_cost_estimate
from engine_sidecar.intake import IntakeLimits, parse_intake
from engine_sidecar.ledger import Flight, Ledger, OverloadError
from engine_sidecar.policy import RequestRecord, RequestState

S = RequestState
W = WatermarkState
POLICY = PoolPolicy(
    pool="p",
    model="m",
    kv=KVPolicy(growth_horizon_steps=16),
    scheduling=SchedulingPolicy(local_queue_size=2, local_queue_max_wait_s=0.3),
)


def flight(
    rid: str, prompt: int, max_new: int = 64, priority: int = 0, tenant: str = "t"
) -> Flight:
    intake = parse_intake(
        EngineAPI.GENERATE,
        {"input_ids": [1] * prompt, "sampling_params": {"max_new_tokens": max_new}},
        IntakeLimits("m", 100_000),
    )
    record = RequestRecord(
        rid=rid, tenant=tenant, model="m", prompt_tokens=prompt, max_new_tokens=max_new,
        arrived_at=0.0, priority=priority,
    )  # fmt: skip
    return Flight(intake, record, 0.0)


async def admitted(ledger: Ledger, f: Flight) -> Flight:
    ledger.add(f)
    await ledger.admit(f)
    return f


async def test_sums_follow_tokens_and_transitions() -> None:
    ledger = Ledger(POLICY, 1000)
    f = await admitted(ledger, flight("a", 100))
    assert (ledger.own_used, ledger.reserved, ledger.waiting_prefill) == (100, 16, 100)
    ledger.move(f, S.PREFILL_RUNNING)
    ledger.move(f, S.DECODE_READY)
    ledger.move(f, S.DECODING)
    ledger.add_tokens(f, 10)
    assert (ledger.own_used, ledger.waiting_prefill, f.record.generated_tokens) == (110, 0, 10)
    ledger.add_tokens(f, 60)
    assert ledger.reserved == 4  # only 4 of max_new=64 left to grow
    ledger.move(f, S.DECODE_PREEMPTED)
    assert (ledger.own_used, ledger.reserved) == (0, 0)
    await ledger.admit(f)  # resumes: prompt and generated come back
    assert ledger.own_used == 160
    ledger.move(f, S.CANCELLED, FinishReason.CANCELLED)
    assert (ledger.own_used, ledger.reserved, ledger.flights) == (0, 0, {})


async def test_each_stay_in_the_engine_charges_its_tenant_what_its_kv_pinned() -> None:
    """Admitted, a request's tenant is charged the KV it is expected to pin (to its
    first token as the engine's latency model predicts it, then at the ledger's TPOT,
    20 ms to start with), divided by the tenant's weight; when its KV is released
    (preempted, ended) the charge becomes what it pinned. Resumed, it is charged again
    for what is left."""
    now = [0.0]
    policy = PoolPolicy(pool="p", model="m", tenants=(TenantQuota(name="gold", weight=2.0),))
    ledger = Ledger(policy, 10_000, clock=lambda: now[0])
    counter = ledger._queue.counters.counter

    def ttft(tokens: int) -> float:
        return ledger.latency.forecast(ledger.load()).ttft_s(tokens)

    expected = kv_cost_estimate(1000, 200, ttft(1000), 0.02)
    assert ttft(1000) > 0
    f = await admitted(ledger, flight("a", 1000, max_new=200, tenant="gold"))
    assert counter("gold") == pytest.approx(expected / 2)
    for state in (S.PREFILL_RUNNING, S.DECODE_READY, S.DECODING):
        ledger.move(f, state)
    ledger.add_tokens(f, 50)
    now[0] = 2.0
    ledger.move(f, S.DECODE_PREEMPTED)
    pinned = kv_cost(1000, 50, 2.0)
    assert counter("gold") == pytest.approx(pinned / 2)
    expected = kv_cost_estimate(1050, 150, ttft(1050), 0.02)
    await ledger.admit(f)  # resumes: its prompt and the 50 it generated, 150 to go
    assert counter("gold") == pytest.approx((pinned + expected) / 2)
    now[0] = 3.0
    ledger.move(f, S.CANCELLED, FinishReason.CANCELLED)
    assert counter("gold") == pytest.approx((pinned + kv_cost(1050, 0, 1.0)) / 2)


async def test_watermark_follows_committed_kv() -> None:
    ledger = Ledger(POLICY, 1000)
    f = await admitted(ledger, flight("a", 500, max_new=500))
    for state in (S.PREFILL_RUNNING, S.DECODE_READY, S.DECODING):
        ledger.move(f, state)
    seen = []
    for generated in (100, 200, 340, 460):
        ledger.changed.clear()
        ledger.add_tokens(f, generated)
        seen.append((ledger.watermark, ledger.changed.is_set()))
    # 616, 716, 856, 976 committed of 1000 (16 reserved for growth)
    assert seen == [(W.NORMAL, True), (W.PRESSURE, True), (W.CRITICAL, True), (W.EXHAUSTED, True)]
    assert ledger.pressure.is_set()
    ledger.move(f, S.DECODE_PREEMPTED)
    assert ledger.watermark.rank == W.NORMAL.rank


async def test_queue_lets_short_pass_refuses_when_full_and_times_out() -> None:
    now = [0.0]
    ledger = Ledger(POLICY, 1000, clock=lambda: now[0])
    big = await admitted(ledger, flight("big", 700))
    waiting_large = flight("large", 300)
    ledger.add(waiting_large)
    large = asyncio.create_task(ledger.admit(waiting_large))
    await asyncio.sleep(0)
    small = flight("small", 10)  # fits now: passes the large one, which just came
    await asyncio.wait_for(admitted(ledger, small), 1)
    assert small.record.state is S.PREFILL_READY
    now[0] = 0.2  # the large one has waited more than half its 0.3 s: it holds the line
    blocked = flight("blocked", 10)
    ledger.add(blocked)
    blocked_task = asyncio.create_task(ledger.admit(blocked))
    await asyncio.sleep(0)
    assert ledger.queued == 2
    assert blocked.record.state is S.WAITING_ADMISSION
    third = flight("third", 10)
    ledger.add(third)
    with pytest.raises(OverloadError) as full:
        await ledger.admit(third)
    assert full.value.reason == "queue_full"
    assert full.value.retry_after_s >= 1
    ledger.move(big, S.CANCELLED, FinishReason.CANCELLED)
    await asyncio.wait_for(asyncio.gather(large, blocked_task), 5)
    assert waiting_large.record.state is S.PREFILL_READY
    assert blocked.record.state is S.PREFILL_READY
    late = flight("late", 800)
    ledger.add(late)
    with pytest.raises(OverloadError) as timeout:
        await ledger.admit(late)
    assert timeout.value.reason == "queue_timeout"
    assert ledger.queued == 0
    huge = flight("huge", 5000)
    ledger.add(huge)
    with pytest.raises(OverloadError) as never:
        await ledger.admit(huge)
    assert never.value.reason == "too_large"


async def test_an_engine_report_that_frees_room_admits_what_waits() -> None:
    """The engine's report of its KV wins while it is larger than the sidecar's own count;
    when a later report is smaller (the engine freed KV the sidecar never counted), the
    room it shows is used at that poll, not at the next release or first token, which
    may be seconds away."""
    ledger = Ledger(POLICY, 1000)
    await admitted(ledger, flight("a", 100))
    ledger.observe_engine(900, sampled_at=ledger.clock())
    waiting = flight("b", 200)
    ledger.add(waiting)
    admission = asyncio.create_task(ledger.admit(waiting))
    await asyncio.sleep(0)
    assert waiting.record.state is S.WAITING_ADMISSION
    ledger.observe_engine(100, sampled_at=ledger.clock())
    await asyncio.wait_for(admission, 0.2)  # well inside its 0.3 s wait
    assert waiting.record.state is S.PREFILL_READY


async def test_a_continuation_joins_a_full_queue_and_goes_first() -> None:
    """A stream migrated here was accepted by the fleet already: a full queue does not
    refuse it, and it is admitted before the new requests that waited longer."""
    ledger = Ledger(POLICY, 1000)
    big = await admitted(ledger, flight("big", 700))
    waiting = [flight(rid, 400) for rid in ("first", "second")]
    tasks = []
    for f in waiting:
        ledger.add(f)
        tasks.append(asyncio.create_task(ledger.admit(f)))
        await asyncio.sleep(0)
    assert ledger.queued == 2  # full
    moved = flight("moved", 400)
    moved.resumed = True
    ledger.add(moved)
    resumed = asyncio.create_task(ledger.admit(moved))
    await asyncio.sleep(0)
    assert ledger.queued == 3
    ledger.move(big, S.CANCELLED, FinishReason.CANCELLED)  # room for two of the three
    await asyncio.wait_for(resumed, 5)
    assert moved.record.state is S.PREFILL_READY
    assert [f.record.state for f in waiting] == [S.PREFILL_READY, S.WAITING_ADMISSION]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_changes_are_measured_against_what_was_published() -> None:
    ledger = Ledger(POLICY, 10_000)  # 1 % = 100 tokens
    a = await admitted(ledger, flight("a", 150))
    assert ledger.changed.is_set()
    ledger.changed.clear()
    ledger.published(150)  # the heartbeat carried it
    b = await admitted(ledger, flight("b", 60))  # 60 from what routers see: quiet
    assert not ledger.changed.is_set()
    ledger.move(a, S.CANCELLED, FinishReason.CANCELLED)  # 210 → 60: 90 from 150, quiet
    assert not ledger.changed.is_set()
    c = await admitted(ledger, flight("c", 100))  # 160... routers saw 150: quiet
    ledger.move(b, S.CANCELLED, FinishReason.CANCELLED)
    ledger.move(c, S.CANCELLED, FinishReason.CANCELLED)  # 0: 150 from what was published
    assert ledger.changed.is_set()


async def test_a_preempted_request_resumes_before_newer_arrivals() -> None:
    clock = [100.0]
    ledger = Ledger(POLICY, 1000, clock=lambda: clock[0])
    old = flight("old", 480)
    old.record = RequestRecord(
        rid="old", tenant="t", model="m", prompt_tokens=480, max_new_tokens=64, arrived_at=90.0
    )
    await admitted(ledger, old)
    for state in (S.PREFILL_RUNNING, S.DECODE_READY, S.DECODING, S.DECODE_PREEMPTED):
        ledger.move(old, state)
    hog = await admitted(ledger, flight("hog", 700))
    new = flight("new", 480)
    ledger.add(new)
    waiting_new = asyncio.create_task(ledger.admit(new))
    await asyncio.sleep(0)
    clock[0] = 100.1  # within the new one's 0.3 s wait, which the ledger's clock ends
    resuming = asyncio.create_task(ledger.admit(old))
    await asyncio.sleep(0)
    assert ledger.queued == 2
    ledger.move(hog, S.CANCELLED, FinishReason.CANCELLED)  # room for one of the two
    await asyncio.sleep(0)
    assert old.record.state.value == "decode_ready"
    assert new.record.state.value == "waiting_admission"
    await resuming
    waiting_new.cancel()
