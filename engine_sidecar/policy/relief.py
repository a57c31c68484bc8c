"""The relief ladder and victim scoring: what to do, mildest first, when KV runs high.

Rungs, in ARCHITECTURE.md's order:

1. stop new routing — the routers' step, not this plan's: they read the watermark state
   the sidecar publishes, prefer other endpoints from pressure and route none here from
   critical;
2. pause local prefill admission (critical and up);
3. let near-done decodes finish first — they are the last to be chosen as victims (the
   victim score's near-done term);
4. migrate what can move (lower the low-priority concurrency on this endpoint);
5. offload what can be resumed from the engine's host tier (abort in the engine, its
   pages written back to host memory as they are evicted, resume in place from them);
6. recompute what can be resumed (abort in the engine, resume later in place);
7. terminate — only where the pool's contract allows it (`overload_may_abort`).

Rungs 4–6 act only when the pool is exhausted: enough victims are picked to bring the
committed KV (held + reserved growth) back below the critical threshold. Victims are
scored, not simply the largest; every `VictimScore` keeps its terms so that the decision
can be logged and explained. A request preempted `max_preemptions_per_request` times is
never picked again (no thrashing).

How a victim is relieved is a cost comparison when the endpoint's costs are known
(`ReliefCosts`): C_recompute, C_offload + C_onboard and C_migrate, each the seconds until
the victim produces again, and the cheapest possible mode wins. Resuming in place
(recompute or offload) first waits for this endpoint to have room for the continuation;
a migration waits for none but recomputes on the target. Recompute time grows with the
square of the context (attention), a host round trip linearly: offload wins as contexts
grow and loses as host bandwidth falls. Without known costs the order is the ladder's.

A migration goes to a named peer (`VictimChoice.target`: the one with the most room that
fits the continuation, from what the peers last published) and only once that peer holds
room for it (`engine_sidecar.policy.reservation`). Published room can be stale and two
sidecars can plan on the same room: a target that refuses is corrected in `TargetRooms`
and the next one tried; with none left the victim takes its `fallback` (resumed in place,
or left running).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from controlplane.contract import (
    EndpointState,
    KVPolicy,
    Lifecycle,
    PoolPolicy,
    PreemptionMode,
    WatermarkState,
)
from controlplane.rules.credits import endpoint_headroom_tokens
from engine_sidecar.policy.admission import SequenceOutlook, growth_reserve
from engine_sidecar.policy.reservation import pick_target
from engine_sidecar.policy.watermark import KVUsage


class Rung(enum.StrEnum):
    """A rung the sidecar's plan applies (stopping new routing is the routers')."""

    PAUSE_ADMISSION = "pause_admission"
    FAVOUR_NEAR_DONE = "favour_near_done"
    MIGRATE = "migrate"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    TERMINATE = "terminate"


@dataclass(frozen=True, slots=True)
class VictimCandidate:
    """A running sequence as victim selection sees it."""

    rid: str
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int
    predicted_total_tokens: int
    reserved_growth_tokens: int
    priority: int
    deadline_at: float
    preemptions: int
    recomputable: bool
    migratable: bool

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def predicted_remaining(self) -> int:
        return max(0, min(self.max_new_tokens, self.predicted_total_tokens) - self.generated_tokens)


@dataclass(frozen=True, slots=True)
class ReliefCosts:
    """What this endpoint's relief modes cost, from the engine's roofline (seconds of
    prefill per recomputed token and per attention pair, seconds per decode step) and
    its host tier (`host_bytes_per_s` 0: none; `host_room_tokens`: the KV offloads may
    still claim there; `page_tokens`: the tier copies whole pages only)."""

    prefill_s_per_token: float
    prefill_s_per_pair: float
    decode_step_s: float
    kv_bytes_per_token: int
    host_bytes_per_s: float = 0.0
    host_room_tokens: int = 0
    migrate_handoff_s: float = 0.0
    page_tokens: int = 1

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.page_tokens <= 0:
            raise ValueError("kv_bytes_per_token and page_tokens must be positive")

    def recompute_s(self, tokens: int) -> float:
        """Re-prefilling `tokens` tokens of history: linear work plus attention's pairs."""
        return self._prefill_s(0, tokens)

    def offload_s(self, tokens: int) -> float | None:
        """Writing `tokens` tokens of KV to host memory as whole pages and loading them
        back, and computing again the last partial page, which the tier does not keep
        (None: there is no host tier)."""
        if self.host_bytes_per_s <= 0:
            return None
        paged = tokens - tokens % self.page_tokens
        copies = 2.0 * paged * self.kv_bytes_per_token / self.host_bytes_per_s
        return copies + self._prefill_s(paged, tokens)

    def _prefill_s(self, cached: int, tokens: int) -> float:
        """Prefilling tokens `cached`..`tokens` of a history whose first `cached` are in
        the cache: each attends to every token up to itself."""
        pairs = tokens * (tokens + 1) // 2 - cached * (cached + 1) // 2
        return (tokens - cached) * self.prefill_s_per_token + pairs * self.prefill_s_per_pair


