"""The simulator runs the sidecar's shipped admission discipline: one scripted sequence of
arrivals (new, resumed, too large, over a full queue), room held for a migration and
endings, fed to the live ledger (its clock injected) and to the simulator's sidecar glue,
gives the same decisions in the same order (`AdmissionQueue`, `Reservations`,
`queued_request`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from controlplane.contract import (
    EngineAPI,
    FinishReason,
    KVPolicy,
    PoolPolicy,
    RoutingPolicy,
    SchedulingPolicy,
    TenantQuota,
)
from engine_sidecar.intake import IntakeLimits, parse_intake
from engine_sidecar.ledger import Flight, Ledger, OverloadError
from engine_sidecar.policy import (
    RESERVATION_TTL_S,
    QueuedRequest,
    RequestRecord,
    RequestState,
    Rung,
    TargetRooms,
    VictimChoice,
    VictimScore,
)
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.sim.gate import RouterGate
from fleetsim.sim.weir import Sidecar, WeirPolicy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec

CAPACITY = 1000
POLICY = PoolPolicy(
    pool="p",
    model="m",
    kv=KVPolicy(growth_horizon_steps=16),
    scheduling=SchedulingPolicy(local_queue_size=3, local_queue_max_wait_s=30.0),
    routing=RoutingPolicy(resume_wait_s=30.0),  # how long a resume may wait, here too
    tenants=(TenantQuota(name="t"), TenantQuota(name="u"), TenantQuota(name="v", weight=2.0)),
)


@dataclass(frozen=True)
class Arrive:
    at: float
    rid: str
    prompt: int
    priority: int = 0
    resumed: int = 0  # tokens it generated elsewhere before (a continuation)
    max_new: int = 400
    held: bool = False  # room was held here for it (a migration's reservation)
    first_arrival: float | None = None  # a continuation's client arrived then
    tenant: str = "t"


@dataclass(frozen=True)
class End:
    at: float
    rid: str


@dataclass(frozen=True)
class FirstToken:
    """`rid`'s engine streams its first token: its prefill is no longer pending."""

    at: float
    rid: str


@dataclass(frozen=True)
class Hold:
    """Another sidecar's relief asks this one to hold room for `rid`'s continuation."""

    at: float
    rid: str
    tokens: int


SCRIPT = (
    Arrive(0.0, "a", 500),
    Arrive(0.0, "b", 300),
    Arrive(1.0, "c", 400),  # does not fit: waits
    Arrive(2.0, "d", 50),  # fits: passes c, which has not waited long
    Arrive(3.0, "e", 200, priority=5),  # waits, ahead of c by its class
    Arrive(3.5, "f", 60),  # waits: the queue is full now
    Arrive(4.0, "g", 300, resumed=40),  # full, but a resume joins, and holds the line
    Arrive(4.2, "i", 60),  # full: refused
    Arrive(4.5, "h", 5000),  # can never fit: refused
    End(5.0, "a"),  # e fits; so would f, but g holds the line
    End(6.0, "b"),
    End(7.0, "e"),
    End(8.0, "g"),
    # c, d, f hold 510 + 48 of growth: 392 free. Room held for m leaves 92.
    Hold(10.0, "m", 300),
    Arrive(11.0, "m", 250, resumed=40, held=True),  # takes its room at once
    # Handed back long after its client arrived: it waits the pool's resume wait (30 s)
    # from now, not from then.
    Arrive(11.5, "k", 300, resumed=10, first_arrival=-500.0),
    Arrive(12.0, "n", 50),  # waits behind k, which holds the line
    End(41.6, "c"),  # k's wait ended at 41.5; n's has not: n goes in
    *(End(50.0, rid) for rid in "dfmn"),
    # Tenants: u0 is charged the KV it is expected to pin (950 tokens for 4 s), u1 and
    # u2 wait behind it, v1 joins them lifted to u's counter. u0 ends after 6 s, which
    # settles u's charge to the 750 tokens it pinned for 6 s: v1 goes first.
    Arrive(51.0, "u0", 750, tenant="u"),
    Arrive(52.0, "u1", 200, tenant="u"),
    Arrive(52.1, "u2", 200, tenant="u"),
    Arrive(52.2, "v1", 200, tenant="v"),
    End(57.0, "u0"),
)


Event = Arrive | End | Hold | FirstToken


