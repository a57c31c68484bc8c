"""The sidecar's actions on its requests: preempting one (recompute, offload, migrate or
terminate), the relief ladder's pass over all of them, the control plane's commands, and
draining the endpoint.

An action marks a request and aborts its engine segment; what follows is the request's own
(`engine_sidecar.segments`): it resumes, is handed back, or ends.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from controlplane.contract import Command, CommandKind, EndpointState, RoomReservation
from controlplane.trace.trail import request_id_of
from engine_sidecar.ledger import Flight, Preemption
from engine_sidecar.policy import (
    RESERVATION_TTL_S,
    ReliefCosts,
    RequestState,
    Rung,
    TargetRooms,
    VictimChoice,
    peer_rooms,
    plan_relief,
)
from engine_sidecar.segments import Segments

if TYPE_CHECKING:
    from engine_sidecar.service import SidecarService

log = logging.getLogger("weir.sidecar")
_S = RequestState
# Asks `peer` to hold room (a `RoomReservation` without id): the grant, or None and the
# room the peer says it has (0 when it did not answer).
Reserve = Callable[[EndpointState, RoomReservation], Awaitable[tuple[RoomReservation | None, int]]]


class Actions:
    """What the sidecar does to its requests, on its own (relief), when the control plane
    commands it, or when an admin orders it (`/weir/v1/preempt`, `/weir/v1/drain`)."""

    def __init__(self, service: SidecarService, segments: Segments) -> None:
        self._service = service  # what changes while it runs: draining, on_drain
        self._segments = segments
        self.ledger = service.ledger
        self.policy = service.policy

    def begin_preempt(self, rid: str, mode: Preemption, why: str) -> Flight | None:
        """Mark a decoding request for preemption (recompute, offload, migrate or
        terminate) for the reason `why` (recorded); the engine abort follows. None when it
        is not decoding, already being preempted, over its preemption cap, or the mode is
        not allowed for it."""
        flight = self.ledger.flights.get(rid)
        if flight is None or flight.preempt_mode or flight.record.state is not _S.DECODING:
            return None
        rec = flight.record
        if mode is Preemption.MIGRATE and not rec.migratable:
            return None
        if mode is Preemption.RECOMPUTE and not (rec.recomputable and self._service.may_recompute):
            return None
        if mode is Preemption.OFFLOAD and not (rec.recomputable and self._service.may_offload):
            return None
        if mode is not Preemption.TERMINATE and not self._segments.resumable(flight):
            return None
        flight.preempt_mode = mode
        self._segments.note(
            flight, "preempt", mode=mode, why=why, generated_tokens=rec.generated_tokens
        )
        return flight

    async def preempt(self, rid: str, mode: Preemption, why: str) -> bool:
        flight = self.begin_preempt(rid, mode, why)
        if flight is None:
            return False
        await self._segments.abort_engine(flight)
        return True

    async def execute(self, command: Command) -> bool:
        """Carry out a control-plane command; False when it did not apply."""
        kind = command.kind
        if kind is CommandKind.DRAIN:
            self._segments.spawn(self.drain(command.deadline_s or 30.0))
            return True
        if kind in (CommandKind.PAUSE_ADMISSION, CommandKind.RESUME_ADMISSION):
            self.ledger.set_admission(kind is CommandKind.RESUME_ADMISSION)
            return True
        if kind is CommandKind.PREEMPT_REQUEST:
            return await self._preempt_best(command.request_id)
        if kind is CommandKind.PREEMPT_TENANT:
            rids = [r for r, f in self.ledger.flights.items() if f.record.tenant == command.tenant]
            done = [await self._preempt_best(rid) for rid in rids]
            return any(done)
        if kind is CommandKind.SET_PRIORITY:
            flight = self.ledger.flights.get(command.request_id)
            if flight is None:
                return False
            flight.record = replace(flight.record, priority=command.priority)
            return True
        return False  # type: ignore[unreachable]  # a newer contract's command kind

    async def _preempt_best(self, rid: str) -> bool:
        """Migrate when the request can move, else recompute in place."""
        why = "ordered by the control plane"
        return await self.preempt(rid, Preemption.MIGRATE, why) or await self.preempt(
            rid, Preemption.RECOMPUTE, why
        )

    async def relieve(
        self, peers: Sequence[EndpointState] = (), reserve: Reserve | None = None
    ) -> list[str]:
        """One pass of the relief ladder; starts preemptions and returns explanations.
        `peers`: the other endpoints a continuation may migrate to (lease valid, same
        role), as last published; `reserve` asks one to hold room. Without them (no
        control plane) nothing migrates. A migrating victim is aborted only once its
        target holds room for it; when none does, it takes its fallback."""
        ledger = self.ledger
        rooms = peer_rooms(peers, self.policy.kv) if reserve is not None else {}
        plan = plan_relief(
            ledger.usage(), ledger.watermark, ledger.candidates(), self.policy, ledger.clock(),
            rooms, self.relief_costs(),
        )  # fmt: skip
        notes = []
        chosen = {victim.rid for victim in plan.victims}
        passed_over = [
            f"{rid}: {score.explain()}" for rid, score in plan.ranked if rid not in chosen
        ]
        targets = TargetRooms(rooms)
        by_id = {peer.endpoint_id: peer for peer in peers}
        for victim in plan.victims:
            mode: Rung | None = victim.mode
            why = (
                f"relief at {plan.watermark} needs {plan.needed_tokens} tokens; "
                f"{victim.score.explain()}; over {len(passed_over)} other(s): "
                + ("; ".join(passed_over[:3]) or "none")
            )
            held: tuple[str, str] | None = None
            if mode is Rung.MIGRATE:
                assert reserve is not None  # no rooms, no migration
                held = await self._reserve_target(victim, targets, by_id, reserve)
                if held is None:
                    mode = victim.fallback
                    why += f"; no peer held {victim.tokens} tokens for it"
                else:
                    why += f"; {held[0]} holds {victim.tokens} tokens for it ({held[1]})"
            if mode is None:
                notes.append(f"{victim.rid} left running: {why}")
                continue
            notes.append(f"{victim.rid} → {mode.value}: {victim.score.explain()}")
            flight = self.begin_preempt(victim.rid, Preemption(mode.value), why)
            if flight is not None:
                flight.target, flight.target_reservation = held or ("", "")
                self._segments.spawn(self._segments.abort_engine(flight))
        for note in notes:
            log.info("relief (%s, needs %d tokens): %s", plan.watermark, plan.needed_tokens, note)
        return notes

    async def _reserve_target(
        self,
        victim: VictimChoice,
        targets: TargetRooms,
        peers: dict[str, EndpointState],
        reserve: Reserve,
    ) -> tuple[str, str] | None:
        """(target, reservation id) of the first peer, in `targets`' order, that holds
        room for the victim's continuation; None when none does."""
        asked = RoomReservation(
            request_id=request_id_of(victim.rid), tokens=victim.tokens, ttl_s=RESERVATION_TTL_S
        )
        while (target := targets.pick(victim.tokens)) is not None:
            granted, room = await reserve(peers[target], asked)
            targets.answered(target, victim.tokens, granted is not None, room)
            if granted is not None:
                return target, granted.reservation_id
        return None

    def relief_costs(self) -> ReliefCosts:
        """The costs relief weighs, with the host room offloads may still claim: the host
        pool less what offloaded requests not yet resumed left there."""
        held = sum(f.offloaded for f in self.ledger.flights.values())
        room = max(0, self._service.host_tier_tokens - held) if self._service.may_offload else 0
        return replace(self._service.costs, host_room_tokens=room)

    async def drain(self, deadline_s: float) -> dict[str, int]:
        """Stop admitting; let in-flight requests finish until the deadline, then migrate
        those that can move and abort the rest. Returns how many ended which way."""
        self._service.draining = True
        self.ledger.set_admission(False)
        before = len(self.ledger.flights)  # now: some may finish while on_drain runs
        if self._service.on_drain is not None:
            await self._service.on_drain()
        await self.ledger.wait_idle(deadline_s)
        migrated = aborted = 0
        for rid, flight in list(self.ledger.flights.items()):
            if flight.record.migratable and await self.preempt(rid, Preemption.MIGRATE, "drain"):
                migrated += 1
            elif await self.preempt(rid, Preemption.TERMINATE, "drain deadline"):
                aborted += 1
            else:
                await self._segments.abort_engine(flight)
                aborted += 1
        await self.ledger.wait_idle(10.0)
        return {
            "in_flight": before,
            "finished": before - migrated - aborted,
            "migrated": migrated,
            "aborted": aborted,
        }