# The live sidecar's figures until an engine publishes its own: an 8B model (Llama-3.1-8B)
# on an H200, as the reference engine's roofline has it: 2·params FLOPs per token and
# 4·layers·hidden per attention pair at 60 % of 989 TFLOP/s, a decode step reading the
# weights at 80 % of 4.8 TB/s plus 3 ms, 128 KiB of KV per token, and PCIe Gen5 x16 at
# 50 GB/s to host memory. Only the costs' ratios decide a mode, so a faster or slower
# GPU of the same balance chooses alike.
H200_LLAMA_8B = ReliefCosts(
    prefill_s_per_token=2 * 8.03e9 / (989e12 * 0.6),
    prefill_s_per_pair=4 * 32 * 4096 / (989e12 * 0.6),
    decode_step_s=0.003 + 2 * 8.03e9 / (4.8e12 * 0.8),
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    host_bytes_per_s=50e9,
)


@dataclass(frozen=True, slots=True)
class ModeCosts:
    """A victim's three costs, each the seconds until it produces again; None where
    that mode is impossible for it (not allowed, no room, no host tier)."""

    recompute_s: float | None
    offload_s: float | None
    migrate_s: float | None

    def cheapest(self) -> Rung | None:
        """The cheapest possible mode; ties go to the ladder's order."""
        options = [
            (cost, rank, mode)
            for rank, (mode, cost) in enumerate(
                (
                    (Rung.MIGRATE, self.migrate_s),
                    (Rung.OFFLOAD, self.offload_s),
                    (Rung.RECOMPUTE, self.recompute_s),
                )
            )
            if cost is not None
        ]
        return min(options)[2] if options else None

    def explain(self) -> str:
        def show(cost: float | None) -> str:
            return "n/a" if cost is None else f"{cost:.3f}s"

        return (
            f"C_recompute={show(self.recompute_s)} C_offload+onboard={show(self.offload_s)} "
            f"C_migrate={show(self.migrate_s)}"
        )


@dataclass(frozen=True, slots=True)
class VictimScore:
    """Why a candidate ranks where it does. Higher `total` = better victim."""

    kv_freed_tokens: int
    progress: float
    remaining_tokens: int
    recompute_tokens: int
    priority: int
    deadline_slack_s: float | None
    preemptions: int
    near_done: bool
    total: float
    costs: ModeCosts | None = None  # set for a chosen victim when the costs are known

    def explain(self) -> str:
        slack = "none" if self.deadline_slack_s is None else f"{self.deadline_slack_s:.1f}s"
        return (
            f"score={self.total:.3f} frees={self.kv_freed_tokens} progress={self.progress:.2f} "
            f"remaining≈{self.remaining_tokens} recompute={self.recompute_tokens} "
            f"priority={self.priority} deadline_slack={slack} preemptions={self.preemptions}"
            f"{' near-done' if self.near_done else ''}"
            f"{'' if self.costs is None else ' ' + self.costs.explain()}"
        )