async def _live(script: tuple[Event, ...], policy: PoolPolicy = POLICY) -> list[tuple[str, str]]:
    now = [0.0]
    decisions: list[tuple[str, str]] = []

    class Recorded(Ledger):
        def _commit(self, flight: Flight) -> None:
            decisions.append(("admit", flight.rid))
            super()._commit(flight)

        def _wait_over(self, queued: QueuedRequest, waiter: asyncio.Future[None]) -> None:
            decisions.append(("refuse", queued.rid))  # when decided, not when its task ran
            super()._wait_over(queued, waiter)

    ledger = Recorded(policy, CAPACITY, clock=lambda: now[0])
    flights: dict[str, Flight] = {}
    held: dict[str, str] = {}
    waiters = []

    async def admit(flight: Flight) -> None:
        try:
            await ledger.admit(flight)
        except OverloadError as exc:
            if exc.reason != "queue_timeout":  # recorded when its wait ended
                decisions.append(("refuse", flight.rid))

    for event in script:
        now[0] = event.at
        if isinstance(event, Arrive):
            prompt = event.prompt + event.resumed
            intake = parse_intake(
                EngineAPI.GENERATE,
                {"input_ids": [1] * prompt, "sampling_params": {"max_new_tokens": event.max_new}},
                IntakeLimits("m", 100_000),
            )
            record = RequestRecord(
                rid=event.rid, tenant=event.tenant, model="m", prompt_tokens=prompt,
                max_new_tokens=event.max_new - event.resumed, arrived_at=event.at,
                state_since=event.at, priority=event.priority,
            )  # fmt: skip
            flight = flights[event.rid] = Flight(
                intake, record, event.at, resumed=bool(event.resumed),
                reservation=held.get(event.rid, "") if event.held else "",
            )  # fmt: skip
            ledger.add(flight)
            waiters.append(asyncio.create_task(admit(flight)))
        elif isinstance(event, Hold):
            reservation = ledger.reserve(event.rid, event.tokens, RESERVATION_TTL_S)
            assert reservation is not None
            held[event.rid] = reservation.reservation_id
        elif isinstance(event, FirstToken):
            flight = flights[event.rid]
            ledger.move(flight, RequestState.PREFILL_RUNNING)
            ledger.add_tokens(flight, 1)
            ledger.move(flight, RequestState.DECODE_READY)
        else:
            flight = flights[event.rid]
            if flight.record.state is RequestState.PREFILL_READY:
                ledger.move(flight, RequestState.PREFILL_RUNNING)
            ledger.move(flight, RequestState.CANCELLED, FinishReason.CANCELLED)
        for _ in range(5):
            await asyncio.sleep(0)
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return decisions


class _Slot:
    alive = True


_SCORE = VictimScore(0, 0.0, 0, 0, 0, None, 0, False, 0.0)  # how it was chosen: no matter


