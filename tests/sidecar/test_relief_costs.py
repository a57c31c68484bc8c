"""The relief ladder's cost-based choice between recompute, offload and migrate: the choice
flips at the crossovers the cost model predicts (offload to recompute as host bandwidth
falls, recompute to offload as the context grows), offloads share the host room, and
every choice is explained with its three costs."""

from __future__ import annotations

import dataclasses

import pytest

from controlplane.contract import (
    KVPolicy,
    PoolPolicy,
    PreemptionMode,
    SchedulingPolicy,
    WatermarkState,
)
from engine_sidecar.policy import KVUsage, ReliefCosts, Rung, VictimCandidate, plan_relief
from tests.sidecar.test_relief import _cand

CAPACITY = 400_000
POLICY = PoolPolicy(
    pool="p",
    model="m",
    kv=KVPolicy(growth_horizon_steps=80),
    scheduling=SchedulingPolicy(
        preemption_modes=(PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD, PreemptionMode.MIGRATE)
    ),
)
# An 8B model on an H200: 2·params FLOPs per token and 4·layers·hidden per attention pair
# at 60 % of 989 TFLOP/s; a 7 ms decode step; 128 KiB of KV per token.
H200_8B = ReliefCosts(
    prefill_s_per_token=2 * 8.03e9 / (989e12 * 0.6),
    prefill_s_per_pair=4 * 32 * 4096 / (989e12 * 0.6),
    decode_step_s=0.007,
    kv_bytes_per_token=128 * 1024,
    host_bytes_per_s=50e9,
    host_room_tokens=CAPACITY,
    migrate_handoff_s=0.05,
)


def victim(rid: str, context: int, **kw: object) -> VictimCandidate:
    """A candidate with `context` tokens of KV (100 generated, unless `kw` says)."""
    fields: dict[str, object] = {"generated_tokens": 100, **kw}
    return _cand(rid, prompt_tokens=context - int(fields["generated_tokens"]), **fields)  # type: ignore[call-overload]


def modes(
    cands: list[VictimCandidate], costs: ReliefCosts | None, room: int = 100_000
) -> list[tuple[str, Rung]]:
    # Committed far beyond the capacity: the plan takes every candidate, best first; one
    # peer has `room`.
    plan = plan_relief(
        KVUsage(CAPACITY, 10 * CAPACITY, 0), WatermarkState.EXHAUSTED, cands, POLICY, 0.0,
        {"peer": room}, costs,
    )  # fmt: skip
    return [(v.rid, v.mode) for v in plan.victims]


def with_bandwidth(bytes_per_s: float) -> ReliefCosts:
    return dataclasses.replace(H200_8B, host_bytes_per_s=bytes_per_s)


def test_offload_flips_to_recompute_as_host_bandwidth_falls() -> None:
    """C_offload+onboard = 2·n·B/bw against C_recompute(n): the crossover bandwidth is
    2·n·B / C_recompute(n) (about 8.6 GB/s for 8,000 tokens)."""
    n = 8000
    crossover = 2 * n * H200_8B.kv_bytes_per_token / H200_8B.recompute_s(n)
    assert 8.5e9 < crossover < 8.7e9
    assert modes([victim("v", n)], with_bandwidth(crossover * 1.01)) == [("v", Rung.OFFLOAD)]
    assert modes([victim("v", n)], with_bandwidth(crossover * 0.99)) == [("v", Rung.RECOMPUTE)]


def test_recompute_flips_to_offload_as_the_context_grows() -> None:
    """Recompute grows with the square of the context, the host round trip linearly: at
    5 GB/s the two meet where 2·B/bw = a + (n+1)/2·b (about 58,000 tokens)."""
    costs = with_bandwidth(5e9)
    per_token = 2 * costs.kv_bytes_per_token / costs.host_bytes_per_s
    crossover = 2 * (per_token - costs.prefill_s_per_token) / costs.prefill_s_per_pair - 1
    assert 55_000 < crossover < 60_000
    short, long = int(crossover * 0.99), int(crossover * 1.01)
    assert modes([victim("v", short)], costs) == [("v", Rung.RECOMPUTE)]
    assert modes([victim("v", long)], costs) == [("v", Rung.OFFLOAD)]


