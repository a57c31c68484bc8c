"""Growth-reserve admission, the local queue's order, aging and engine priority."""

from __future__ import annotations

import math

from controlplane.contract import KVPolicy, Role, SchedulingPolicy, WatermarkState
from controlplane.rules.fairness import Charge, VirtualCounters, kv_cost
from engine_sidecar.policy import (
    AdmissionQueue,
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
from engine_sidecar.policy.admission import ALONE, TPOT_OBJECTIVE, alone_tokens, tpot_gate_s

POLICY = KVPolicy(emergency_watermark=0.95, growth_horizon_steps=100, headroom_tokens=10)
EQUAL = VirtualCounters()  # no tenant served yet


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


def test_the_tpot_gate_holds_new_requests_while_a_prefill_is_pending() -> None:
    """Over the objective with a prefill pending: wait. Under it, with nothing pending, or
    with no objective declared: admission is the KV arithmetic's. Room held for the
    request is taken whatever the gate says; one running alone waits for it too."""
    cand = SequenceOutlook(0, 50, 20)
    slow = _pool(0, prefill_pending=True, predicted_tpot_s=0.09)
    gated = decide_admission(cand, 100, slow, POLICY, target_tpot_s=0.07)
    assert (gated.verdict, gated.reason) == (AdmissionVerdict.WAIT, TPOT_OBJECTIVE)
    assert (gated.needed_tokens, gated.available_tokens) == (120, 940)
    for pool, target in (
        (slow, 0.0),  # no objective
        (slow, 0.09),  # at the objective, not above it
        (_pool(0, prefill_pending=False, predicted_tpot_s=0.09), 0.07),  # nothing pending
    ):
        d = decide_admission(cand, 100, pool, POLICY, target_tpot_s=target)
        assert (d.verdict, d.reason) == (AdmissionVerdict.ADMIT, "fits")
    held = decide_admission(cand, 100, slow, POLICY, held=True, target_tpot_s=0.07)
    assert held.verdict is AdmissionVerdict.ADMIT
    alone = decide_admission(cand, 921, slow, POLICY, target_tpot_s=0.07)
    assert (alone.verdict, alone.reason) == (AdmissionVerdict.WAIT, TPOT_OBJECTIVE)
    # KV binds first: the reason names what would still stop it with the gate lifted.
    full = decide_admission(cand, 100, _pool(900, 0, prefill_pending=True,
                                             predicted_tpot_s=0.09), POLICY, target_tpot_s=0.07)  # fmt: skip
    assert full.reason == "kv_reserve"
    # Only an engine that prefills and decodes has the gate: a prefill engine streams one
    # token per request, and a decode engine's pending "prefill" is KV arriving.
    scheduling = SchedulingPolicy(target_tpot_s=0.07)
    assert tpot_gate_s(scheduling, Role.MIXED) == 0.07
    assert tpot_gate_s(scheduling, Role.PREFILL) == tpot_gate_s(scheduling, Role.DECODE) == 0.0


def test_queue_orders_by_aged_priority_and_expires() -> None:
    old_low = QueuedRequest("a", priority=0, enqueued_at=0.0, expires_at=100.0, prompt_tokens=1)
    new_high = QueuedRequest("b", priority=5, enqueued_at=8.0, expires_at=9.0, prompt_tokens=1)
    assert [q.rid for q in queue_order((old_low, new_high), 9.0, 0.1, EQUAL)] == ["b", "a"]
    # With aging the old low-priority request overtakes: never starved.
    assert [q.rid for q in queue_order((old_low, new_high), 9.0, 1.0, EQUAL)] == ["a", "b"]
    assert expired((old_low, new_high), 9.0) == (new_high,)
    # A resume waits one class ahead of new work: of its own class, and the next one
    # down however long that waited (without aging).
    resume = QueuedRequest("r", 0, 9.0, 100.0, 1, resumed=True)
    same = QueuedRequest("s", 0, 1.0, 100.0, 1)
    above = QueuedRequest("t", 2, 9.0, 100.0, 1)
    assert [q.rid for q in queue_order((same, resume, above), 9.0, 0.0, EQUAL)] == ["t", "r", "s"]
    # Requests that came at the same instant (a router's queue let go at once) keep the
    # order they came in: the router's fair order, not their ids'.
    late, early = QueuedRequest("z", 0, 5.0, 100.0, 1), QueuedRequest("a", 0, 5.0, 100.0, 1)
    assert [q.rid for q in queue_order((late, early), 9.0, 0.0, EQUAL)] == ["z", "a"]


def test_the_queue_sums_its_prompt_tokens_through_every_way_out() -> None:
    """The prefill ahead every latency forecast reads: what joined, less what left by
    removal, by expiry and by the pump."""
    queue: AdmissionQueue[str] = AdmissionQueue(8, 0.0)
    for rid, tokens, expires in (("a", 100, 50.0), ("b", 20, 5.0), ("c", 3, 50.0), ("d", 7, 50.0)):
        queue.offer(QueuedRequest(rid, 0, 0.0, expires, tokens), rid)
    assert queue.prompt_tokens == 130
    queue.remove("d")
    assert [q.rid for q, _ in queue.expire(6.0)] == ["b"]
    assert queue.prompt_tokens == 103

    def small(item: QueuedRequest, _: str) -> AdmissionVerdict:
        return AdmissionVerdict.ADMIT if item.prompt_tokens < 10 else AdmissionVerdict.WAIT

    assert [q.rid for q, _, _ in queue.pump(6.0, small)] == ["c"]
    assert queue.prompt_tokens == sum(q.prompt_tokens for q, _ in queue.entries()) == 100


def test_inside_a_class_tenants_take_turns_by_kv_cost_and_weight() -> None:
    """Six requests of each of two tenants, all of one class and KV cost: `gold` (weight
    2) goes twice for each turn of `iron`; a tenant already served goes after; a higher
    class keeps its precedence whatever its tenant was served."""
    counters = VirtualCounters({"gold": 2.0})

    def waiting(tenant: str, priority: int = 0, n: int = 6) -> list[QueuedRequest]:
        return [
            QueuedRequest(f"{tenant}{i}", priority, i, 100.0, 100, tenant=tenant, cost=100.0)
            for i in range(n)
        ]

    queue = (*waiting("iron"), *waiting("gold"))
    order = [q.rid for q in queue_order(queue, 0.0, 0.0, counters)]
    assert order[:9] == [
        "iron0", "gold0", "gold1", "iron1", "gold2", "gold3", "iron2", "gold4", "gold5",
    ]  # fmt: skip
    counters.charge("gold", 1000.0)  # gold is 500 ahead: iron's next five go first
    order = [q.rid for q in queue_order(queue, 0.0, 0.0, counters)]
    assert order[:6] == ["iron0", "iron1", "iron2", "iron3", "iron4", "gold0"]
    urgent = waiting("gold", priority=2, n=1)
    assert queue_order((*queue, *urgent), 0.0, 0.0, counters)[0] is urgent[0]
    # Aging lifts the head of a class past younger work of a higher class: gold0 has
    # waited 3 s (at a class a second it ranks as 3.0), the class-2 requests 0.5 s (2.5).
    newer = [QueuedRequest(f"new{i}", 2, 2.5, 100.0, 100, tenant="iron") for i in range(2)]
    order = [q.rid for q in queue_order((queue[6], *newer), 3.0, 1.0, counters)]
    assert order == ["gold0", "new0", "new1"]
    # Inside a class it never reorders tenants: iron's request waited longer, but iron
    # was served more.
    served = VirtualCounters()
    served.charge("iron", 100.0)
    order = [q.rid for q in queue_order((queue[0], queue[7]), 3.0, 1.0, served)]
    assert order == ["gold1", "iron0"]


def test_a_pump_orders_as_queue_order_does_after_every_kind_of_change() -> None:
    """The queue keeps each class's line between pumps: a pump still sees the order
    `queue_order` gives now, after a charge, a settle, an arrival, a departure, and the
    clock moving classes against each other by aging."""
    queue: AdmissionQueue[str] = AdmissionQueue(100, 0.1, {"gold": 2.0})
    for i in range(4):
        for tenant in ("gold", "iron"):
            queue.offer(QueuedRequest(f"{tenant}{i}", 0, i, 1e9, 10, tenant=tenant, cost=50.0), "")
    queue.offer(QueuedRequest("high", 2, 25.0, 1e9, 10, tenant="iron", cost=50.0), "")

    def pumped(now: float) -> list[str]:
        seen: list[str] = []

        def look(item: QueuedRequest, _: str) -> AdmissionVerdict:
            seen.append(item.rid)
            return AdmissionVerdict.WAIT

        assert list(queue.pump(now, look)) == []
        return seen

    def expected(now: float) -> list[str]:
        entries = tuple(q for q, _ in queue.entries())
        return [q.rid for q in queue_order(entries, now, 0.1, queue.counters)]

    assert pumped(4.0) == expected(4.0)
    assert pumped(4.0)[0] == "high"
    assert pumped(26.0) == expected(26.0)
    assert pumped(26.0)[0] == "gold0"  # aged past "high"
    before = pumped(26.0)
    charged = queue.charge(Charge.placed("gold", 400, 100, 26.0, ttft_s=1.0, tpot_s=0.01))
    assert pumped(26.0) == expected(26.0) != before
    queue.settle(charged, 0, 26.0)  # it cost less than its estimate
    assert pumped(26.0) == expected(26.0)
    queue.remove("gold0")
    queue.offer(QueuedRequest("late", 0, 0.0, 1e9, 10, tenant="iron", cost=50.0), "")
    assert pumped(26.0) == expected(26.0)
    assert "gold0" not in pumped(26.0)


def test_a_queue_of_one_class_stays_settled_until_its_first_expiry() -> None:
    """After a pump that let nothing out, a queue of one class lets nothing out at any
    later pump before its first entry expires, with every decision as it was: a line
    held holds longer, and nothing behind it is reached. With two classes it promises
    nothing."""
    queue: AdmissionQueue[str] = AdmissionQueue(8, 0.5)
    queue.offer(QueuedRequest("first", 0, 0.0, 10.0, 10), "")
    queue.offer(QueuedRequest("fits", 0, 1.0, 30.0, 10), "")
    reached: list[str] = []

    def wait_unless_fits(item: QueuedRequest, _: str) -> AdmissionVerdict:
        reached.append(item.rid)
        return AdmissionVerdict.WAIT if item.rid == "first" else AdmissionVerdict.ADMIT

    assert [q.rid for q, _, _ in queue.pump(6.0, wait_unless_fits)] == []  # "first" holds
    assert queue.settled_until() == 10.0
    for now in (6.5, 8.0, 9.99):
        reached.clear()
        assert list(queue.pump(now, wait_unless_fits)) == []
        assert reached == ["first"]
    queue.offer(QueuedRequest("urgent", 3, 7.0, 30.0, 10), "")
    assert queue.settled_until() == -math.inf


def test_a_tenant_of_weight_two_is_admitted_twice_the_kv_of_one_of_weight_one() -> None:
    """Both tenants keep twenty requests waiting for an engine with room for one at a
    time, each request charged as it is admitted and settled when it ends a second
    later: over fifteen admissions gold (weight 2) got twice iron's KV token-seconds.
    A tenant that comes back after idling is lifted to the others' counters."""
    queue: AdmissionQueue[str] = AdmissionQueue(100, 0.0, {"gold": 2.0})

    def charge(tenant: str, now: float) -> Charge:
        return Charge.placed(tenant, 100, 100, now, tpot_s=0.01)

    for i in range(20):
        for tenant in ("gold", "iron"):
            item = QueuedRequest(
                f"{tenant}{i}", 0, 0.0, 1e9, 100, tenant=tenant, cost=charge(tenant, 0.0).estimate
            )
            queue.offer(item, tenant)
    room = [False]  # the engine has room for one request when a step begins

    def decide(item: QueuedRequest, payload: str) -> AdmissionVerdict:
        fits, room[0] = room[0], False
        return AdmissionVerdict.ADMIT if fits else AdmissionVerdict.WAIT

    served = {"gold": 0.0, "iron": 0.0}
    for step in range(15):
        now = float(step)
        room[0] = True
        ((item, tenant, _),) = list(queue.pump(now, decide))
        running = queue.charge(charge(tenant, now))
        queue.settle(running, 50, now + 1.0)  # it ran a second and generated 50 tokens
        served[tenant] += kv_cost(100, 50, 1.0)
    assert served["gold"] == 2 * served["iron"]
    assert queue.counters.counter("gold") == queue.counters.counter("iron")
    # Newcomers are lifted to the least counter waiting, not to zero.
    queue.offer(QueuedRequest("late0", 0, 20.0, 1e9, 100, tenant="late"), "late")
    assert queue.counters.counter("late") == queue.counters.counter("iron")


def test_engine_priority_rises_with_wait_and_urgency() -> None:
    assert engine_priority(1, 0.0, None, 1.0) == 1
    assert engine_priority(1, 5.0, None, 1.0) == 6
    assert engine_priority(1, 0.0, 2.0, 1.0) == 9
    assert engine_priority(1, 0.0, -5.0, 1.0) == 11


def test_retry_after_grows_with_the_queue() -> None:
    assert retry_after_s(0, 10, 30.0) == 1
    assert retry_after_s(10, 10, 30.0) == 8
    assert retry_after_s(5, 0, 30.0) == 8