class _Sim:
    """The few calls the simulator's sidecar glue makes on its simulation."""

    def __init__(self, policy: WeirPolicy) -> None:
        self.policy = policy
        self.now = 0.0
        self.engines = [_Slot()]
        self.decisions: list[tuple[str, str]] = []

    def submit(self, flight: SimFlight, engine: int, now: float, priority: int = 0) -> bool:
        self.decisions.append(("admit", flight.rid))
        flight.stage = Stage.ENGINE
        return True

    def heartbeat(self, sidecar: Sidecar, now: float) -> None:
        """What the glue publishes has no bearing on its sidecar's own decisions."""

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Timers (a reservation's expiry) are not needed: nothing expires here."""

    def interrupt(self, engine: int) -> None:
        """No engine iterations run here to fast-forward."""

    def end(self, flight: SimFlight, reason: FinishReason, now: float, detail: str = "") -> None:
        if reason is FinishReason.OVERLOAD:
            self.decisions.append(("refuse", flight.rid))
        flight.stage, flight.reason = Stage.DONE, reason
        self.policy.ended(flight, now)


class _Glue(WeirPolicy):
    def _heartbeat(self, sidecar: Sidecar, now: float, registered: bool = False) -> None:
        pass  # nothing routes here: what is published does not matter

    def _wait_over(self, flight: SimFlight, now: float) -> None:
        # The sidecar refuses it; where it goes next (its client, or back to its router)
        # is the router's side, which tests/fleetsim/test_dispatch_parity.py holds.
        self.sim.end(flight, FinishReason.OVERLOAD, now, "waited as long as it may")


def _simulated(script: tuple[Event, ...], policy: PoolPolicy = POLICY) -> list[tuple[str, str]]:
    weir = _Glue(policy)
    sim = _Sim(weir)
    weir._sim = sim  # type: ignore[assignment]
    weir._gate = RouterGate(policy, kv_bytes_per_token=1, credits=False)
    sidecar = Sidecar(0, "engine-0", CAPACITY, policy, lambda: sim.now)
    weir.sidecars = [sidecar]
    flights: dict[str, SimFlight] = {}
    held: dict[str, str] = {}
    for event in script:
        sim.now = event.at
        if isinstance(event, Arrive):
            arrival = event.at if event.first_arrival is None else event.first_arrival
            spec = RequestSpec(
                request_id=event.rid, arrival_s=arrival, tenant=event.tenant,
                priority=event.priority,
                input_tokens=event.prompt, output_tokens=event.max_new,
                max_tokens=event.max_new,
                block_ids=tuple(range(-(-event.prompt // BLOCK_TOKENS))),
            )  # fmt: skip
            flight = flights[event.rid] = SimFlight(spec, generated=event.resumed)
            if event.held:
                flight.target, flight.reservation = sidecar.endpoint_id, held[event.rid]
            weir._offer(sidecar, flight, event.at)
        elif isinstance(event, Hold):
            migration = VictimChoice(event.rid, Rung.MIGRATE, _SCORE, "engine-0", event.tokens)
            taken = weir._reserve_target(migration, TargetRooms({"engine-0": CAPACITY}), event.at)
            assert taken is not None
            held[event.rid] = taken[1]
        elif isinstance(event, FirstToken):
            flights[event.rid].generated += 1
            weir._admit(sidecar, event.at)  # at its engine's next iteration
        else:
            flight = flights[event.rid]
            flight.stage, flight.reason = Stage.DONE, FinishReason.CANCELLED
            weir.ended(flight, event.at)
            weir._admit(sidecar, event.at)
    return sim.decisions


async def test_the_simulator_admits_as_the_live_sidecar_does() -> None:
    live = await _live(SCRIPT)
    assert live == _simulated(SCRIPT)
    # The script exercises what it claims to: both refusals, a short request passing a
    # long one that had not waited long, the class order, a resume holding the line, a
    # continuation taking the room held for it, one whose wait ran out, and a tenant
    # served less going ahead of one served more.
    assert ("refuse", "i") in live
    assert ("refuse", "h") in live
    assert ("refuse", "k") in live
    admitted = [rid for verdict, rid in live if verdict == "admit"]
    assert admitted == ["a", "b", "d", "e", "c", "g", "f", "m", "n", "u0", "v1", "u1", "u2"]


# The untrained latency model predicts its prior TPOT (20 ms) under any load: an
# objective of 10 ms keeps the gate shut while any prefill admitted here is pending.
GATED = msgspec.structs.replace(
    POLICY,
    scheduling=SchedulingPolicy(local_queue_size=3, local_queue_max_wait_s=2.0, target_tpot_s=0.01),
)
GATED_SCRIPT = (
    Arrive(0.0, "a", 100),  # nothing pending: in
    Arrive(0.1, "b", 100),  # a's prefill pending: waits
    Arrive(0.2, "c", 100),
    FirstToken(0.5, "a"),  # b goes in; c waits for b's first token
    Hold(0.6, "m", 200),
    Arrive(0.7, "m", 150, resumed=10, held=True),  # room held for it: in, gate or not
    FirstToken(3.0, "b"),  # c has waited 2.8 s of its 2: refused; m is pending still
    Arrive(3.1, "d", 100),  # waits for m
    FirstToken(3.2, "m"),  # d goes in
    *(End(4.0, rid) for rid in "abmd"),
)


async def test_the_tpot_gate_admits_one_prefill_at_a_time_alike_live_and_simulated() -> None:
    live = await _live(GATED_SCRIPT, GATED)
    assert live == _simulated(GATED_SCRIPT, GATED)
    assert live == [("admit", "a"), ("admit", "b"), ("admit", "m"), ("refuse", "c"),
                    ("admit", "d")]  # fmt: skip
    # No objective, no gate: the same arrivals all go in as they come.
    ungated = msgspec.structs.replace(
        GATED, scheduling=msgspec.structs.replace(GATED.scheduling, target_tpot_s=0.0)
    )
    assert [rid for _, rid in await _live(GATED_SCRIPT, ungated)] == list("abcmd")
