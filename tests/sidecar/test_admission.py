"""Growth-reserve admission, the local queue's order, aging and engine priority."""

from __future__ import annotations

from controlplane.contract import KVPolicy, WatermarkState
from engine_sidecar.policy import (
    AdmissionVerdict,
    PoolOutlook,
    QueuedRequest,
    SequenceOutlook,
    decide_admission,
    engine_priority,
    expired,
    growth_reserve,
    queue_order,
    retry_after_s,
    total_growth_reserve,
)
from engine_sidecar.policy.admission import ALONE, alone_tokens

POLICY = KVPolicy(emergency_watermark=0.95, growth_horizon_steps=100, headroom_tokens=10)


def test_reserve_is_bounded_by_horizon_remaining_and_prediction() -> None:
    assert growth_reserve(SequenceOutlook(0, 10_000, 5_000), 100) == 100  # horizon
    assert growth_reserve(SequenceOutlook(990, 1000, 5_000), 100) == 10  # remaining
    assert growth_reserve(SequenceOutlook(0, 10_000, 40), 100) == 40  # predicted
    assert growth_reserve(SequenceOutlook(60, 10_000, 40), 100) == 1  # never zero
    assert growth_reserve(SequenceOutlook(10, 10, 40), 100) == 0  # nothing left
    assert total_growth_reserve([SequenceOutlook(0, 50, 50)] * 3, 100) == 150


def _pool(used: int, reserved: int = 0, **kw: object) -> PoolOutlook:
    return PoolOutlook(1000, used, reserved, kw.pop("watermark", WatermarkState.NORMAL), **kw)  # type: ignore[arg-type]


def test_admits_what_fits_with_reserve_and_safety() -> None:
    assert POLICY.safety_tokens(1000) == 60
    cand = SequenceOutlook(0, 500, 100)
    fits = decide_admission(cand, 100, _pool(500, 140), POLICY)
    assert fits.verdict is AdmissionVerdict.ADMIT
    assert fits.needed_tokens == 200
    assert fits.available_tokens == 300
    tight = decide_admission(cand, 100, _pool(600, 141), POLICY)
    assert tight.verdict is AdmissionVerdict.WAIT
    assert tight.reason == "kv_reserve"


def test_never_full_max_tokens() -> None:
    # max_tokens 100k would never fit; the reserve only counts the horizon.
    d = decide_admission(SequenceOutlook(0, 100_000, 100_000), 100, _pool(0), POLICY)
    assert d.verdict is AdmissionVerdict.ADMIT
    assert d.needed_tokens == 200


def test_refuses_what_never_fits_and_waits_when_closed_or_critical() -> None:
    cand = SequenceOutlook(0, 10, 10)
    assert decide_admission(cand, 995, _pool(0), POLICY).verdict is AdmissionVerdict.REFUSE
    paused = decide_admission(cand, 10, _pool(0, admission_open=False), POLICY)
    assert (paused.verdict, paused.reason) == (AdmissionVerdict.WAIT, "admission_paused")
    crit = decide_admission(cand, 10, _pool(0, watermark=WatermarkState.CRITICAL), POLICY)
    assert (crit.verdict, crit.reason) == (AdmissionVerdict.WAIT, "watermark_critical")
    unknown = decide_admission(cand, 10, PoolOutlook(0, 0, 0, WatermarkState.NORMAL), POLICY)
    assert unknown.verdict is AdmissionVerdict.WAIT


