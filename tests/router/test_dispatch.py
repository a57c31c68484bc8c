"""The router's dispatch core on its own: route or queue, charges, reservations, the pump,
waits that end, fallbacks before the first byte and resumes, over hand-built snapshots and
an explicit clock."""

from __future__ import annotations

import pytest

from controlplane.contract import EndpointState, Lifecycle, RoutingPolicy, WatermarkState
from controlplane.routing import (
    Dispatcher,
    Placed,
    PoolSnapshot,
    PrefixIndex,
    Refused,
    RouteRequest,
    default_config,
    profile_from_config,
)
from controlplane.routing.dispatch import RESUME_BACKOFF_S, Event

PROFILE = profile_from_config(default_config())
NORMAL, CRITICAL, DRAINING = "normal", "critical", "draining"


def _snapshot(**endpoints: str) -> PoolSnapshot:
    """Endpoints by id, each normal, critical (saturated for new work) or draining."""
    states = [
        EndpointState(
            pool="p",
            endpoint_id=endpoint_id,
            address=f"http://{endpoint_id}",
            model="m",
            kv_capacity_tokens=100_000,
            predicted_ttft_s=0.5,
            predicted_tpot_s=0.02,
            watermark=WatermarkState.CRITICAL if kind == CRITICAL else WatermarkState.NORMAL,
            lifecycle=Lifecycle.DRAINING if kind == DRAINING else Lifecycle.READY,
        )
        for endpoint_id, kind in endpoints.items()
    ]
    return PoolSnapshot.of("p", states)


def _route(rid: str, tenant: str = "a", **fields: object) -> RouteRequest:
    base: dict[str, object] = {"model": "m", "prompt_tokens": 100, "max_new_tokens": 50}
    base.update(fields)
    return RouteRequest(request_id=rid, tenant=tenant, **base)  # type: ignore[arg-type]


def _outcomes(events: list[Event[str]]) -> list[tuple[str, str]]:
    """(payload, endpoint) for a placement, (payload, reason) for a refusal."""
    return [
        (e.payload, e.endpoint_id) if isinstance(e, Placed) else (e.payload, e.refusal.reason)
        for e in events
    ]


def test_a_placed_request_is_reserved_charged_once_and_settled_when_it_ends() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    snapshot = _snapshot(e0=NORMAL, e1=NORMAL)
    (placed,) = core.arrive(_route("r1", owners=("e1",)), "p1", 0.0, snapshot)
    assert isinstance(placed, Placed)
    assert (placed.payload, placed.endpoint_id) == ("p1", "e1")
    # Charged the KV it is expected to pin: its prompt and half its output limit (25),
    # held for the endpoint's TTFT (0.5 s) and 25 tokens at its TPOT (20 ms).
    assert (core.inflight.count("e1"), core.queue.counter("a")) == (1, (100 + 25) * 1.0)
    assert core.finished("r1", 10, 2.0, snapshot) == []
    # Settled to what it really pinned: its prompt and the 10 tokens generated, 2 s.
    assert (core.inflight.total, core.queue.counter("a")) == (0, pytest.approx(110 * 2.0))
    assert core.finished("r1", 10, 3.0, snapshot) == []  # once
    assert core.queue.counter("a") == pytest.approx(220)


def test_saturated_requests_wait_and_room_goes_to_the_least_served_tenant_first() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    full = _snapshot(e0=CRITICAL)
    for rid, tenant in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        assert core.arrive(_route(rid, tenant), rid, 1.0, full) == []
        assert core.waiting(rid)
    assert core.pump(2.0, full) == []  # still no room: they keep waiting
    # Each leaves the queue charged for its service: once a's first has gone, b is the
    # tenant served least, and goes before a's second.
    assert _outcomes(core.pump(3.0, _snapshot(e0=NORMAL))) == [
        ("r1", "e0"),
        ("r3", "e0"),
        ("r2", "e0"),
    ]
    assert (core.queue.counter("a"), core.queue.counter("b")) == (250, 125)


def test_a_newcomer_queues_behind_its_class_and_nothing_passes_a_head_that_cannot_go() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    assert core.arrive(_route("r1"), "p1", 0.0, _snapshot(e0=CRITICAL)) == []
    # Room is back, but r1 was first: the newcomer waits its turn, then both go.
    assert _outcomes(core.arrive(_route("r2"), "p2", 1.0, _snapshot(e0=NORMAL))) == [
        ("p1", "e0"),
        ("p2", "e0"),
    ]


