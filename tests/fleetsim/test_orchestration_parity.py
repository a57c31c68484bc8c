"""The simulator runs the sidecar's shipped admission discipline: one scripted sequence of
arrivals (new, resumed, too large, over a full queue) and endings, fed to the live
ledger (its clock injected) and to the simulator's sidecar glue, gives the same
decisions in the same order (`AdmissionQueue`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from controlplane.contract import (
    EngineAPI,
    FinishReason,
    KVPolicy,
    PoolPolicy,
    SchedulingPolicy,
)
from engine_sidecar.intake import Limits, parse
from engine_sidecar.ledger import Flight as LiveFlight
from engine_sidecar.ledger import Ledger, OverloadError
from engine_sidecar.policy import RequestRecord, RequestState
from fleetsim.sim.flight import Flight, Stage
from fleetsim.sim.gate import RouterGate
from fleetsim.sim.weir import Sidecar, WeirPolicy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec

CAPACITY = 1000
POLICY = PoolPolicy(
    pool="p",
    model="m",
    kv=KVPolicy(growth_horizon_steps=16),
    scheduling=SchedulingPolicy(local_queue_size=3, local_queue_max_wait_s=30.0),
)


@dataclass(frozen=True)
class Arrive:
    at: float
    rid: str
    prompt: int
    priority: int = 0
    resumed: int = 0  # tokens it generated elsewhere before (a continuation)
    max_new: int = 400


@dataclass(frozen=True)
class End:
    at: float
    rid: str


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
)


async def _live(script: tuple[Arrive | End, ...]) -> list[tuple[str, str]]:
    now = [0.0]
    decisions: list[tuple[str, str]] = []

    class Recorded(Ledger):
        def _commit(self, flight: LiveFlight) -> None:
            decisions.append(("admit", flight.rid))
            super()._commit(flight)

    ledger = Recorded(POLICY, CAPACITY, clock=lambda: now[0])
    flights: dict[str, LiveFlight] = {}
    waiters = []

    async def admit(flight: LiveFlight) -> None:
        try:
            await ledger.admit(flight)
        except OverloadError:
            decisions.append(("refuse", flight.rid))

    for event in script:
        now[0] = event.at
        if isinstance(event, Arrive):
            prompt = event.prompt + event.resumed
            intake = parse(
                EngineAPI.GENERATE,
                {"input_ids": [1] * prompt, "sampling_params": {"max_new_tokens": event.max_new}},
                Limits("m", 100_000),
            )
            record = RequestRecord(
                rid=event.rid, tenant="t", model="m", prompt_tokens=prompt,
                max_new_tokens=event.max_new - event.resumed, arrived_at=event.at,
                state_since=event.at, priority=event.priority,
            )  # fmt: skip
            flight = flights[event.rid] = LiveFlight(
                intake, record, event.at, resumed=bool(event.resumed)
            )
            ledger.add(flight)
            waiters.append(asyncio.create_task(admit(flight)))
        else:
            flight = flights[event.rid]
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


class _Sim:
    """The few calls the simulator's sidecar glue makes on its simulation."""

    def __init__(self, policy: WeirPolicy) -> None:
        self.policy = policy
        self.now = 0.0
        self.engines = [_Slot()]
        self.decisions: list[tuple[str, str]] = []

    def submit(self, flight: Flight, engine: int, now: float, priority: int = 0) -> bool:
        self.decisions.append(("admit", flight.rid))
        flight.stage = Stage.ENGINE
        return True

    def end(self, flight: Flight, reason: FinishReason, now: float, detail: str = "") -> None:
        if reason is FinishReason.OVERLOAD:
            self.decisions.append(("refuse", flight.rid))
        flight.stage, flight.reason = Stage.DONE, reason
        self.policy.ended(flight, now)


def _simulated(script: tuple[Arrive | End, ...]) -> list[tuple[str, str]]:
    weir = WeirPolicy(POLICY)
    sim = _Sim(weir)
    weir._sim = sim  # type: ignore[assignment]
    weir._gate = RouterGate(POLICY, kv_bytes_per_token=1, credits=False)
    sidecar = Sidecar(0, "engine-0", CAPACITY, POLICY, lambda: sim.now)
    weir.sidecars = [sidecar]
    flights: dict[str, Flight] = {}
    for event in script:
        sim.now = event.at
        if isinstance(event, Arrive):
            spec = RequestSpec(
                request_id=event.rid, arrival_s=event.at, tenant="t", priority=event.priority,
                input_tokens=event.prompt, output_tokens=event.max_new,
                max_tokens=event.max_new,
                block_ids=tuple(range(-(-event.prompt // BLOCK_TOKENS))),
            )  # fmt: skip
            flight = flights[event.rid] = Flight(spec, output_ids=[7] * event.resumed)
            weir._offer(sidecar, flight, event.at)
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
    # long one that had not waited long, the class order, and a resume holding the line.
    assert ("refuse", "i") in live
    assert ("refuse", "h") in live
    admitted = [rid for verdict, rid in live if verdict == "admit"]
    assert admitted == ["a", "b", "d", "e", "c", "g", "f"]