def test_the_host_tier_keeps_whole_pages_and_the_partial_one_is_computed_again() -> None:
    """Pages of 16: of 8,010 tokens, 8,000 make the round trip and the last 10 are
    prefilled again, each attending to all before it (what recompute's last 10 cost)."""
    paged = dataclasses.replace(H200_8B, page_tokens=16)
    tail = H200_8B.recompute_s(8010) - H200_8B.recompute_s(8000)
    assert paged.offload_s(8010) == pytest.approx(H200_8B.offload_s(8000) + tail)  # type: ignore[operator]
    assert paged.offload_s(8000) == H200_8B.offload_s(8000)
    with pytest.raises(ValueError, match="page_tokens"):
        dataclasses.replace(H200_8B, page_tokens=0)


def test_without_a_host_tier_or_host_room_nothing_is_offloaded() -> None:
    assert modes([victim("v", 8000)], with_bandwidth(0.0)) == [("v", Rung.RECOMPUTE)]
    cramped = dataclasses.replace(H200_8B, host_room_tokens=7999)
    assert modes([victim("v", 8000)], cramped) == [("v", Rung.RECOMPUTE)]
    # Two offloads do not count on the same host room.
    shared = dataclasses.replace(H200_8B, host_room_tokens=12000)
    got = modes([victim("a", 8000, priority=0), victim("b", 8000, priority=1)], shared)
    assert got == [("a", Rung.OFFLOAD), ("b", Rung.RECOMPUTE)]


def test_without_known_costs_the_ladder_order_holds_and_nothing_is_offloaded() -> None:
    assert modes([victim("v", 8000)], None) == [("v", Rung.RECOMPUTE)]
    assert modes([victim("v", 8000, migratable=True)], None) == [("v", Rung.MIGRATE)]


def test_migration_wins_when_room_here_is_far_off() -> None:
    """In place, the victim first waits for the soonest-finishing requests to free its
    continuation's KV; a migration to an endpoint with room waits for none of that."""
    mover = victim("m", 8000, migratable=True, priority=0)
    # A long-running neighbour (1,000 steps of 7 ms to go) holds the room it would need.
    neighbour = victim("n", 9000, priority=5, generated_tokens=0, predicted_total_tokens=1000)
    plan = plan_relief(
        KVUsage(CAPACITY, 10 * CAPACITY, 0), WatermarkState.EXHAUSTED, [mover, neighbour],
        POLICY, 0.0, {"peer": 100_000}, H200_8B,
    )  # fmt: skip
    chosen = {v.rid: v for v in plan.victims}
    assert chosen["m"].mode is Rung.MIGRATE
    assert chosen["m"].fallback is Rung.OFFLOAD  # if its target refuses: the next cheapest
    costs = chosen["m"].score.costs
    assert costs is not None
    assert costs.migrate_s == pytest.approx(0.05 + H200_8B.recompute_s(8000))
    assert costs.offload_s == pytest.approx(7.0 + H200_8B.offload_s(8000))  # type: ignore[operator]
    # Alone, nothing holds its room: resuming in place from the host is cheapest.
    assert modes([mover], H200_8B, room=100_000) == [("m", Rung.OFFLOAD)]


def test_every_choice_explains_its_three_costs() -> None:
    plan = plan_relief(
        KVUsage(CAPACITY, 2 * CAPACITY, 0), WatermarkState.EXHAUSTED, [victim("v", 8000)],
        POLICY, 0.0, {"peer": 0}, H200_8B,
    )  # fmt: skip
    (choice,) = plan.victims
    text = choice.score.explain()
    assert "C_recompute=0." in text
    assert "C_offload+onboard=0.042s" in text  # 2 · 8000 · 128 KiB / 50 GB/s
    assert "C_migrate=n/a" in text
    assert Rung.OFFLOAD in plan.rungs