def test_a_refusal_other_than_saturation_is_a_503_named_by_its_filter() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    (refused,) = core.arrive(_route("r1"), "p1", 0.0, _snapshot(e0=DRAINING, e1=DRAINING))
    assert isinstance(refused, Refused)
    assert (refused.refusal.status, refused.refusal.reason) == (503, "not-draining")
    assert refused.refusal.retryable
    assert not core.waiting("r1")


def test_a_wait_ends_with_a_full_queue_its_time_to_live_or_its_deadline() -> None:
    policy = RoutingPolicy(queue_capacity_per_band=1, queue_max_wait_s=5.0)
    core: Dispatcher[str] = Dispatcher(PROFILE, policy)
    full = _snapshot(e0=CRITICAL)
    assert core.arrive(_route("r1"), "p1", 0.0, full) == []
    (refused,) = core.arrive(_route("r2"), "p2", 1.0, full)
    assert isinstance(refused, Refused)
    assert (refused.refusal.status, refused.refusal.reason) == (429, "queue_full")
    assert refused.refusal.retry_after_s == 4.0  # when r1 would have waited its 5 s
    # Another band has room; a deadline of 2 s bounds that request's wait.
    assert core.arrive(_route("r3", priority=1, deadline_s=2.0), "p3", 1.0, full) == []
    assert core.next_wakeup() == 3.0
    (late,) = core.pump(3.0, full)
    assert isinstance(late, Refused)
    assert late.refusal.status == 504
    assert late.refusal.reason == "deadline"
    assert late.refusal.retry_after_s is None
    assert core.next_wakeup() == 5.0
    (timeout,) = core.pump(5.0, None)  # waits end even while the snapshot is stale
    assert isinstance(timeout, Refused)
    assert timeout.payload == "p1"
    assert (timeout.refusal.status, timeout.refusal.reason) == (429, "queue_timeout")
    assert core.next_wakeup() is None
    assert not len(core.queue)


def test_an_endpoint_that_refuses_before_the_first_byte_passes_it_to_the_next() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy(max_attempts=2))
    snapshot = _snapshot(e0=NORMAL, e1=NORMAL, e2=NORMAL)
    ((_, first),) = _outcomes(core.arrive(_route("r1", owners=("e0", "e2")), "p", 0.0, snapshot))
    assert first == "e0"
    # The secondary owner is the first fallback; the reservation moves with it.
    assert _outcomes(core.refused("r1", 0.1, snapshot, retry_after_s=3.0)) == [("p", "e2")]
    assert (core.inflight.count("e0"), core.inflight.count("e2")) == (0, 1)
    (refused,) = core.refused("r1", 0.2, snapshot, retry_after_s=1.0)
    assert isinstance(refused, Refused)
    assert (refused.refusal.status, refused.refusal.reason) == (429, "endpoints_overloaded")
    assert refused.refusal.retry_after_s == 3.0  # the longest an endpoint asked for
    assert core.inflight.total == 0
    # Refused before its first byte, it pinned only its prompt while it was out (0.2 s).
    assert core.queue.counter("a") == pytest.approx(100 * 0.2)


def test_a_resume_is_never_sent_back_where_it_broke_and_waits_only_so_long() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy(resume_wait_s=60.0))
    snapshot = _snapshot(e0=NORMAL, e1=CRITICAL)
    assert _outcomes(core.arrive(_route("r1", owners=("e0",)), "p", 0.0, snapshot)) == [("p", "e0")]
    # Saturation does not keep an accepted stream off e1.
    assert _outcomes(core.handed_back("r1", 40, 1.0, snapshot, broken=True)) == [("p", "e1")]
    assert core.handed_back("r1", 80, 2.0, snapshot, broken=True) == []
    assert core.waiting("r1")
    assert core.next_wakeup() == 62.0
    assert core.pump(30.0, snapshot) == []  # both broke it: neither is asked again
    (lost,) = core.pump(62.0, snapshot)
    assert isinstance(lost, Refused)
    assert (lost.refusal.status, lost.refusal.reason) == (503, "resume_failed")
    assert core.inflight.total == 0
    assert core.next_wakeup() is None
    # Its tenant pays for the 80 tokens it streamed, from its placement until it was lost.
    assert core.queue.counter("a") == pytest.approx((100 + 80) * 62.0)


