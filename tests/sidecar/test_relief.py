"""The relief ladder's order and victim scoring, with explanations and a preemption cap."""

from __future__ import annotations

import msgspec

from controlplane.contract import (
    EndpointState,
    KVPolicy,
    Lifecycle,
    PoolPolicy,
    PreemptionMode,
    SchedulingPolicy,
    WatermarkState,
)
from engine_sidecar.policy import (
    KVUsage,
    Rung,
    TargetRooms,
    VictimCandidate,
    peer_rooms,
    pick_target,
    plan_relief,
)

W = WatermarkState
POLICY = PoolPolicy(pool="p", model="m", kv=KVPolicy(growth_horizon_steps=80))
ROOMY = {"peer": 10_000}  # a peer with room for any continuation here


def _cand(rid: str, **kw: object) -> VictimCandidate:
    fields: dict[str, object] = {
        "rid": rid,
        "prompt_tokens": 100,
        "generated_tokens": 100,
        "max_new_tokens": 1000,
        "predicted_total_tokens": 800,
        "reserved_growth_tokens": 80,
        "priority": 0,
        "deadline_at": 0.0,
        "preemptions": 0,
        "recomputable": True,
        "migratable": False,
    }
    fields.update(kw)
    return VictimCandidate(**fields)  # type: ignore[arg-type]


def _exhausted(committed: int = 960) -> KVUsage:
    return KVUsage(capacity_tokens=1000, used_tokens=committed - 100, reserved_growth_tokens=100)


def test_rungs_follow_the_ladder_by_state() -> None:
    cands = [_cand("a")]
    assert plan_relief(KVUsage(1000, 100, 0), W.NORMAL, cands, POLICY, 0).rungs == ()
    # Pressure is the routers' to act on (they read the published watermark).
    assert plan_relief(KVUsage(1000, 750, 0), W.PRESSURE, cands, POLICY, 0).rungs == ()
    crit = plan_relief(KVUsage(1000, 870, 0), W.CRITICAL, cands, POLICY, 0)
    assert crit.rungs == (Rung.PAUSE_ADMISSION, Rung.FAVOUR_NEAR_DONE)
    assert crit.admission_paused
    assert crit.victims == ()


def test_exhausted_picks_enough_victims_and_explains() -> None:
    cands = [_cand("a"), _cand("b", generated_tokens=600), _cand("c", generated_tokens=10)]
    plan = plan_relief(_exhausted(), W.EXHAUSTED, cands, POLICY, 0)
    assert plan.needed_tokens == 960 - 850
    assert plan.rungs[-1] is Rung.RECOMPUTE
    assert sum(v.score.kv_freed_tokens for v in plan.victims) >= plan.needed_tokens
    assert len(plan.victims) == 1
    assert "frees=" in plan.victims[0].score.explain()


def test_near_done_is_spared() -> None:
    near = _cand("near", generated_tokens=790, prompt_tokens=2000)
    far = _cand("far", generated_tokens=10)
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [near, far], POLICY, 0)
    assert [v.rid for v in plan.victims] == ["far"]


def test_low_priority_and_slack_go_first() -> None:
    hi = _cand("hi", priority=10)
    lo = _cand("lo", priority=0)
    assert plan_relief(_exhausted(), W.EXHAUSTED, [hi, lo], POLICY, 0).victims[0].rid == "lo"
    urgent = _cand("urgent", deadline_at=5.0)
    relaxed = _cand("relaxed", deadline_at=500.0)
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [urgent, relaxed], POLICY, 0)
    assert plan.victims[0].rid == "relaxed"
    assert plan.victims[0].score.deadline_slack_s == 500.0


def test_preemption_cap_and_modes() -> None:
    capped = _cand("capped", preemptions=POLICY.scheduling.max_preemptions_per_request)
    assert plan_relief(_exhausted(), W.EXHAUSTED, [capped], POLICY, 0).victims == ()
    movable = _cand("m", migratable=True)
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [movable], POLICY, 0, ROOMY)
    assert plan.victims[0].mode is Rung.MIGRATE
    assert Rung.MIGRATE in plan.rungs
    recompute_only = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(preemption_modes=(PreemptionMode.RECOMPUTE,))
    )
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [movable], recompute_only, 0, ROOMY)
    assert plan.victims[0].mode is Rung.RECOMPUTE
    pinned = _cand("pinned", recomputable=False)
    assert plan_relief(_exhausted(), W.EXHAUSTED, [pinned], POLICY, 0).victims == ()
    may_abort = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(overload_may_abort=True)
    )
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [pinned], may_abort, 0)
    assert plan.victims[0].mode is Rung.TERMINATE
    assert plan.rungs[-1] is Rung.TERMINATE


