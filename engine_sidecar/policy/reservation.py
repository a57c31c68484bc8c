"""Room held at a migration target: a relief migration moves only into room taken first.

Before a sidecar aborts a victim to migrate it, it picks a concrete target (`pick_target`:
the peer with the most room that fits the continuation) and asks that target to hold room
for the continuation's KV. The target grants it only if its own admission would take the
continuation now (`reservable_tokens`: the headroom its state allows, as `peer_room` reads it from
what a peer publishes) and then counts the held tokens as committed, so that nothing else
is admitted into them. The continuation names the target and the reservation; the router
prefers that target, and the target's admission consumes the reservation when the
continuation arrives: it is admitted into the room held for it, ahead of anything waiting,
whatever the watermark says (the room was counted when it was granted). A reservation
that is not consumed within its time to live expires and frees its room: a lost hand-back
never strands capacity.

Two sidecars that read the same published room race for it here, at the target, which
decides one grant at a time: exactly one gets it, the other tries its next target or
resumes its victim in place.

Pure and clock-free: `Reservations` is the target's book (every call is given `now`), the
one the live ledger and the simulator's sidecar both keep.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from controlplane.contract import KVPolicy, WatermarkState
from controlplane.rules.credits import endpoint_headroom_tokens
from engine_sidecar.policy.watermark import KVUsage

# How long a target holds room for a continuation that has not arrived. A hand-back
# takes an engine abort and two hops through the router (milliseconds); this covers a
# router that is slow to place it, and bounds what a lost one costs the target.
RESERVATION_TTL_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """Room held at this endpoint for one request's continuation, until `expires_at`."""

    reservation_id: str
    request_id: str
    tokens: int
    expires_at: float


def pick_target(tokens: int, rooms: Mapping[str, int]) -> str | None:
    """The peer to migrate a continuation of `tokens` to: the one with the most room that
    fits it (ties by id, so every caller picks alike), None when none fits."""
    fitting = [(room, endpoint_id) for endpoint_id, room in rooms.items() if room >= tokens]
    if not fitting:
        return None
    return min(fitting, key=lambda fit: (-fit[0], fit[1]))[1]


def reservable_tokens(
    usage: KVUsage, watermark: WatermarkState, admission_open: bool, kv: KVPolicy
) -> int:
    """The largest continuation an endpoint holds room for now: none while its admission
    is closed, else the room it would admit (`endpoint_headroom_tokens` over `usage`,
    which counts the room it already holds). A request for more is refused."""
    if not admission_open:
        return 0
    return endpoint_headroom_tokens(usage.capacity_tokens, usage.committed_tokens, watermark, kv)


class Reservations:
    """One endpoint's reservations. Ids are `prefix` plus a counter: the prefix tells this
    book from an earlier one of the same endpoint (a restarted sidecar), and a
    consumption must name the request too."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._held: dict[str, Reservation] = {}
        self.held_tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def take(self, request_id: str, tokens: int, now: float, ttl_s: float) -> Reservation:
        """Hold `tokens` for `request_id` until `now + ttl_s` (within `reservable_tokens`)."""
        reservation = Reservation(
            f"{self._prefix}-{next(self._ids)}", request_id, tokens, now + ttl_s
        )
        self._held[reservation.reservation_id] = reservation
        self.held_tokens += tokens
        return reservation

    def consume(self, reservation_id: str, request_id: str) -> Reservation | None:
        """The continuation arrived: its reservation (None when it is unknown here, already
        expired, or another request's) stops holding room, which its admission now takes.
        Expire first: a reservation past its time is not consumed."""
        reservation = self._held.get(reservation_id)
        if reservation is None or reservation.request_id != request_id:
            return None
        self._drop(reservation)
        return reservation

    def expire(self, now: float) -> list[Reservation]:
        """Take out the reservations whose time is up (at `now` or before)."""
        gone = [r for r in self._held.values() if r.expires_at <= now]
        for reservation in gone:
            self._drop(reservation)
        return gone

    def next_expiry(self) -> float | None:
        return min((r.expires_at for r in self._held.values()), default=None)

    def _drop(self, reservation: Reservation) -> None:
        del self._held[reservation.reservation_id]
        self.held_tokens -= reservation.tokens