def test_a_resume_s_wait_counts_only_its_time_without_an_endpoint() -> None:
    """An endpoint that queued a resume as accepted work and refused it only when its own
    wait was over (every running stream there kept its room) does not spend the resume's
    wait: it is placed again, not lost, however long it was held. The time it spends
    here with no endpoint to go to adds up over its spells, and that is what is bounded."""
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy(resume_wait_s=10.0))
    one, none = _snapshot(e0=NORMAL), _snapshot(e0=DRAINING)
    assert _outcomes(core.arrive(_route("r1"), "p", 0.0, one)) == [("p", "e0")]
    assert core.handed_back("r1", 5, 1.0, none, broken=False) == []
    assert _outcomes(core.pump(4.0, one)) == [("p", "e0")]  # 3 s without an endpoint
    # e0 held it 30 s, three times the pool's resume wait, then refused it.
    assert core.refused("r1", 34.0, none) == []
    assert core.pump(38.9, none) == []
    assert _outcomes(core.pump(39.0, one)) == [("p", "e0")]  # 3 + 5 s of its 10
    assert core.refused("r1", 50.0, none) == []
    assert core.pump(50.5, none) == []  # the backoff is over: only its wait is left
    assert core.next_wakeup() == 52.0
    (lost,) = core.pump(52.0, none)
    assert isinstance(lost, Refused)
    assert (lost.refusal.status, lost.refusal.reason) == (503, "resume_failed")


def test_an_endpoint_that_migrated_or_refused_a_resume_is_avoided_a_backoff() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    one = _snapshot(e0=NORMAL)
    assert _outcomes(core.arrive(_route("r1"), "p", 0.0, one)) == [("p", "e0")]
    assert core.handed_back("r1", 5, 1.0, one, broken=False) == []  # migrated away
    assert core.next_wakeup() == 1.0 + RESUME_BACKOFF_S
    assert _outcomes(core.pump(1.0 + RESUME_BACKOFF_S, one)) == [("p", "e0")]
    # Each refusal of the same resume doubles the time it stays away.
    assert core.refused("r1", 2.0, one) == []
    assert core.next_wakeup() == 2.0 + RESUME_BACKOFF_S
    assert _outcomes(core.pump(2.0 + RESUME_BACKOFF_S, one)) == [("p", "e0")]
    assert core.refused("r1", 3.0, one) == []
    assert core.next_wakeup() == 3.0 + 2 * RESUME_BACKOFF_S
    # Where another endpoint can take it, it goes there at once.
    two = _snapshot(e0=NORMAL, e1=NORMAL)
    assert _outcomes(core.pump(3.0, two)) == [("p", "e1")]


def test_a_migration_resumes_first_where_its_room_is_held() -> None:
    """The sidecar that migrated it took room at a target: the resume goes there, over
    the endpoint routing would pick (its owner) and over a target's saturation (the held
    room is counted in what it published). A preference, tried once: a target that
    refuses, is gone or is draining leaves the resume to the usual decision."""
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    snapshot = _snapshot(e0=NORMAL, e1=NORMAL, e2=CRITICAL)
    placed = core.arrive(_route("r1", owners=("e1", "e0")), "p", 0.0, snapshot)
    assert _outcomes(placed) == [("p", "e1")]
    assert _outcomes(core.handed_back("r1", 5, 1.0, snapshot, broken=False, target="e2")) == [
        ("p", "e2")
    ]
    # It refused after all (its room expired, say): avoided, and decided as usual.
    assert _outcomes(core.refused("r1", 1.01, snapshot)) == [("p", "e0")]  # e1: just left
    for gone in (_snapshot(e0=NORMAL, e1=NORMAL), _snapshot(e0=NORMAL, e1=NORMAL, e2=DRAINING)):
        core.finished("r1", 5, 3.0, gone)
        core.arrive(_route("r1", owners=("e1", "e0")), "p", 3.0, gone)
        handed = core.handed_back("r1", 5, 4.0, gone, broken=False, target="e2")
        assert _outcomes(handed) == [("p", "e0")]  # e1 migrated it: avoided a while


