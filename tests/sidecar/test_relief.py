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
from engine_sidecar.policy import KVUsage, Rung, VictimCandidate, peer_room, plan_relief

W = WatermarkState
POLICY = PoolPolicy(pool="p", model="m", kv=KVPolicy(growth_horizon_steps=80))


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
    assert plan_relief(KVUsage(1000, 750, 0), W.PRESSURE, cands, POLICY, 0).rungs == (
        Rung.STOP_ROUTING,
    )
    crit = plan_relief(KVUsage(1000, 870, 0), W.CRITICAL, cands, POLICY, 0)
    assert crit.rungs == (Rung.STOP_ROUTING, Rung.PAUSE_ADMISSION, Rung.FAVOUR_NEAR_DONE)
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


def test_near_done_is_spared_and_favoured() -> None:
    near = _cand("near", generated_tokens=790, prompt_tokens=2000)
    far = _cand("far", generated_tokens=10)
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [near, far], POLICY, 0)
    assert plan.victims[0].rid == "far"
    assert plan.favoured == ("near",)


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
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [movable], POLICY, 0)
    assert plan.victims[0].mode is Rung.MIGRATE
    assert Rung.MIGRATE in plan.rungs
    recompute_only = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(preemption_modes=(PreemptionMode.RECOMPUTE,))
    )
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [movable], recompute_only, 0)
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
    plan = plan_relief(_exhausted(), W.EXHAUSTED, [huge, small], POLICY, 0)
    assert [v.rid for v in plan.victims] == ["small"]
    assert plan_relief(_exhausted(), W.EXHAUSTED, [huge], POLICY, 0).victims == ()
    may_abort = msgspec.structs.replace(
        POLICY, scheduling=SchedulingPolicy(overload_may_abort=True)
    )
    (victim,) = plan_relief(_exhausted(), W.EXHAUSTED, [huge], may_abort, 0).victims
    assert victim.mode is Rung.TERMINATE


def test_a_victim_migrates_only_while_another_endpoint_has_room() -> None:
    """A move to an endpoint with no room would only wait there: relief recomputes in
    place instead, and two migrations do not count on the same room."""
    movers = [_cand(rid, migratable=True, priority=p) for rid, p in (("a", 0), ("b", 1))]
    need = 100 + 100 + 80  # prompt + generated + the growth reserve of the horizon
    full = plan_relief(_exhausted(), W.EXHAUSTED, movers[:1], POLICY, 0, migration_room=need - 1)
    assert [(v.rid, v.mode) for v in full.victims] == [("a", Rung.RECOMPUTE)]
    roomy = plan_relief(_exhausted(), W.EXHAUSTED, movers[:1], POLICY, 0, migration_room=need)
    assert [(v.rid, v.mode) for v in roomy.victims] == [("a", Rung.MIGRATE)]
    both = plan_relief(_exhausted(1200), W.EXHAUSTED, movers, POLICY, 0, migration_room=need)
    assert [(v.rid, v.mode) for v in both.victims] == [("a", Rung.MIGRATE), ("b", Rung.RECOMPUTE)]


def test_the_room_elsewhere_is_the_largest_any_ready_peer_would_admit() -> None:
    def peer(
        used: int, watermark: W = W.NORMAL, lifecycle: Lifecycle = Lifecycle.READY
    ) -> EndpointState:
        return EndpointState(
            pool="p", endpoint_id=f"e{used}", address="http://x", model="m",
            kv_capacity_tokens=1000, kv_used_tokens=used, watermark=watermark,
            lifecycle=lifecycle,
        )  # fmt: skip

    kv = POLICY.kv
    assert peer_room([], kv) == 0
    assert peer_room([peer(500), peer(200)], kv) == 1000 - kv.safety_tokens(1000) - 200
    assert peer_room([peer(100, W.CRITICAL), peer(0, lifecycle=Lifecycle.DRAINING)], kv) == 0