@dataclass(frozen=True, slots=True)
class VictimChoice:
    """A victim and how it is relieved. A migration names its `target` and the room it
    asks there (`tokens`, its continuation), and the mode it takes instead if no peer
    holds that room after all (`fallback`; None: it is left running)."""

    rid: str
    mode: Rung
    score: VictimScore
    target: str = ""
    tokens: int = 0
    fallback: Rung | None = None


@dataclass(frozen=True, slots=True)
class ReliefPlan:
    watermark: WatermarkState
    rungs: tuple[Rung, ...]
    victims: tuple[VictimChoice, ...]
    needed_tokens: int
    # Every candidate scored, best victim first: the alternatives a victim was chosen over.
    ranked: tuple[tuple[str, VictimScore], ...] = ()

    @property
    def admission_paused(self) -> bool:
        return Rung.PAUSE_ADMISSION in self.rungs


# Deadline slack under which a request is treated as urgent and spared.
_URGENT_SLACK_S: Final = 30.0
_NO_PEERS: Mapping[str, int] = MappingProxyType({})


def score_victim(
    cand: VictimCandidate,
    now: float,
    near_done_tokens: int,
    scale_tokens: int,
    priority_span: tuple[int, int],
    max_preemptions: int,
) -> VictimScore:
    """Score one candidate. Terms are normalised to [0, 1] against the candidate set."""
    scale = max(1, scale_tokens)
    low, high = priority_span
    predicted_total = max(1, min(cand.max_new_tokens, cand.predicted_total_tokens))
    progress = min(1.0, cand.generated_tokens / predicted_total)
    freed = cand.kv_tokens + cand.reserved_growth_tokens
    slack = None if cand.deadline_at <= 0 else cand.deadline_at - now
    urgency = 0.0 if slack is None else max(0.0, 1.0 - max(0.0, slack) / _URGENT_SLACK_S)
    lowness = 1.0 if high == low else (high - cand.priority) / (high - low)
    near_done = cand.predicted_remaining <= near_done_tokens
    total = (
        1.0 * freed / scale
        + 1.0 * cand.predicted_remaining / scale
        - 1.0 * progress
        - 0.5 * cand.kv_tokens / scale
        + 1.0 * lowness
        - 1.0 * urgency
        - 0.5 * cand.preemptions / max(1, max_preemptions)
        - (2.0 if near_done else 0.0)
    )
    return VictimScore(
        kv_freed_tokens=freed,
        progress=progress,
        remaining_tokens=cand.predicted_remaining,
        recompute_tokens=cand.kv_tokens,
        priority=cand.priority,
        deadline_slack_s=slack,
        preemptions=cand.preemptions,
        near_done=near_done,
        total=total,
    )


def _mode(
    cand: VictimCandidate,
    policy: PoolPolicy,
    capacity_tokens: int,
    room: int,
    costs: ModeCosts | None = None,
) -> Rung | None:
    """How a victim is relieved: the cheapest possible mode when its `costs` are known;
    else migrated where it can move and some endpoint has room for its continuation
    (`room`: the most any other endpoint would admit), else recomputed in place; failing
    all, terminated where the pool allows it."""
    if costs is not None:
        mode = costs.cheapest()
    else:
        possible = _possible(cand, policy, capacity_tokens, room)
        mode = next((m for m in (Rung.MIGRATE, Rung.RECOMPUTE) if m in possible), None)
    if mode is None and policy.scheduling.overload_may_abort:
        return Rung.TERMINATE
    return mode


def _possible(
    cand: VictimCandidate, policy: PoolPolicy, capacity_tokens: int, room: int
) -> set[Rung]:
    """The resuming modes the pool allows for this victim (offload: as far as the policy
    and the request can tell; the host tier is the costs' to judge)."""
    modes = policy.scheduling.preemption_modes
    if not resumable_anywhere(cand, capacity_tokens, policy.kv):
        return set()
    possible = set()
    has_room = continuation_tokens(cand, policy.kv) <= room
    if has_room and cand.migratable and PreemptionMode.MIGRATE in modes:
        possible.add(Rung.MIGRATE)
    if cand.recomputable and PreemptionMode.RECOMPUTE in modes:
        possible.add(Rung.RECOMPUTE)
    if cand.recomputable and PreemptionMode.OFFLOAD in modes:
        possible.add(Rung.OFFLOAD)
    return possible