def test_a_resume_goes_ahead_of_new_work_of_its_class_when_room_returns() -> None:
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy())
    snapshot = _snapshot(e0=NORMAL, e1=NORMAL, e2=NORMAL)
    assert _outcomes(core.arrive(_route("r1", owners=("e0", "e1")), "p1", 0.0, snapshot)) == [
        ("p1", "e0")
    ]
    full = _snapshot(e0=CRITICAL, e1=CRITICAL, e2=DRAINING)
    assert core.arrive(_route("r2"), "p2", 1.0, full) == []  # saturated: queued
    assert _outcomes(core.handed_back("r1", 10, 1.0, full, broken=True)) == [("p1", "e1")]
    assert core.handed_back("r1", 20, 1.5, full, broken=True) == []  # only e2 is left
    # e2 is back: the resume takes it first, which leaves it too loaded for new work
    # (had r2 gone first, the resume would have followed it there all the same).
    back = _snapshot(e0=CRITICAL, e1=CRITICAL, e2=NORMAL)
    assert _outcomes(core.pump(2.0, back)) == [("p1", "e2")]
    assert core.waiting("r2")


def test_where_a_request_went_is_learnt_by_the_prefix_plugin_once_the_endpoint_has_it() -> None:
    """The prefix index is the prefix plugin's state, kept by its post-decision hook: the
    driver says when the endpoint has the request (`reached`), for the router and the
    simulator alike. A profile without the plugin keeps no index; a core without an
    index has none to keep."""
    index = PrefixIndex()
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy(), index)
    snapshot = _snapshot(e0=NORMAL, e1=NORMAL)
    (placed,) = core.arrive(_route("r1", block_hashes=(1, 2, 3)), "p1", 0.0, snapshot)
    assert isinstance(placed, Placed)
    assert index.holders((1, 2, 3)) == {}  # placed is not reached: it may still be refused
    core.reached(placed.route, placed.endpoint_id)
    assert index.holders((1, 2, 3)) == {placed.endpoint_id: 3}

    config = default_config()
    config["scorers"] = [s for s in config["scorers"] if s["name"] != "prefix-affinity"]
    elsewhere = PrefixIndex()
    without = Dispatcher[str](profile_from_config(config), RoutingPolicy(), elsewhere)
    (placed,) = without.arrive(_route("r2", block_hashes=(1, 2, 3)), "p2", 0.0, snapshot)
    assert isinstance(placed, Placed)
    without.reached(placed.route, placed.endpoint_id)
    assert len(elsewhere) == 0
    Dispatcher[str](PROFILE, RoutingPolicy()).reached(placed.route, placed.endpoint_id)


@pytest.mark.parametrize("gold_output", [50, 150])
def test_a_tenant_of_weight_two_gets_twice_the_kv_service_while_both_wait(
    gold_output: int,
) -> None:
    """Thirty requests of each tenant wait for a saturated endpoint; when it has room, the
    pump places them in the fair queue's order. While both tenants still wait, `gold`
    (weight 2) has been placed twice the KV cost of `iron` (weight 1): twice as many
    requests of the same size, or as many requests of twice the cost (150 output tokens
    to 50: 175 KV tokens held 3.5 s against 125 held 1.5 s at 20 ms a token, ~3.3x)."""
    core: Dispatcher[str] = Dispatcher(PROFILE, RoutingPolicy(), weights={"gold": 2.0})
    full = _snapshot(e0=CRITICAL)
    for i in range(30):
        for tenant, output in (("gold", gold_output), ("iron", 50)):
            rid = f"{tenant}{i}"
            assert core.arrive(_route(rid, tenant, max_new_tokens=output), rid, 0.0, full) == []
    placed = [payload for payload, _ in _outcomes(core.pump(1.0, _snapshot(e0=NORMAL)))]
    assert len(placed) == 60
    # Each placement was charged its estimate: served KV per tenant over the first 30.
    estimate = {"gold": (100 + gold_output / 2) * (0.5 + gold_output / 2 * 0.02)}
    estimate["iron"] = (100 + 25) * (0.5 + 25 * 0.02)
    served = dict.fromkeys(estimate, 0.0)
    for rid in placed[:30]:
        tenant = rid.rstrip("0123456789")
        served[tenant] += estimate[tenant]
    assert served["gold"] / served["iron"] == pytest.approx(2.0, rel=0.15)
    # Both were backlogged all along: neither ran out within the first 30.
    assert {rid.rstrip("0123456789") for rid in placed[30:]} == {"gold", "iron"}
