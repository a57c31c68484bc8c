"""The simulator routes as the live router does: one scripted sequence of arrivals,
endpoint reports, finishes, a preemption handed back and an endpoint failure, fed to the
live router's dispatch glue (its clock injected, a fixed pool view, the upstream played
by the script) and to the simulator's Weir router glue, gives the same decisions in the
same order: where each request is sent, and which are refused, and why.

Both drive `controlplane.routing.Dispatcher`; what this holds equal is the glue around
it: what each side calls it with, when, and what it does with the answers (a refused
connection to a dead endpoint, waits that end on the core's timers)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from redis.asyncio import Redis

from controlplane.contract import (
    Continuation,
    EndpointState,
    EngineAPI,
    FinishReason,
    Lifecycle,
    PoolPolicy,
    Role,
    RoutingPolicy,
    WatermarkState,
    encode_json,
)
from controlplane.ownership import Membership, OwnershipRing
from controlplane.router import ClientRequest, PoolView, Router, RouterConfig, RouterError
from controlplane.router.app import REPORT_LAG_S
from controlplane.router.credits import HandoffGate
from controlplane.router.exchange import Exchange
from controlplane.router.metrics import RouterMetrics
from controlplane.router.pd import Pairing, _Pair
from controlplane.routing import (
    Dispatcher,
    EndpointView,
    Placed,
    PrefixIndex,
    Refusal,
    RouteRequest,
    default_config,
    profile_from_config,
)
from controlplane.store import CreditStore
from controlplane.stream import Splicer
from controlplane.trace.trail import Trail
from fleetsim.sim.config import MODEL, FleetConfig
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.sim.gate import RouterGate
from fleetsim.sim.loop import engine_config_for
from fleetsim.sim.weir import Sidecar, WeirPolicy
from fleetsim.workloads import RequestSpec

ENDPOINTS = 3
LEASE_S = 2.0  # each report renews the endpoint's lease this long
FAILED_AFTER = 10  # tokens streamed when an engine fails
TARGET = "engine-2"  # where a migration's sidecar took room for it
POLICY = PoolPolicy(
    pool="p",
    model=MODEL,
    routing=RoutingPolicy(
        queue_capacity_per_band=2, queue_max_wait_s=5.0, max_attempts=2, resume_wait_s=3.0
    ),
)


@dataclass(frozen=True)
class Report:
    at: float
    endpoint: int
    watermark: WatermarkState = WatermarkState.NORMAL
    running: int = 0
    draining: bool = False


@dataclass(frozen=True)
class Arrive:
    at: float
    rid: str
    tenant: str = "a"
    priority: int = 0
    prompt: int = 200  # under one 512-token block: no prefix index on either side
    deadline_s: float = 0.0


@dataclass(frozen=True)
class Finish:
    at: float
    rid: str
    generated: int


@dataclass(frozen=True)
class Preempt:
    """The endpoint migrated the stream away after `generated` tokens (to `target`, which
    holds room for it, when its relief took some)."""

    at: float
    rid: str
    generated: int
    target: str = ""


@dataclass(frozen=True)
class Fail:
    """The endpoint's engine dies: what streams there breaks, and its connection is
    refused from now on (its lease has not lapsed)."""

    at: float
    endpoint: int


@dataclass(frozen=True)
class Tick:
    at: float


Event = Report | Arrive | Finish | Preempt | Fail | Tick

SCRIPT: tuple[Event, ...] = (
    *(Report(0.0, i) for i in range(ENDPOINTS)),
    Arrive(0.1, "a1"),
    Arrive(0.2, "b1", tenant="b"),
    Arrive(0.3, "a2", priority=1),
    Preempt(0.35, "b1", generated=3, target=TARGET),  # not where routing would send it
    # Every endpoint saturated: new work waits, fairest first, in a bounded queue.
    *(Report(1.0 + i / 100, i, WatermarkState.CRITICAL, running=2) for i in range(ENDPOINTS)),
    Arrive(1.1, "a3"),
    Arrive(1.1, "b2", tenant="b"),
    Arrive(1.15, "a4"),  # the band is full
    Arrive(1.2, "c1", tenant="c", priority=2, deadline_s=0.5),  # its deadline ends its wait
    Report(2.0, 2, running=1),  # room again on engine-2, its last report
    *(Report(2.1, i, WatermarkState.CRITICAL, running=2) for i in range(2)),
    Finish(2.5, "b1", generated=30),
    Preempt(3.0, "a1", generated=20),  # resumed elsewhere, its old endpoint avoided
    Fail(3.5, 2),  # its streams resume elsewhere and never come back; it refuses connections
    Report(3.6, 0, running=2),
    Report(3.6, 1, WatermarkState.CRITICAL, running=2),
    Arrive(3.8, "d1", tenant="d"),  # the dead endpoint looks best, and refuses it
    Arrive(3.85, "d2", tenant="d"),
    *(Report(4.5, i, WatermarkState.CRITICAL, running=4) for i in range(2)),
    Arrive(4.6, "q1", tenant="q"),  # engine-2's lease has lapsed: saturated, it waits
    *(Report(6.0, i, draining=True) for i in range(2)),
    Preempt(6.1, "a2", generated=5),  # nowhere to go: it waits, then is lost
    *(Report(at, i, draining=True) for at in (7.5, 9.0) for i in range(2)),
    *(Report(10.0, i) for i in range(2)),
    Finish(10.5, "a1", generated=60),
    Tick(12.0),
)


def _state(event: Report, version: int, role: Role = Role.MIXED) -> EndpointState:
    return EndpointState(
        pool="p", endpoint_id=f"engine-{event.endpoint}", address=f"sim://{event.endpoint}",
        model=MODEL, version=version, kv_capacity_tokens=10_000, watermark=event.watermark,
        running_requests=event.running, role=role,
        lifecycle=Lifecycle.DRAINING if event.draining else Lifecycle.READY,
    )  # fmt: skip


def _report(weir: WeirPolicy, event: Report, version: int, role: Role) -> None:
    """The endpoint's report reaches the simulator's routers."""
    now = event.at
    weir._publish(event.endpoint, _state(event, version, role), now + LEASE_S, now - REPORT_LAG_S)


def _flight(event: Arrive) -> SimFlight:
    spec = RequestSpec(
        request_id=event.rid, arrival_s=event.at, tenant=event.tenant, priority=event.priority,
        input_tokens=event.prompt, output_tokens=100, max_tokens=100,
        block_ids=(sum(map(ord, event.rid)),),  # its own prefix, its own owners
        deadline_s=event.deadline_s,
    )  # fmt: skip
    return SimFlight(spec)


Decisions = list[tuple[float, str, str]]  # (when, request, endpoint or refusal reason)


# -- the simulator's side ------------------------------------------------------------------


class _Sim:
    """The calls the simulator's router glue makes on its simulation, and its clock."""

    def __init__(self, policy: WeirPolicy) -> None:
        self.config = FleetConfig(engines=ENDPOINTS, policy=POLICY)
        self.engines = [SimpleNamespace(alive=True) for _ in range(ENDPOINTS)]
        self.policy, self.now = policy, 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), action))

    def run_until(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            self.now, _, action = heapq.heappop(self._heap)
            action()
        self.now = until

    def end(self, flight: SimFlight, reason: FinishReason, now: float, detail: str = "") -> None:
        flight.stage, flight.reason = Stage.DONE, reason
        self.policy.ended(flight, now)


class _Recorded(WeirPolicy):
    """The glue under test; the sidecar behind each endpoint is left out (a placement
    is recorded where it would be offered to it)."""

    def __init__(self) -> None:
        super().__init__(POLICY)
        self.decisions: Decisions = []
        self.routes: dict[str, RouteRequest] = {}

    def _route_request(self, flight: SimFlight, role: Role, now: float) -> RouteRequest:
        route = self.routes[flight.rid] = super()._route_request(flight, role, now)
        return route

    def _offer(self, sidecar: Sidecar, flight: SimFlight, now: float) -> None:
        self.decisions.append((now, flight.rid, sidecar.endpoint_id))
        flight.target = ""  # the sidecar would take (or ignore) the room held for it

    def _placed(self, role: Role, flight: SimFlight, placed: Placed[SimFlight]) -> None:
        endpoint_id = placed.endpoint_id
        if not self.sim.engines[int(endpoint_id.rsplit("-", 1)[1])].alive:
            self.decisions.append((self.sim.now, flight.rid, f"refused by {endpoint_id}"))
        super()._placed(role, flight, placed)

    def _refused(self, flight: SimFlight, refusal: Refusal, now: float) -> None:
        self.decisions.append((now, flight.rid, refusal.reason))
        super()._refused(flight, refusal, now)


def _streaming(decisions: Decisions, endpoint: str, finished: set[str]) -> list[str]:
    """The requests last sent to `endpoint` and still there, in the order they were sent."""
    last: dict[str, str] = {}
    for _, rid, where in decisions:
        last.pop(rid, None)  # re-inserted: ordered by the last decision
        last[rid] = where
    return [rid for rid, where in last.items() if where == endpoint and rid not in finished]


def _simulated(script: tuple[Event, ...]) -> tuple[Decisions, dict[str, RouteRequest]]:
    weir = _Recorded()
    sim = _Sim(weir)
    weir._sim = sim  # type: ignore[assignment]
    weir._gate = RouterGate(POLICY, kv_bytes_per_token=1, credits=False)
    weir.profile = profile_from_config(default_config(POLICY.routing))  # as the router's
    weir.sidecars = [
        Sidecar(i, f"engine-{i}", 10_000, POLICY, lambda: sim.now) for i in range(ENDPOINTS)
    ]
    weir.routers[Role.MIXED] = Dispatcher(weir.profile, POLICY.routing, weir.index)
    members = (s.endpoint_id for s in weir.sidecars)
    weir.rings[Role.MIXED] = OwnershipRing(Membership.of(1, members), POLICY.routing.virtual_nodes)
    flights: dict[str, SimFlight] = {}
    finished: set[str] = set()
    version = 0
    for event in script:
        sim.run_until(event.at)
        now = event.at
        if isinstance(event, Report):
            version += 1
            _report(weir, event, version, Role.MIXED)
        elif isinstance(event, Arrive):
            flight = flights[event.rid] = _flight(event)
            weir.arrive(flight, now)
        elif isinstance(event, Finish):
            flight = flights[event.rid]
            flight.generated = event.generated
            finished.add(event.rid)
            sim.end(flight, FinishReason.STOP, now)
        elif isinstance(event, Preempt):
            flight = flights[event.rid]
            flight.generated = event.generated
            flight.target = event.target
            weir._hand_back(flight, now, broken=False)
        elif isinstance(event, Fail):
            sim.engines[event.endpoint].alive = False
            on_it = _streaming(weir.decisions, f"engine-{event.endpoint}", finished)
            for rid in on_it:
                flights[rid].generated = FAILED_AFTER
            weir.engine_failed(event.endpoint, [flights[rid] for rid in on_it], now)
    return weir.decisions, weir.routes


# -- the live side -------------------------------------------------------------------------


@dataclass
class _Live:
    """The live router with an injected clock over a fixed pool view; the script plays
    its upstreams (an attempt on a dead endpoint is a refused connection)."""

    now: float = 0.0
    view: PoolView = field(default_factory=lambda: PoolView("p", float("inf")))
    endpoints: dict[str, EndpointView] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    decisions: Decisions = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    router: Router = field(init=False)

    def __post_init__(self) -> None:
        self.router = Router(RouterConfig.from_policy(POLICY), self.view, clock=lambda: self.now)

    def report(self, state: EndpointState) -> None:
        self.endpoints[state.endpoint_id] = EndpointView(state, self.now + LEASE_S)
        self.view.update([self.endpoints[e] for e in sorted(self.endpoints)], self.now)

    def follow(self, ex: Exchange, step: Coroutine[Any, Any, str]) -> None:
        self.tasks.append(asyncio.create_task(self._placed(ex, step)))

    async def _placed(self, ex: Exchange, step: Coroutine[Any, Any, str]) -> None:
        rid = ex.route.request_id
        try:
            endpoint = await step
        except RouterError as exc:
            self.decisions.append((self.now, rid, exc.reason))
            return
        if endpoint in self.dead:  # the connection is refused: nothing reached the client
            self.decisions.append((self.now, rid, f"refused by {endpoint}"))
            self.follow(ex, self.router.redispatch(ex, "refused"))
            return
        self.decisions.append((self.now, rid, endpoint))

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    async def run_until(self, until: float) -> None:
        """The router's timer, on the injected clock: pump at each wakeup due."""
        while (wakeup := self.router.dispatch.next_wakeup()) is not None and wakeup <= until:
            self.now = wakeup
            self.router._wake()
            await self.settle()
        self.now = until


def _continuation(event: Preempt) -> Continuation:
    return Continuation(
        request_id=event.rid, model=MODEL, api=EngineAPI.GENERATE, max_new_tokens=100,
        generated_tokens=event.generated, target=event.target, reservation="held-1",
    )  # fmt: skip


def _exchange(route: RouteRequest) -> Exchange:
    client = ClientRequest(
        api=EngineAPI.GENERATE, model=MODEL, body={}, stream=True, prompt_text="",
        prompt_ids=(1,) * route.prompt_tokens, prompt_tokens=route.prompt_tokens,
        max_new_tokens=route.max_new_tokens, priority=route.priority,
        deadline_s=route.deadline_s,
    )  # fmt: skip
    splicer = Splicer(EngineAPI.GENERATE, prompt_tokens=route.prompt_tokens)
    return Exchange(client, route, route.tenant, 0.0, splicer)


async def _live(script: tuple[Event, ...], routes: dict[str, RouteRequest]) -> Decisions:
    live = _Live()
    router = live.router
    exchanges: dict[str, Exchange] = {}
    finished: set[str] = set()
    version = 0
    for event in script:
        await live.run_until(event.at)
        if isinstance(event, Report):
            version += 1
            live.report(_state(event, version))
        elif isinstance(event, Arrive):
            ex = exchanges[event.rid] = _exchange(routes[event.rid])
            live.follow(ex, router._admit(ex))
        elif isinstance(event, Finish):
            ex = exchanges[event.rid]
            ex.splicer.seg_tokens = event.generated
            finished.add(event.rid)
            router.finish(ex)
        elif isinstance(event, Preempt):
            ex = exchanges[event.rid]
            ex.splicer.seg_tokens = event.generated
            # The sidecar's continuation, as the relay hands it over: it names the target.
            ex.continuation = encode_json(_continuation(event)) if event.target else b""
            live.follow(ex, router.redispatch(ex, "preempted"))
        elif isinstance(event, Fail):
            endpoint = f"engine-{event.endpoint}"
            live.dead.add(endpoint)
            for rid in _streaming(live.decisions, endpoint, finished):
                ex = exchanges[rid]
                ex.splicer.seg_tokens = FAILED_AFTER
                live.follow(ex, router.redispatch(ex, "broken"))
        await live.settle()
    if router._wakeup is not None:
        router._wakeup.cancel()
    for task in live.tasks:
        task.cancel()
    await asyncio.gather(*live.tasks, return_exceptions=True)
    return live.decisions


async def test_the_simulator_dispatches_as_the_live_router_does() -> None:
    simulated, routes = _simulated(SCRIPT)
    live = await _live(SCRIPT, routes)
    assert live == simulated
    # The script exercises what it claims to: every kind of refusal, a fallback after a
    # refused connection, a migrated stream avoiding its endpoint, a failed one never
    # trying the dead endpoint again.
    reasons = {what for _, _, what in live if not what.startswith("engine-")}
    assert reasons == {
        "queue_full", "deadline", "queue_timeout", "endpoints_overloaded", "resume_failed",
        "refused by engine-2",
    }  # fmt: skip
    d1 = [what for _, rid, what in live if rid == "d1"]
    assert d1 == ["refused by engine-2", "engine-0"]
    a1 = [what for _, rid, what in live if rid == "a1"]
    assert len(a1) == 3
    assert a1[1] != a1[0]
    assert all(what != "engine-2" for at, _, what in live if at >= 3.5)
    # A migration resumes where its room is held: routing alone would pick another.
    b1 = [what for _, rid, what in live if rid == "b1"]
    assert b1 == ["engine-1", TARGET]
    untargeted = tuple(replace(e, target="") if isinstance(e, Preempt) else e for e in SCRIPT)
    assert [what for _, rid, what in _simulated(untargeted)[0] if rid == "b1"][1] != TARGET


# -- P/D: the decode half of a pair, picked before either leg starts ------------------------

PAIRS: tuple[Event, ...] = (
    *(Report(0.0, i) for i in range(ENDPOINTS)),
    Arrive(0.1, "p1"),
    Arrive(0.1, "p2", tenant="b", prompt=500),
    Arrive(0.2, "p3", priority=1),
    Finish(0.5, "p1", generated=40),
    Arrive(0.6, "p4", tenant="c"),
    # Every decode endpoint saturated: the pair is refused at once, never queued.
    *(Report(1.0 + i / 100, i, WatermarkState.CRITICAL, running=2) for i in range(ENDPOINTS)),
    Arrive(1.1, "p5"),
    Report(2.0, 1, running=1),  # room again on engine-1
    Arrive(2.1, "p6", tenant="b"),
    Finish(2.5, "p2", generated=7),
    Arrive(2.6, "p7", tenant="d", priority=2),
)


class _Paired(_Recorded):
    """The simulator's pairing glue; the decode sidecar always takes the leg (a pick is
    recorded where its sidecar would hold room for it)."""

    def _hold(self, sidecar: Sidecar, flight: SimFlight, now: float) -> bool:
        self.decisions.append((now, flight.rid, sidecar.endpoint_id))
        return True


def _simulated_pairs(script: tuple[Event, ...]) -> tuple[Decisions, dict[str, RouteRequest]]:
    weir = _Paired()
    sim = _Sim(weir)
    sim.config = replace(sim.config, engines=ENDPOINTS + 1, prefill_engines=1)
    sim.engine_config = engine_config_for(sim.config)  # type: ignore[attr-defined]
    weir._sim = sim  # type: ignore[assignment]
    weir._gate = RouterGate(POLICY, kv_bytes_per_token=1, credits=False)
    weir.profile = profile_from_config(default_config(POLICY.routing))  # as the router's
    weir.sidecars = [
        Sidecar(i, f"engine-{i}", 10_000, POLICY, lambda: sim.now, Role.DECODE)
        for i in range(ENDPOINTS)
    ]
    for role in (Role.PREFILL, Role.DECODE):
        weir.routers[role] = Dispatcher(weir.profile, POLICY.routing, weir.index)
    flights: dict[str, SimFlight] = {}
    for version, event in enumerate(script, 1):  # a report's version: any that grows
        sim.run_until(event.at)
        now = event.at
        if isinstance(event, Report):
            _report(weir, event, version, Role.DECODE)
        elif isinstance(event, Arrive):
            flight = flights[event.rid] = _flight(event)
            route = weir.routes[event.rid] = RouteRequest(
                request_id=event.rid, model=MODEL, prompt_tokens=event.prompt,
                max_new_tokens=100, tenant=event.tenant, role=Role.PREFILL,
                priority=event.priority,
            )  # fmt: skip
            weir._paired(flight, route, now)
        elif isinstance(event, Finish):
            flight = flights[event.rid]
            flight.generated = event.generated
            sim.end(flight, FinishReason.STOP, now)
    return weir.decisions, weir.routes


def _live_pairs(script: tuple[Event, ...], routes: dict[str, RouteRequest]) -> Decisions:
    """The live prefill router's `Pairing`, its clock injected, over the decode pool's
    view; its credits are not taken here (the simulator's are not either)."""
    now = 0.0
    view = PoolView("p", float("inf"))
    gate = HandoffGate(CreditStore(Redis(), "p"), "p", 1, 30.0)
    dispatch: Dispatcher[Exchange] = Dispatcher(
        profile_from_config(default_config(POLICY.routing)), POLICY.routing, PrefixIndex()
    )
    pairing = Pairing(
        gate, view, dispatch, lambda: now, RouterMetrics("p"), "p", Trail("router"),
        lambda work: work.close(), POLICY.routing.max_attempts,
    )  # fmt: skip
    endpoints: dict[str, EndpointView] = {}
    exchanges: dict[str, Exchange] = {}
    decisions: Decisions = []
    for version, event in enumerate(script, 1):
        now = event.at
        if isinstance(event, Report):
            state = _state(event, version, Role.DECODE)
            endpoints[state.endpoint_id] = EndpointView(state, now + LEASE_S)
            view.update([endpoints[e] for e in sorted(endpoints)], now)
        elif isinstance(event, Arrive):
            ex = exchanges[event.rid] = _exchange(routes[event.rid])
            try:
                decode = pairing._place(ex, pairing._pairs.setdefault(event.rid, _Pair()))
            except RouterError as exc:
                decisions.append((now, event.rid, exc.reason))
                continue
            decisions.append((now, event.rid, decode.endpoint_id))
        elif isinstance(event, Finish):
            ex = exchanges[event.rid]
            ex.splicer.seg_tokens = event.generated
            dispatch.finished(event.rid, event.generated, now, view.current(now))
    return decisions


def test_the_simulator_pairs_a_prefill_with_its_decode_as_the_live_router_does() -> None:
    """Both pick the decode endpoint the moment the prefill is placed, with the same
    reports, in-flight counts and ends behind them, and refuse the pair at once when no
    decode endpoint can take it (429 `decode_saturated`, not a wait)."""
    simulated, routes = _simulated_pairs(PAIRS)
    live = _live_pairs(PAIRS, routes)
    assert live == simulated
    outcomes = {rid: what for _, rid, what in live}
    assert outcomes["p5"] == "decode_saturated"
    assert outcomes["p6"] == outcomes["p7"] == "engine-1"
    assert len({outcomes[rid] for rid in ("p1", "p2", "p3")}) > 1  # in flight spreads them