def mode_costs(
    cand: VictimCandidate,
    possible: set[Rung],
    costs: ReliefCosts,
    wait_here_s: float,
    host_room: int,
) -> ModeCosts:
    """The victim's three costs. In place (recompute, offload) it first waits
    `wait_here_s` for room here; an offload needs its KV to fit `host_room`; a migration
    hands off and recomputes on the target, which has room."""
    tokens = cand.kv_tokens
    recompute = costs.recompute_s(tokens)
    offload = costs.offload_s(tokens)
    return ModeCosts(
        recompute_s=wait_here_s + recompute if Rung.RECOMPUTE in possible else None,
        offload_s=(
            wait_here_s + offload
            if Rung.OFFLOAD in possible and offload is not None and tokens <= host_room
            else None
        ),
        migrate_s=costs.migrate_handoff_s + recompute if Rung.MIGRATE in possible else None,
    )


def wait_here_s(
    cand: VictimCandidate, running: Sequence[VictimCandidate], kv: KVPolicy, decode_step_s: float
) -> float:
    """Seconds until this endpoint has room to take the victim's continuation back: until
    the other running requests that finish soonest have released as much KV as it
    needs (all of them, if they never do)."""
    need = continuation_tokens(cand, kv)
    freed = steps = 0
    for other in sorted(running, key=lambda c: c.predicted_remaining):
        if other.rid == cand.rid:
            continue
        freed += other.kv_tokens + other.reserved_growth_tokens
        steps = other.predicted_remaining
        if freed >= need:
            break
    return steps * decode_step_s


def continuation_tokens(cand: VictimCandidate, kv: KVPolicy) -> int:
    """What the victim's continuation asks of an endpoint's admission: its prompt and
    output so far, plus the growth it reserves."""
    outlook = SequenceOutlook(
        cand.generated_tokens, cand.max_new_tokens, cand.predicted_total_tokens
    )
    return cand.kv_tokens + growth_reserve(outlook, kv.growth_horizon_steps)


def resumable_anywhere(cand: VictimCandidate, capacity_tokens: int, kv: KVPolicy) -> bool:
    """Whether the victim's continuation can be admitted by an endpoint of the pool. The
    pool's endpoints are alike, so that is whether this one would admit it when empty: a
    victim for which it is not must not be preempted, or no endpoint could resume it."""
    return continuation_tokens(cand, kv) <= capacity_tokens - kv.safety_tokens(capacity_tokens)


def peer_rooms(peers: Iterable[EndpointState], kv: KVPolicy) -> dict[str, int]:
    """The largest continuation each other endpoint of the pool would admit now, by id,
    from what they last published (`endpoint_headroom_tokens`); `peers`: the others the
    router may send to (lease valid, same role), of which the ready ones count."""
    return {
        s.endpoint_id: endpoint_headroom_tokens(
            s.kv_capacity_tokens, s.kv_used_tokens + s.kv_reserved_growth_tokens, s.watermark, kv
        )
        for s in peers
        if s.lifecycle is Lifecycle.READY
    }


class TargetRooms:
    """The room a relief pass counts on at each peer, corrected as targets answer: a grant
    takes the continuation's tokens, a refusal leaves what the target said it has. The
    live sidecar and the simulator walk a plan's migrations through it alike: pick the
    target (`pick`), ask it to hold the room, tell the answer (`answered`), and on a
    refusal pick again, until one grants or none fits (the victim's `fallback`)."""

    def __init__(self, rooms: Mapping[str, int]) -> None:
        self._rooms = dict(rooms)

    def pick(self, tokens: int) -> str | None:
        return pick_target(tokens, self._rooms)

    def answered(self, target: str, tokens: int, granted: bool, room: int) -> None:
        """`target` granted `tokens` or refused them, saying it has `room` (0: unknown)."""
        self._rooms[target] = self._rooms[target] - tokens if granted else min(room, tokens - 1)


