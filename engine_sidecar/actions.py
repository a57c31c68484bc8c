"""The sidecar's actions on its requests: preempting one (recompute, offload, migrate or
terminate), the relief ladder's pass over all of them, the control plane's commands, and
draining the endpoint.

An action marks a request and aborts its engine segment; what follows is the request's own
(`engine_sidecar.segments`): it resumes, is handed back, or ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from controlplane.contract import Command, CommandKind, EndpointState, RoomReservation
from controlplane.trace.trail import request_id_of
from engine_sidecar.ledger import Flight, Preemption
from engine_sidecar.policy import (
    RESERVATION_TTL_S,
    ReliefCosts,
    RequestState,
    Rung,
    TargetRooms,
    continuation_tokens,
    peer_rooms,
    plan_relief,
)
from engine_sidecar.segments import Segments

if TYPE_CHECKING:
    from engine_sidecar.service import SidecarService

log = logging.getLogger("weir.sidecar")
_S = RequestState


class PeerLink(Protocol):
    """The pool's other endpoints, as a migration needs them (the control-plane link)."""

    async def peers(self) -> list[EndpointState]: ...

    async def reserve(
        self, peer: EndpointState, asked: RoomReservation
    ) -> tuple[RoomReservation | None, int]:
        """Ask `peer` to hold room (a `RoomReservation` without id): the grant, or None
        and the room the peer says it has (0 when it did not answer)."""


class Actions:
    """What the sidecar does to its requests, on its own (relief), when the control plane
    commands it, or when an admin orders it (`/weir/v1/preempt`, `/weir/v1/drain`)."""

    def __init__(self, service: SidecarService, segments: Segments) -> None:
        self._service = service  # what changes while it runs: draining, on_drain
        self._segments = segments
        self.ledger = service.ledger
        self.policy = service.policy
        self.link: PeerLink | None = None  # the control-plane link, once there is one

    def begin_preempt(self, rid: str, mode: Preemption, why: str) -> Flight | None:
        """Mark a decoding request for preemption (recompute, offload, migrate or
        terminate) for the reason `why` (recorded); the engine abort follows. None when it
        is not decoding, already being preempted, over its preemption cap, or the mode is
        not allowed for it."""
        flight = self.ledger.flights.get(rid)
        if flight is None or not self._may_preempt(flight, mode):
            return None
        flight.preempt_mode = mode
        self._segments.note(
            flight, "preempt", mode=mode, why=why, generated_tokens=flight.record.generated_tokens
        )
        return flight

    def _may_preempt(self, flight: Flight, mode: Preemption) -> bool:
        rec = flight.record
        if flight.preempt_mode or rec.state is not _S.DECODING:
            return False
        if mode is Preemption.MIGRATE and not rec.migratable:
            return False
        if mode is Preemption.RECOMPUTE and not (rec.recomputable and self._service.may_recompute):
            return False
        if mode is Preemption.OFFLOAD and not (rec.recomputable and self._service.may_offload):
            return False
        return mode is Preemption.TERMINATE or self._segments.resumable(flight)

    async def preempt(self, rid: str, mode: Preemption, why: str) -> bool:
        if mode is Preemption.MIGRATE:
            return rid in await self.migrate([rid], why)
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
            return await self._preempt_best([command.request_id])
        if kind is CommandKind.PREEMPT_TENANT:
            rids = [r for r, f in self.ledger.flights.items() if f.record.tenant == command.tenant]
            return await self._preempt_best(rids)
        if kind is CommandKind.SET_PRIORITY:
            flight = self.ledger.flights.get(command.request_id)
            if flight is None:
                return False
            flight.record = replace(flight.record, priority=command.priority)
            return True
        return False  # type: ignore[unreachable]  # a newer contract's command kind

    async def _preempt_best(self, rids: Sequence[str]) -> bool:
        """Migrate those that can move, else recompute in place; whether any was."""
        why = "ordered by the control plane"
        moved = await self.migrate(rids, why)
        done = [rid in moved or await self.preempt(rid, Preemption.RECOMPUTE, why) for rid in rids]
        return any(done)

    async def migrate(self, rids: Sequence[str], why: str) -> set[str]:
        """Migrate these requests, as ordered (a command, a drain): those that can move
        are handed back, and the ones it migrated are returned. With a control-plane link
        each first gets room held at a peer that has it, as relief's migrations do, so
        that a drain's continuations spread by room instead of all waiting at whichever
        endpoint the routers see as best; one no peer holds room for still moves (it was
        ordered to) and the router places it."""
        link = self.link
        movable = [
            flight
            for rid in rids
            if (flight := self.ledger.flights.get(rid)) is not None
            and self._may_preempt(flight, Preemption.MIGRATE)
        ]
        if not movable:
            return set()
        peers = await link.peers() if link is not None else []
        targets = TargetRooms(peer_rooms(peers, self.policy.kv))
        by_id = {peer.endpoint_id: peer for peer in peers}
        moved = set()
        for flight in movable:
            held: tuple[str, str] | None = None
            where = ""
            cand = self.ledger.candidate(flight.rid)
            if link is not None and cand is not None:
                tokens = continuation_tokens(cand, self.policy.kv)
                held = await self._reserve_target(flight.rid, tokens, targets, by_id, link)
                if held is not None:  # worded as relief's are
                    where = f"; {held[0]} holds {tokens} tokens for it ({held[1]})"
            if self.begin_preempt(flight.rid, Preemption.MIGRATE, why + where) is None:
                continue  # it ended meanwhile; a hold left behind expires
            flight.target, flight.target_reservation = held or ("", "")
            await self._segments.abort_engine(flight)
            moved.add(flight.rid)
        return moved

    async def relieve(self, peers: Sequence[EndpointState] = ()) -> list[str]:
        """One pass of the relief ladder; starts preemptions and returns explanations.
        `peers`: the other endpoints a continuation may migrate to (lease valid, same
        role), as last published, of which the control-plane link (`link`) asks one to hold
        room. Without them (no control plane) nothing migrates. A migrating victim is aborted only once its
        target holds room for it; when none does, it takes its fallback."""
        ledger = self.ledger
        link = self.link
        rooms = peer_rooms(peers, self.policy.kv) if link is not None else {}
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
                assert link is not None  # no rooms, no migration
                held = await self._reserve_target(victim.rid, victim.tokens, targets, by_id, link)
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
        rid: str,
        tokens: int,
        targets: TargetRooms,
        peers: dict[str, EndpointState],
        link: PeerLink,
    ) -> tuple[str, str] | None:
        """(target, reservation id) of the first peer, in `targets`' order, that holds
        `tokens` for `rid`'s continuation; None when none does."""
        asked = RoomReservation(
            request_id=request_id_of(rid), tokens=tokens, ttl_s=RESERVATION_TTL_S
        )
        while (target := targets.pick(tokens)) is not None:
            granted, room = await link.reserve(peers[target], asked)
            targets.answered(target, tokens, granted is not None, room)
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
        left = dict(self.ledger.flights)
        moved = await self.migrate(list(left), "drain")
        for rid, flight in left.items():
            if rid not in moved and not await self.preempt(
                rid, Preemption.TERMINATE, "drain deadline"
            ):
                await self._segments.abort_engine(flight)  # not decoding: ended as it stands
        migrated, aborted = len(moved), len(left) - len(moved)
        await self.ledger.wait_idle(10.0)
        return {
            "in_flight": before,
            "finished": before - migrated - aborted,
            "migrated": migrated,
            "aborted": aborted,
        }