def test_a_victim_whose_continuation_fits_nowhere_is_passed_over() -> None:
    """The simulator's lost request: a long prompt far into its output, whose continuation
    (prompt + output + growth reserve) is more than any endpoint of the pool admits. Moving
    it would lose it; relief takes the next victim instead, and with no other only a pool
    that allows aborts terminates it."""
    huge = _cand("huge", prompt_tokens=700, generated_tokens=200, migratable=True)
    small = _cand("small", priority=5, migratable=True)
    assert POLICY.kv.safety_tokens(1000) > 1000 - (700 + 200 + 80)
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [huge, small], POLICY, 0, ROOMY)
    assert [v.rid for v in plan.victims] == ["small"]
    assert plan_relief(_exhausted(), W.EXHAUSTED, [huge], POLICY, 0, ROOMY).victims == ()
    may_abort = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(overload_may_abort=True)
    )
    (victim,) = plan_relief(_exhausted(), W.EXHAUSTED, [huge], may_abort, 0).victims
    assert victim.mode is Rung.TERMINATE


def test_a_victim_migrates_only_to_a_named_peer_with_room() -> None:
    """A move to an endpoint with no room would only wait there: relief recomputes in
    place instead; a migration names the peer with the most room that fits it, and two
    migrations do not count on the same room. With no peer known, nothing migrates."""
    movers = [_cand(rid, migratable=True, priority=p) for rid, p in (("a", 0), ("b", 1))]
    need = 100 + 100 + 80  # prompt + generated + the growth reserve of the horizon
    alone = plan_relief(_exhausted(), W.EXHAUSTED, movers[:1], POLICY, 0)
    assert [(v.rid, v.mode) for v in alone.victims] == [("a", Rung.RECOMPUTE)]
    full = plan_relief(_exhausted(), W.EXHAUSTED, movers[:1], POLICY, 0, {"x": need - 1})
    assert [(v.rid, v.mode) for v in full.victims] == [("a", Rung.RECOMPUTE)]
    roomy = plan_relief(_exhausted(), W.EXHAUSTED, movers[:1], POLICY, 0, {"x": need, "y": 0})
    (victim,) = roomy.victims
    assert (victim.rid, victim.mode, victim.target, victim.tokens) == ("a", Rung.MIGRATE, "x", need)
    assert victim.fallback is Rung.RECOMPUTE  # if "x" refuses after all
    both = plan_relief(_exhausted(1200), W.EXHAUSTED, movers, POLICY, 0, {"x": need})
    assert [(v.rid, v.mode, v.target) for v in both.victims] == [
        ("a", Rung.MIGRATE, "x"), ("b", Rung.RECOMPUTE, ""),
    ]  # fmt: skip
    two = plan_relief(_exhausted(1200), W.EXHAUSTED, movers, POLICY, 0, {"x": need, "y": need + 1})
    assert [v.target for v in two.victims] == ["y", "x"]
    pinned = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(preemption_modes=(PreemptionMode.MIGRATE,))
    )
    (only_move,) = plan_relief(
        _exhausted(), W.EXHAUSTED, movers[:1], pinned, 0, {"x": need}
    ).victims
    assert (only_move.mode, only_move.fallback) == (Rung.MIGRATE, None)  # else left running


def test_a_migration_target_is_the_peer_with_most_room_that_fits() -> None:
    assert pick_target(100, {}) is None
    assert pick_target(100, {"a": 99}) is None
    assert pick_target(100, {"a": 100, "b": 300, "c": 300}) == "b"  # ties by id
    targets = TargetRooms({"a": 250, "b": 300})
    assert targets.pick(200) == "b"
    targets.answered("b", 200, True, 0)  # granted: 100 left there
    assert targets.pick(200) == "a"
    targets.answered("a", 200, False, 150)  # refused, saying it has 150
    assert targets.pick(200) is None
    assert targets.pick(150) == "a"
    targets.answered("a", 150, False, 900)  # refused whatever it says: not asked again
    assert targets.pick(150) is None


def test_the_room_elsewhere_is_what_each_ready_peer_would_admit() -> None:
    def peer(
        used: int, watermark: W = W.NORMAL, lifecycle: Lifecycle = Lifecycle.READY
    ) -> EndpointState:
        return EndpointState(
            pool="p", endpoint_id=f"e{used}", address="http://x", model="m",
            kv_capacity_tokens=1000, kv_used_tokens=used, watermark=watermark,
            lifecycle=lifecycle,
        )  # fmt: skip

    kv = POLICY.kv
    assert peer_rooms([], kv) == {}
    assert peer_rooms([peer(500), peer(200)], kv) == {
        "e500": 1000 - kv.safety_tokens(1000) - 500,
        "e200": 1000 - kv.safety_tokens(1000) - 200,
    }
    assert peer_rooms([peer(100, W.CRITICAL), peer(0, lifecycle=Lifecycle.DRAINING)], kv) == {
        "e100": 0
    }