def plan_relief(
    usage: KVUsage,
    watermark: WatermarkState,
    candidates: Sequence[VictimCandidate],
    policy: PoolPolicy,
    now: float,
    rooms: Mapping[str, int] = _NO_PEERS,
    costs: ReliefCosts | None = None,
) -> ReliefPlan:
    """The rungs to apply and, when exhausted, the victims to preempt, best victim first.
    A candidate whose continuation no endpoint could admit is never migrated, offloaded
    or recomputed (only terminated, where the pool allows that). A victim migrates only
    to a peer with room for its continuation (`rooms`, see `peer_rooms`; none known: no
    migration), which it names (`pick_target`), each migration planned taking its share
    of that peer's room: a move to a full endpoint would only wait there. With `costs`,
    each victim takes its cheapest possible mode (`mode_costs`), each offload taking its
    share of the host room."""
    kv = policy.kv
    near_done_tokens = max(1, kv.growth_horizon_steps // 8)
    rungs: list[Rung] = []
    if watermark.rank >= WatermarkState.CRITICAL.rank:
        rungs += [Rung.PAUSE_ADMISSION, Rung.FAVOUR_NEAR_DONE]
    target = int(kv.high_watermark * usage.capacity_tokens)
    needed = usage.committed_tokens - target if watermark is WatermarkState.EXHAUSTED else 0
    if needed <= 0 or not candidates:
        return ReliefPlan(watermark, tuple(rungs), (), max(0, needed))
    cap = policy.scheduling.max_preemptions_per_request
    scale = max(c.kv_tokens + c.reserved_growth_tokens for c in candidates)
    span = (min(c.priority for c in candidates), max(c.priority for c in candidates))
    scored = sorted(
        (
            (score_victim(c, now, near_done_tokens, scale, span, cap), c)
            for c in candidates
            if c.preemptions < cap
        ),
        key=lambda sc: (-sc[0].total, sc[1].rid),
    )
    victims: list[VictimChoice] = []
    freed = 0
    host_room = 0 if costs is None else costs.host_room_tokens
    targets = TargetRooms(rooms)
    capacity = usage.capacity_tokens
    for score, cand in scored:
        if freed >= needed:
            break
        tokens = continuation_tokens(cand, kv)
        peer = targets.pick(tokens) or ""
        room = tokens if peer else 0  # what _possible needs to know: whether one fits
        priced = None
        if costs is not None:
            possible = _possible(cand, policy, capacity, room)
            wait = wait_here_s(cand, candidates, kv, costs.decode_step_s)
            priced = mode_costs(cand, possible, costs, wait, host_room)
            score = dataclasses.replace(score, costs=priced)
        mode = _mode(cand, policy, capacity, room, priced)
        if mode is None:
            continue
        choice = VictimChoice(cand.rid, mode, score)
        if mode is Rung.MIGRATE:
            targets.answered(peer, tokens, True, 0)
            in_place = None if priced is None else dataclasses.replace(priced, migrate_s=None)
            fallback = _mode(cand, policy, capacity, 0, in_place)
            choice = dataclasses.replace(choice, target=peer, tokens=tokens, fallback=fallback)
        if mode is Rung.OFFLOAD:
            host_room -= cand.kv_tokens
        victims.append(choice)
        freed += score.kv_freed_tokens
    ordered = [
        r
        for r in (Rung.MIGRATE, Rung.OFFLOAD, Rung.RECOMPUTE, Rung.TERMINATE)
        if any(v.mode is r for v in victims)
    ]
    ranked = tuple((cand.rid, score) for score, cand in scored)
    return ReliefPlan(watermark, (*rungs, *ordered), tuple(victims), needed, ranked)