def test_a_request_past_the_margin_that_fits_the_whole_kv_runs_alone() -> None:
    """Capacity 1,000, safety 60, pages of 16, a reserve of 20 of a 50-token limit: the
    margin takes prompts up to 920; past it a prompt is admitted to run alone while its
    prompt, its whole limit and a page fit what the endpoint does not hold (strictly:
    the engine's own scheduler wants more room than that), and refused only when an
    empty engine could not take it."""
    cand = SequenceOutlook(0, 50, 20)
    assert decide_admission(cand, 920, _pool(0), POLICY).reason == "fits"
    assert alone_tokens(cand, 921, POLICY) == 921 + 50 + 16
    alone = decide_admission(cand, 921, _pool(0), POLICY)
    assert (alone.verdict, alone.reason, alone.needed_tokens) == (
        AdmissionVerdict.ADMIT,
        ALONE,
        987,
    )
    # 933 + 50 + 16 = 999: alone on an empty endpoint; it waits while anything is held.
    assert decide_admission(cand, 933, _pool(0), POLICY).verdict is AdmissionVerdict.ADMIT
    for used, reserved in ((1, 0), (0, 1), (500, 100)):
        waits = decide_admission(cand, 933, _pool(used, reserved), POLICY)
        assert (waits.verdict, waits.reason) == (AdmissionVerdict.WAIT, ALONE)
    paused = decide_admission(cand, 933, _pool(0, admission_open=False), POLICY)
    assert (paused.verdict, paused.reason) == (AdmissionVerdict.WAIT, ALONE)
    # 934 + 50 + 16 = 1,000: no engine of this size could ever schedule it.
    never = decide_admission(cand, 934, _pool(0), POLICY)
    assert (never.verdict, never.reason, never.needed_tokens) == (
        AdmissionVerdict.REFUSE,
        "too_large",
        1000,
    )
    # A continuation needs only the limit it has left: 40 of 50 generated, 10 to go.
    resumed = SequenceOutlook(40, 50, 60)
    assert decide_admission(resumed, 973, _pool(0), POLICY).verdict is AdmissionVerdict.ADMIT
    assert decide_admission(resumed, 974, _pool(0), POLICY).verdict is AdmissionVerdict.REFUSE


def test_queue_orders_by_aged_priority_and_expires() -> None:
    old_low = QueuedRequest("a", priority=0, enqueued_at=0.0, expires_at=100.0, prompt_tokens=1)
    new_high = QueuedRequest("b", priority=5, enqueued_at=8.0, expires_at=9.0, prompt_tokens=1)
    assert [q.rid for q in queue_order((old_low, new_high), 9.0, 0.1)] == ["b", "a"]
    # With aging the old low-priority request overtakes: never starved.
    assert [q.rid for q in queue_order((old_low, new_high), 9.0, 1.0)] == ["a", "b"]
    assert expired((old_low, new_high), 9.0) == (new_high,)
    # A resume waits one class ahead of new work: of its own class, and the next one
    # down however long that waited (without aging).
    resume = QueuedRequest("r", 0, 9.0, 100.0, 1, resumed=True)
    same = QueuedRequest("s", 0, 1.0, 100.0, 1)
    above = QueuedRequest("t", 2, 9.0, 100.0, 1)
    assert [q.rid for q in queue_order((same, resume, above), 9.0, 0.0)] == ["t", "r", "s"]
    # Requests that came at the same instant (a router's queue let go at once) keep the
    # order they came in: the router's fair order, not their ids'.
    late, early = QueuedRequest("z", 0, 5.0, 100.0, 1), QueuedRequest("a", 0, 5.0, 100.0, 1)
    assert [q.rid for q in queue_order((late, early), 9.0, 0.0)] == ["z", "a"]


def test_engine_priority_rises_with_wait_and_urgency() -> None:
    assert engine_priority(1, 0.0, None, 1.0) == 1
    assert engine_priority(1, 5.0, None, 1.0) == 6
    assert engine_priority(1, 0.0, 2.0, 1.0) == 9
    assert engine_priority(1, 0.0, -5.0, 1.0) == 11


def test_retry_after_grows_with_the_queue() -> None:
    assert retry_after_s(0, 10, 30.0) == 1
    assert retry_after_s(10, 10, 30.0) == 8
    assert retry_after_s(5, 0, 30.0) == 8
