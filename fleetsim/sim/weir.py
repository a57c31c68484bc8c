"""Weir's real policy code driving the simulated fleet.

Router (`controlplane.routing`, `controlplane.ownership`): the prompt's primary and
secondary owners on the consistent-hash ring (rebuilt when a lease lapses); the default
scheduling profile (filters → weighted
cost-model scorers → max-score picker) over a `PoolSnapshot` built from the sidecars'
heartbeats, as stale as the heartbeat period plus the change-feed delay; the approximate
`PrefixIndex`; and the live router's dispatch core (`Dispatcher`: route or queue in the
tenant-fair `FairQueue`, in-flight reservations, charges, the pump, fallbacks before the
first byte and resumes), configured by the same pool policy and held equal to the
router's use of it by tests/fleetsim/test_dispatch_parity.py. What is left here is
event plumbing: timers for the core's wakeups, engine liveness (a dead engine's
connection is refused), and the sidecar behind each endpoint.

Sidecar (`engine_sidecar.policy`), one per engine: growth-reserve admission
(`decide_admission`) over the KV its requests hold plus the growth the running ones are
predicted to add (`OutputLengthPredictor`, or the client's hint); the bounded local queue
by the live ledger's own discipline (`AdmissionQueue`: no overtaking, priority with aging,
tenants by KV cost and weight inside a class, each admission charged and settled when its
KV is released, resumes one class ahead and never refused for a full queue; held equal to
the ledger by tests/fleetsim/test_orchestration_parity.py); engine priority from urgency (`engine_priority`);
the latency model (`LatencyPredictor`, the live ledger's own), forecasting each new request
when it reaches the sidecar, trained when it ends undisturbed, its predictions published
with every heartbeat for the router's SLO-risk term;
watermarks with hysteresis (`classify_watermark`) published with every heartbeat and at once
on a change; and the relief ladder (`plan_relief`): at exhaustion, victims are migrated (a
continuation re-routed by the router, excluding this endpoint), offloaded (resumed in
place from the engine's host tier) or recomputed in place. On engines with a host tier
the choice is relief's cost comparison (`ReliefCosts` from the engines' roofline, the
host room less what this sidecar's offloads not yet resumed hold).

Router gate (`fleetsim.sim.gate`): tenant quotas, when the pool policy declares tenants,
and on a disaggregated fleet a decode handoff credit before a prefill is admitted, both
by the control plane's pure rules (`controlplane.rules`: `quotas`, `credits`)
and refused as the router refuses (429 with the limit as reason and Retry-After). A
client with a maximum wait of its own retries after Retry-After while that wait lasts; an
interactive one takes the refusal.

P/D, as the live prefill pool's router pairs a request (`controlplane.router.pd`):
sidecars publish their engine's role; the prefill is routed over the prefill endpoints
and, the moment it is placed, its decode endpoint is picked too by the decode pool's
dispatch core over the decode snapshot (`controlplane.routing.pairing`, the live code:
429 `decode_saturated` when no decode endpoint can take it now). The decode leg reaches
that endpoint's sidecar at once, which admits it into room it holds until the KV lands
(counted as committed, published, and never given to anything else), as the live decode
sidecar commits the leg while its engine preallocates the prompt's pages; a sidecar that
would not admit it now fails the leg and the next decode endpoint is tried, up to the
routing policy's `max_attempts` (then 429 `endpoints_overloaded`). The handoff lands in
that room: nothing admitted waits for a decode engine after its prefill. The decode
class's credit budget comes from what the decode sidecars last published
(`rules.credits.decode_budget`): the room each routable endpoint's sidecar would admit,
summed for the class cap, and the largest one as the bound on a single credit (a
handoff lands on one engine); a credit is consumed when the handoff lands, and given
back when its request ends or its pair is refused first.

Engines run with Weir's engine flags (priority scheduling by the priority the sidecar sends,
which the sidecar alone ages; prefill yielding at chunk boundaries, mixed prefill/decode
iterations with a prefill time budget), as the operator renders them from the pool spec.
When an engine dies, the router, which holds every stream, re-routes what it had in flight
as continuations.

Not modelled: KV token-second quotas (the sidecar's charge).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, overload

from controlplane.contract import (
    MAX_HOST_PREFIXES,
    CacheIdentity,
    EndpointState,
    FinishReason,
    PoolPolicy,
    Role,
    WatermarkState,
)
from controlplane.ownership import Membership, OwnershipRing, prefix_key
from controlplane.routing import (
    Dispatcher,
    EndpointView,
    Placed,
    PoolSnapshot,
    PrefixIndex,
    Profile,
    Refusal,
    RouteRequest,
    default_config,
    profile_from_config,
)
from controlplane.routing.dispatch import RESUME_FAILED, Event
from controlplane.routing.pairing import decode_attempts_spent, decode_route, place_decode
from controlplane.rules.credits import decode_budget
from controlplane.rules.fairness import Charge, tenant_weights
from engine_sidecar.ledger import Ledger
from engine_sidecar.policy import (
    RESERVATION_TTL_S,
    AdmissionDecision,
    AdmissionQueue,
    AdmissionVerdict,
    EngineLoad,
    KVUsage,
    LengthKey,
    OutputLengthPredictor,
    PoolOutlook,
    QueuedRequest,
    ReliefCosts,
    Reservations,
    Rung,
    SequenceOutlook,
    TargetRooms,
    VictimCandidate,
    VictimChoice,
    admits_now,
    classify_watermark,
    decide_admission,
    engine_priority,
    growth_reserve,
    growth_tokens,
    peer_rooms,
    plan_relief,
    queue_wait_s,
    queued_request,
    reservable_tokens,
    tpot_gate_s,
)
from fleetsim.engine import EngineConfig
from fleetsim.sim.config import MODEL, FleetConfig, Staleness
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.sim.gate import HOLDER_TTL_MS, RouterGate
from fleetsim.sim.loop import Simulation
from fleetsim.workloads import BLOCK_TOKENS

# A lease lapses after this many missed heartbeats.
LEASE_HEARTBEATS: Final = 3
# Admitting a prompt this long publishes the sidecar's state at once.
LONG_PROMPT_TOKENS: Final = 4096
# A patient client retries a 503 without Retry-After after this long.
CLIENT_BACKOFF_S: Final = 1.0
# The router renews its quota holder lease at a third of its time to live, as
# `QuotaGate.keep_lease` does.
HOLDER_RENEW_S = HOLDER_TTL_MS / 3000
# How much earlier than its next KV account a sidecar's quiet span is said to end: far
# above the float rounding of `now - accounted_at`, far below an iteration.
ACCOUNT_MARGIN_S: Final = 1e-6


# The cache identity every simulated prompt is keyed under, as the router keys it.
_IDENTITY = CacheIdentity(model=MODEL)


@functools.cache
def _length_key(tenant: str) -> LengthKey:
    """The predictor's key for a tenant's requests, built once: every KV account asks
    for every running request's length."""
    return LengthKey(tenant, MODEL)


@dataclass(slots=True)
class _Held:
    """What the sidecar knows about one request it admitted into its engine."""

    flight: SimFlight
    prompt_tokens: int
    generated_at_admission: int
    charge: Charge  # its tenant's, until its KV is released (`Sidecar.release`)


@dataclass(slots=True)
class Sidecar:
    index: int
    endpoint_id: str
    capacity_tokens: int
    policy: PoolPolicy
    clock: Callable[[], float]
    role: Role = Role.MIXED
    # The oracle's sidecars are told each answer's true length instead of predicting it.
    told_lengths: bool = False
    # The live sidecar's ledger, for its output-length predictor and its latency model
    # (trained on the requests that finished, published as its predictions); the simulator
    # keeps its own KV account below, on the virtual clock.
    ledger: Ledger = field(init=False)
    queue: AdmissionQueue[SimFlight] = field(init=False)
    held: dict[str, _Held] = field(default_factory=dict)
    watermark: WatermarkState = WatermarkState.NORMAL
    admission_paused: bool = False
    used_tokens: int = 0
    reserved_tokens: int = 0
    accounted_at: float = -1e9
    engine_waiting: int = 0  # requests waiting in the engine, as its last poll read it
    version: int = 0
    # When its admission last pumped a waiting queue and let nothing out (-1: it did).
    stalled_at: float = -1.0
    # Offloaded victims not yet back in the engine, with the KV each left in its host tier.
    offloaded: dict[str, tuple[SimFlight, int]] = field(default_factory=dict)
    # Room held for continuations migrating here, as the live ledger holds it.
    reservations: Reservations = field(init=False)
    _usage: KVUsage = field(init=False, repr=False)  # the last `usage()`
    # The policy's growth figures, read for every running request at every KV account.
    _growth_quantile: float = field(init=False, repr=False)
    _growth_horizon: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._growth_quantile = self.policy.kv.growth_quantile
        self._growth_horizon = self.policy.kv.growth_horizon_steps
        self.ledger = Ledger(self.policy, self.capacity_tokens, self.clock)
        sched = self.policy.scheduling
        self.queue = AdmissionQueue(
            sched.local_queue_size, sched.aging_per_second, tenant_weights(self.policy.tenants)
        )
        self.reservations = Reservations(self.endpoint_id)
        self._usage = KVUsage(self.capacity_tokens, 0, 0)

    @property
    def predictor(self) -> OutputLengthPredictor:
        return self.ledger.predictor

    def predicted_total(self, flight: SimFlight, generated: int) -> int:
        """The flight's predicted total output, `generated` (its tokens so far) known."""
        spec = flight.spec
        if self.told_lengths:
            return spec.generated_tokens
        if spec.output_hint_tokens > 0:
            return max(generated + 1, min(spec.max_tokens, spec.output_hint_tokens))
        return self.ledger.predictor.predict_total(
            _length_key(spec.tenant), self._growth_quantile, generated, spec.max_tokens
        )

    def charge_for(self, flight: SimFlight, prompt_tokens: int, now: float) -> Charge:
        """What admitting the flight at `now` charges its tenant, as the live ledger
        charges it: its KV (`prompt_tokens`, what it generated included) from now to its
        first token, as this engine's latency model predicts it, and the output it may
        still add at its TPOT. (Without the wait to the first token, a tenant of short
        answers behind long prompts was charged a fraction of the KV seconds it pinned:
        on a stock SGLang engine the long-answer tenant got 2.3x its KV token-seconds,
        Jain's index 0.87; with it, 1.6x and 0.95.)"""
        spec = flight.spec
        left = spec.max_tokens - flight.generated
        ttft_s = self.ledger.latency.forecast(self.load()).ttft_s(prompt_tokens)
        return Charge.placed(
            spec.tenant, prompt_tokens, left, now, ttft_s=ttft_s, tpot_s=self.ledger.tpot_s
        )

    def release(self, rid: str, now: float) -> _Held | None:
        """Its engine let the request go: its KV is no longer held here, and its tenant's
        charge is settled."""
        held = self.held.pop(rid, None)
        if held is not None:
            generated = held.flight.generated - held.generated_at_admission
            self.queue.settle(held.charge, generated, now)
        return held

    def outlook(self, flight: SimFlight) -> SequenceOutlook:
        generated = flight.generated
        return SequenceOutlook(
            generated, flight.spec.max_tokens, self.predicted_total(flight, generated)
        )

    def account(self) -> None:
        """KV held (prompt not served from cache + generated) and reserved growth of the
        requests in the engine, from the sidecar's own streamed-token accounting."""
        horizon = self._growth_horizon
        used = reserved = 0
        for held in self.held.values():
            flight = held.flight
            if flight.forecast is not None and flight.ttft_error < 0:
                # The live sidecar learns at the first token; this one at its next poll.
                self.learn_ttft(flight)
            generated = flight.generated
            cached = max(0, flight.visit_cached)
            used += held.prompt_tokens - cached + generated - held.generated_at_admission
            predicted = self.predicted_total(flight, generated)
            reserved += growth_tokens(generated, flight.spec.max_tokens, predicted, horizon)
        self.used_tokens = used
        self.reserved_tokens = reserved

    def usage(self) -> KVUsage:
        """Used KV, and what is committed beside it: growth reserved and room held."""
        committed = self.reserved_tokens + self.reservations.held_tokens
        last = self._usage
        if last.used_tokens != self.used_tokens or last.reserved_growth_tokens != committed:
            # Built again only when it changed (at an account, an admission, a release):
            # it is read at every iteration, and a dataclass's constructor is the
            # interpreter's even in a compiled run.
            last = self._usage = KVUsage(self.capacity_tokens, self.used_tokens, committed)
        return last

    def room_tokens(self) -> int:
        """The largest continuation a reservation here would be granted now."""
        return reservable_tokens(
            self.usage(), self.watermark, not self.admission_paused, self.policy.kv
        )

    def pool(self, tpot_gate: bool = False) -> PoolOutlook:
        """The pool as admission sees it; with `tpot_gate` (the pool declares a TPOT
        objective), what the gate reads too, as the live ledger reads it (`Ledger._decide`)."""
        usage = self.usage()
        pending = tpot_gate and self.prefill_pending()
        return PoolOutlook(
            usage.capacity_tokens,
            usage.used_tokens,
            usage.reserved_growth_tokens,
            self.watermark,
            admission_open=not self.admission_paused,
            prefill_pending=pending,
            predicted_tpot_s=self.ledger.latency.predicted_tpot_s(self.load()) if pending else 0.0,
        )

    def prefill_pending(self) -> bool:
        """Whether a request admitted here still waits for its first token (here: its
        next, for a resumed one), as the live ledger's requests in a prefill state."""
        for h in self.held.values():  # noqa: SIM110 (a loop, as in waiting_prefill)
            if h.flight.generated == h.generated_at_admission:
                return True
        return False

    def waiting_prefill(self) -> int:
        """Prompt tokens not yet prefilled: queued here, or admitted and still waiting
        for their first token (the sidecar knows what it sent and what has streamed
        back)."""
        tokens = self.queue.prompt_tokens
        for h in self.held.values():  # a loop, not a generator: compiled, a third the time
            if h.flight.generated == h.generated_at_admission:
                tokens += h.prompt_tokens - max(0, h.flight.visit_cached)
        return tokens

    def load(self) -> EngineLoad:
        """The engine's load as the live ledger's latency model sees it (`Ledger.load`)."""
        usage = self.usage()
        committed = usage.used_tokens + usage.reserved_growth_tokens
        return EngineLoad(
            self.waiting_prefill(),
            len(self.held),
            committed / max(1, self.capacity_tokens),
            len(self.queue),
            self.engine_waiting,
        )

    def learn_ttft(self, flight: SimFlight) -> None:
        """Train the latency model on a new request's first token, once, if nothing
        disturbed it before then (`Ledger.first_token_latency`'s rule)."""
        forecast = flight.forecast
        if forecast is None or flight.ttft_error >= 0 or flight.first_token_at < 0:
            return
        if flight.preemptions:
            flight.forecast = None
            return
        flight.ttft_error = self.ledger.latency.observe_ttft(
            forecast,
            flight.spec.input_tokens - flight.cached_tokens,
            flight.first_token_at - flight.forecast_at,
        )

    def learn_latency(self, flight: SimFlight) -> None:
        """The request leaves this sidecar: its first token teaches the model if that was
        not yet seen, and its TPOT if it finished undisturbed (`Ledger.finished_latency`)."""
        self.learn_ttft(flight)
        forecast, flight.forecast = flight.forecast, None  # one sidecar learns from it
        undisturbed = flight.completed and not flight.preemptions
        if forecast is not None and undisturbed and flight.generated > 1:
            flight.tpot_error = self.ledger.latency.observe_tpot(forecast, flight.tpot_s)

    def host_held(self) -> int:
        """KV its offloads left in the host tier and have not loaded back yet."""
        for rid, (flight, _) in list(self.offloaded.items()):
            if flight.done or flight.stage is Stage.ENGINE:
                del self.offloaded[rid]
        return sum(tokens for _, tokens in self.offloaded.values())

    def host_prefixes(self) -> tuple[int, ...]:
        """What its heartbeat publishes as held in the host tier: the offloads not yet
        loaded back, most recent first, each by its prompt's last block as routers key it
        (`EndpointState.host_prefixes`)."""
        if not self.offloaded:
            return ()  # as at most heartbeats: building the generator cost more
        self.host_held()
        tips = (_block_hashes(f) for f, _ in reversed(self.offloaded.values()))
        return tuple(blocks[-1] for blocks in tips if blocks)[:MAX_HOST_PREFIXES]


def relief_costs(config: EngineConfig) -> ReliefCosts | None:
    """Relief's costs on engines of this config, from their roofline (None without a host
    tier: relief then takes the ladder's order, as before offload existed)."""
    if not config.enable_hierarchical_cache:
        return None
    timing = config.timing
    model, hw = timing.model, timing.hardware
    flops = hw.flops * hw.compute_efficiency
    return ReliefCosts(
        prefill_s_per_token=2.0 * model.params / flops,
        prefill_s_per_pair=4.0 * model.layers * model.hidden / flops,
        decode_step_s=timing.iteration_s(0, 0, 0, 1, 0),
        kv_bytes_per_token=model.kv_bytes_per_token,
        host_bytes_per_s=hw.host_bytes_per_s,
        host_room_tokens=config.host_total_tokens,
        page_tokens=config.page_size,
    )


# Policy names as module constants: a compiled (mypyc) class's attribute read on the
# class is its descriptor, not the value, so code that compares names reads these.
WEIR_NAME: Final = "weir"


class WeirPolicy:
    name = WEIR_NAME
    # Whether the router and the sidecars know every answer's length (the oracle) rather
    # than estimate it from `max_tokens` and the sidecars' predictors.
    knows_lengths = False

    def __init__(self, policy: PoolPolicy | None = None) -> None:
        self.pool_policy = policy
        self._sim: Simulation | None = None
        self.sidecars: list[Sidecar] = []
        self.profile: Profile | None = None
        self.index = PrefixIndex()
        # One router per pool: a P/D fleet is a prefill pool and a decode pool, each with
        # its own snapshot, ownership ring and dispatch core (a colocated fleet has one,
        # MIXED).
        self.routers: dict[Role, Dispatcher[SimFlight]] = {}
        self.rings: dict[Role, OwnershipRing] = {}
        self._snapshots: dict[Role, PoolSnapshot] = {}
        # Reports published since the router last read its pool's snapshot, by endpoint
        # id, and when the last was: most land while nothing waits for an endpoint, so
        # they are moved into the snapshot when a decision reads it, all at once.
        self._moved: dict[Role, dict[str, EndpointView]] = {}
        self._moved_at: dict[Role, float] = {}
        # Each endpoint as the routers last heard from it (its state and lease), by
        # sidecar index: a view is built once per report, not once per snapshot.
        self._views: dict[int, EndpointView] = {}
        self._where: dict[str, int] = {}  # the sidecar a request is at
        # The routers' decisions, delivered in the order they were made even when acting
        # on one (an engine that refuses, a flight that ends) makes more.
        self._outbox: deque[tuple[Role, Event[SimFlight]]] = deque()
        self._delivering = False
        self._wakeups: dict[Role, float] = {}  # each router's earliest timer set
        self._gate: RouterGate | None = None
        self._costs: ReliefCosts | None = None
        self._in_place: set[str] = set()  # relief victims resuming where they were
        # P/D: the decode sidecar each started pair holds room at, and its reservation
        # there, until the handoff lands in it (or the request ends first).
        self._pairs: dict[str, tuple[int, str]] = {}

    @property
    def sim(self) -> Simulation:
        assert self._sim is not None, "start() first"
        return self._sim

    @property
    def staleness(self) -> Staleness:
        """How late the router and the sidecars see what happens in the fleet."""
        return self.sim.config.staleness

    @property
    def gate(self) -> RouterGate:
        assert self._gate is not None, "start() first"
        return self._gate

    def tune(self, config: EngineConfig, fleet: FleetConfig) -> EngineConfig:
        """Weir's engine flags: exactly those the operator renders for SGLang from the pool
        policy (`fleet_operator.rendering.engine_args`, held equal by
        tests/fleetsim/test_weir_engine_flags.py): priority scheduling, fcfs inside a
        priority, and the pool's prefill chunk and running cap. Nothing stock SGLang
        lacks: the reference engine's prefill yielding and per-iteration prefill time
        budget made Weir's simulated goodput up to 1.6x what a Weir deployment gets
        (docs/fleet-simulation.md). The engine does not age priorities: the sidecar
        does, in its queue and in the priority it sends (`engine_priority`)."""
        scheduling = (self.pool_policy or fleet.policy).scheduling
        flags = config.replace(
            enable_priority_scheduling=scheduling.priority_scheduling,
            schedule_policy="fcfs",
            chunked_prefill_size=scheduling.chunked_prefill_size,
        )
        if scheduling.max_running_requests > 0:
            flags = flags.replace(max_running_requests=scheduling.max_running_requests)
        return flags

    def _policy(self) -> PoolPolicy:
        if self.pool_policy is None:
            raise RuntimeError("the pool policy is set when the simulation starts")
        return self.pool_policy

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, sim: Simulation) -> None:
        self._sim = sim
        if self.pool_policy is None:
            self.pool_policy = sim.config.policy
        policy = self._policy()
        timing = sim.engine_config.timing
        per_token_s = (
            2.0 * timing.model.params / (timing.hardware.flops * timing.hardware.compute_efficiency)
        )
        config = default_config(policy.routing)
        config["cost"] = {
            "prefill_tokens_per_s": 1.0 / per_token_s,
            "kv_bytes_per_token": timing.model.kv_bytes_per_token,
            "ttft_slo_s": sim.config.slo.ttft_s,
            "transfer_bytes_per_s": sim.config.kv_link_bytes_per_s,
        }
        if self.knows_lengths:
            # The request's `max_new_tokens` below is then its true length: all of it counts.
            config["cost"]["expected_output_fraction"] = 1.0
        self.profile = profile_from_config(config)
        self._costs = relief_costs(sim.engine_config)
        self._engine_poll_s = self.staleness.engine_poll_s
        self.sidecars = [
            Sidecar(
                e.index,
                f"engine-{e.index}",
                e.capacity_tokens,
                policy,
                lambda: sim.now,
                e.role,
                told_lengths=self.knows_lengths,
            )
            for e in sim.engines
        ]
        self._gate = RouterGate(
            policy, timing.model.kv_bytes_per_token, credits=sim.config.disaggregated
        )
        sim.every(HOLDER_RENEW_S, self.gate.renew)
        vnodes = policy.routing.virtual_nodes  # as the router's `RingOwners`
        for role in dict.fromkeys(s.role for s in self.sidecars):
            self.routers[role] = Dispatcher(
                self.profile, policy.routing, self.index, tenant_weights(policy.tenants)
            )
            members = (s.endpoint_id for s in self.sidecars if s.role is role)
            self.rings[role] = OwnershipRing(Membership.of(1, members), vnodes)
        period = self.staleness.heartbeat_period_s
        for sidecar in self.sidecars:
            self._heartbeat(sidecar, 0.0, registered=True)
        # Stagger heartbeats across the period, as independent sidecars do.
        n = len(self.sidecars)
        for sidecar in self.sidecars:
            sim.every(
                period, functools.partial(self._heartbeat, sidecar), period * sidecar.index / n
            )

    # -- heartbeats and the router's snapshot ---------------------------------------------
    def _heartbeat(self, sidecar: Sidecar, now: float, registered: bool = False) -> None:
        """Publish the sidecar's state; the router sees it after the change feed's delay
        (at once for the registration that precedes any traffic)."""
        if not self.sim.engines[sidecar.index].alive:
            return
        state, lease = self._report(sidecar, now)
        if registered:
            self._publish(sidecar.index, state, lease, now)
            return
        delay = self.staleness.notify_delay_s
        self.sim.at(now + delay, lambda: self._publish(sidecar.index, state, lease, now))

    def _report(self, sidecar: Sidecar, now: float) -> tuple[EndpointState, float]:
        """The sidecar's state as its heartbeat carries it now, and the lease it renews."""
        sim = self.sim
        slot = sim.engines[sidecar.index]
        sidecar.version += 1
        load = sidecar.load()
        forecast = sidecar.ledger.latency.forecast(load)
        state = EndpointState(
            pool=self._policy().pool,
            endpoint_id=sidecar.endpoint_id,
            address=f"sim://{sidecar.index}",
            model=MODEL,
            epoch=1,
            version=sidecar.version,
            watermark=sidecar.watermark,
            role=sidecar.role,
            page_size=slot.model.page_size,
            kv_capacity_tokens=sidecar.capacity_tokens,
            predicted_ttft_s=forecast.wait_s,
            predicted_tpot_s=forecast.tpot_s,
            predicted_prefill_s_per_token=forecast.prefill_s_per_token,
            kv_used_tokens=sidecar.used_tokens,
            kv_reserved_growth_tokens=sidecar.usage().reserved_growth_tokens,
            waiting_prefill_tokens=load.prefill_ahead_tokens,
            running_requests=load.running_requests,
            queued_requests=len(sidecar.queue),
            host_prefixes=sidecar.host_prefixes(),
            updated_at=now,
        )
        return state, now + LEASE_HEARTBEATS * self.staleness.heartbeat_period_s

    def _publish(self, index: int, state: EndpointState, lease: float, taken_at: float) -> None:
        view = self._views[index] = EndpointView(state, lease)
        role = state.role
        self.routers[role].reported(state.endpoint_id, taken_at)
        now = self.sim.now
        if role in self._snapshots:
            # The other pool's snapshot stands.
            self._moved.setdefault(role, {})[view.endpoint_id] = view
            self._moved_at[role] = now
        if state.role is Role.DECODE:
            # The decode class's credit budget, from what its sidecars last published.
            self.gate.set_decode_budget(
                *decode_budget(
                    self._snapshot(now, Role.DECODE),
                    now,
                    self._policy().kv,
                    self.sim.engine_config.timing.model.kv_bytes_per_token,
                )
            )
        self._pump(role, now)

    def _snapshot(self, now: float, role: Role) -> PoolSnapshot:
        """`role`'s pool as the router sees it."""
        snapshot = self._snapshots.get(role)
        if snapshot is None:
            views = tuple(v for _, v in sorted(self._views.items()) if v.state.role is role)
            snapshot = self._snapshots[role] = PoolSnapshot(
                self._policy().pool, views, taken_at=now
            )
        elif moved := self._moved.get(role):
            snapshot = snapshot.replacing(moved.values(), taken_at=self._moved_at[role])
            self._snapshots[role] = snapshot
            moved.clear()
        return snapshot

    def _pump_snapshot(self, now: float, role: Role) -> PoolSnapshot | None:
        """What a call that only pumps `role`'s router reads: nothing when nothing waits
        there (the pump then only ends waits that are over, which reads no snapshot)."""
        return None if self.routers[role].idle else self._snapshot(now, role)

    def _pump(self, role: Role, now: float) -> None:
        self._deliver(role, self.routers[role].pump(now, self._pump_snapshot(now, role)))

    # -- the routers ----------------------------------------------------------------------
    def arrive(self, flight: SimFlight, now: float) -> None:
        refusal = self.gate.admit(flight, now)
        if refusal is not None:
            self._refused(flight, refusal, now)
            return
        role = self._role(flight)
        router = self.routers[role]
        route = self._route_request(flight, role, now)
        self._deliver(role, router.arrive(route, flight, now, self._snapshot(now, role)))
        self._mark_waiting(role, flight, now)

    def _hand_back(self, flight: SimFlight, now: float, *, broken: bool) -> None:
        """A continuation (a migration, or a failover when `broken`): its router resumes
        it elsewhere, at the migration's target first."""
        role = self._role(flight)
        events = self.routers[role].handed_back(
            flight.rid, flight.generated, now, self._snapshot(now, role), broken=broken,
            target=flight.target,
        )  # fmt: skip
        self._deliver(role, events)
        self._mark_waiting(role, flight, now)

    def _mark_waiting(self, role: Role, flight: SimFlight, now: float) -> None:
        if self.routers[role].waiting(flight.rid):
            flight.accepted = True
            flight.enqueue(now)

    def _deliver(self, role: Role, events: list[Event[SimFlight]]) -> None:
        """Act on a router's decisions: a placement goes to the endpoint's sidecar (unless
        its engine is dead: the connection is refused, and the router told so); a
        refusal reaches the client, or loses a continuation nobody could take."""
        self._outbox.extend((role, event) for event in events)
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._outbox:
                role, event = self._outbox.popleft()
                flight = event.payload
                if flight.done:
                    continue
                if isinstance(event, Placed):
                    self._placed(role, flight, event)
                else:
                    self._refused(flight, event.refusal, self.sim.now)
        finally:
            self._delivering = False
        self._arm_wakeups()

    def _placed(self, role: Role, flight: SimFlight, placed: Placed[SimFlight]) -> None:
        now = self.sim.now
        endpoint_id = placed.endpoint_id
        index = int(endpoint_id.rsplit("-", 1)[1])
        if not self.sim.engines[index].alive:
            # Its lease has not lapsed yet but the connection is refused.
            snapshot = self._snapshot(now, role)
            self._deliver(role, self.routers[role].refused(flight.rid, now, snapshot))
            return
        if role is Role.PREFILL and not self._paired(flight, placed.route, now):
            return
        self.routers[role].reached(placed.route, endpoint_id)
        flight.accepted = True
        self._offer(self.sidecars[index], flight, now)

    # -- P/D pairs ------------------------------------------------------------------------
    def _paired(self, flight: SimFlight, route: RouteRequest, now: float) -> bool:
        """The pair starts with its prefill placed: a decode endpoint is picked at once
        and its sidecar holds room for the prompt's KV (`Pairing.attempt`'s loop: a
        decode endpoint that does not take the leg is left for the next, up to
        `max_attempts`). False when the pair is refused (its client answered). A prefill
        placed again (its engine died) keeps the room its pair holds."""
        if flight.rid in self._pairs:
            return True
        decode = self.routers[Role.DECODE]
        failed: set[str] = set()
        attempts = self._policy().routing.max_attempts
        for _ in range(attempts):
            snapshot = self._snapshot(now, Role.DECODE)
            route_now = decode_route(route, flight.generated, failed)
            placed = place_decode(decode, route_now, flight, now, snapshot)
            if isinstance(placed, Refusal):
                self._unpaired(flight, placed, now)
                return False
            if self._hold(self.sidecars[int(placed.rsplit("-", 1)[1])], flight, now):
                flight.decode_endpoint = placed
                return True
            self._deliver(Role.DECODE, decode.finished(flight.rid, 0, now, snapshot))
            failed.add(placed)
        self._unpaired(flight, decode_attempts_spent(attempts, 0.0), now)
        return False

    def _hold(self, sidecar: Sidecar, flight: SimFlight, now: float) -> bool:
        """The decode leg reaches `sidecar`: admitted now into room held for its KV until
        the handoff lands, or not taken (its engine is dead, or its admission would
        make it wait: the live leg would wait there and then be refused)."""
        if not self.sim.engines[sidecar.index].alive:
            return False
        decision = self._decision(sidecar, flight, flight.spec.input_tokens + flight.generated)
        if not admits_now(decision, len(sidecar.queue)):
            return False
        held = sidecar.reservations.take(flight.rid, decision.needed_tokens, now, math.inf)
        self._pairs[flight.rid] = (sidecar.index, held.reservation_id)
        self._held_changed(sidecar, now)
        return True

    def _unpaired(self, flight: SimFlight, refusal: Refusal, now: float) -> None:
        """The pair does not start: its prefill placement is given up, its quota charge
        and credit go back, and its client has the refusal."""
        prefill = self.routers[Role.PREFILL]
        snapshot = self._snapshot(now, Role.PREFILL)
        self._deliver(Role.PREFILL, prefill.finished(flight.rid, 0, now, snapshot))
        self.gate.release(flight, now, unused=True)
        self.gate.settle(flight, now)
        self._refused(flight, refusal, now)

    def _let_go(self, flight: SimFlight, now: float) -> tuple[Sidecar, bool] | None:
        """The room its pair holds is given up (the handoff takes it, or the request
        ended): the decode sidecar, and whether the room was still held there."""
        pair = self._pairs.pop(flight.rid, None)
        if pair is None:
            return None
        sidecar = self.sidecars[pair[0]]
        held = sidecar.reservations.consume(pair[1], flight.rid) is not None
        return sidecar, held

    def _arm_wakeups(self) -> None:
        """A timer at each router's next wakeup (a wait that ends, an avoided endpoint
        that may be asked again), as the router keeps one."""
        for role, router in self.routers.items():
            when = router.next_wakeup()
            if when is not None and when < self._wakeups.get(role, math.inf):
                self._wakeups[role] = when
                self.sim.at(when, functools.partial(self._wake, role, when))

    def _wake(self, role: Role, when: float) -> None:
        if self._wakeups.get(role) == when:
            del self._wakeups[role]
        self._pump(role, self.sim.now)

    def _refused(self, flight: SimFlight, refusal: Refusal, now: float) -> None:
        """The router's answer reaches the client: a patient one (its own maximum wait)
        sends the request again after Retry-After while that wait lasts. A continuation
        no endpoint took in time is lost."""
        if refusal.reason == RESUME_FAILED:
            self.sim.end(flight, FinishReason.ABORTED, now, "continuation found no endpoint")
            return
        spec = flight.spec
        delay = refusal.retry_after_s if refusal.retry_after_s is not None else CLIENT_BACKOFF_S
        if refusal.retryable and now + delay < spec.arrival_s + spec.max_wait_s:
            flight.retries += 1
            self.sim.at(now + delay, lambda: self._retry(flight))
            return
        ending = FinishReason.OVERLOAD if refusal.retryable else FinishReason.ERROR
        if refusal.status == 504:
            ending = FinishReason.DEADLINE
        self.sim.end(flight, ending, now, f"router: {refusal.status} {refusal.reason}")

    def _retry(self, flight: SimFlight) -> None:
        if not flight.done:
            self.arrive(flight, self.sim.now)

    def _role(self, flight: SimFlight) -> Role:
        """Where the flight goes next: a fresh request prefills on a P/D fleet's prefill
        side; a handed-off one, or a continuation, goes to the decode side."""
        if not self.sim.config.disaggregated:
            return Role.MIXED
        return Role.DECODE if flight.kv_ready or flight.generated else Role.PREFILL

    def _route_request(self, flight: SimFlight, role: Role, now: float) -> RouteRequest:
        """The request as the router's prepare step would see it arriving now (a patient
        client's retry arrives anew): its prompt, output limit, deadline left, blocks and
        owners on the pool's current ring."""
        spec = flight.spec
        deadline = 0.0
        if spec.deadline_s > 0:
            deadline = max(1e-3, spec.arrival_s + spec.deadline_s - now)
        return RouteRequest(
            request_id=spec.request_id,
            model=MODEL,
            prompt_tokens=spec.input_tokens,
            max_new_tokens=spec.generated_tokens if self.knows_lengths else spec.max_tokens,
            tenant=spec.tenant,
            role=role,
            priority=spec.priority,
            deadline_s=deadline,
            block_hashes=_block_hashes(flight),
            owners=self._owners(flight, role),
        )

    def _owners(self, flight: SimFlight, role: Role) -> tuple[str, ...]:
        """Primary and secondary owner of the prompt's prefix key on the current ring of
        the pool, keyed from the prompt's first tokens exactly as the router keys it."""
        routing = self._policy().routing
        head = flight.prompt_bytes()[: routing.prefix_blocks_for_owner * BLOCK_TOKENS]
        key = prefix_key(
            _IDENTITY, head, routing.prefix_block_tokens, routing.prefix_blocks_for_owner
        )
        return tuple(o for o in self.rings[role].owners(key) if o)

    def _membership_changed(self, now: float) -> None:
        """A lapsed lease (a dead engine) leaves its pool's ring: a new membership version."""
        for role, ring in self.rings.items():
            live = [
                s.endpoint_id
                for s in self.sidecars
                if s.role is role and self.sim.engines[s.index].alive
            ]
            self.rings[role] = OwnershipRing(Membership.of(ring.version + 1, live), ring.vnodes)

    def _patience_left(self, flight: SimFlight, now: float) -> float:
        """How long a new request may wait in a sidecar's queue: until its client's
        patience (`max_wait_s`), else the pool's local-queue wait, counted from its
        arrival at the router — the simulated queue stands in for the live sidecar's
        429 and the router's fallbacks and retries."""
        spec = flight.spec
        wait = spec.max_wait_s or self._policy().scheduling.local_queue_max_wait_s
        return spec.arrival_s + wait - now

    # -- the sidecars ----------------------------------------------------------------------
    def _offer(self, sidecar: Sidecar, flight: SimFlight, now: float) -> None:
        """A request reaches the sidecar: taken into room held for it at once, else queued
        by the live ledger's rule (`queued_request`; one preempted here ages from now,
        where the live ledger ages it from its first arrival) and admitted as the queue
        allows."""
        self.sim.interrupt(sidecar.index)  # it admits or queues
        spec = flight.spec
        resumed = bool(flight.generated)
        prompt = spec.input_tokens + flight.generated
        if flight.forecast is None and not resumed:
            flight.forecast = sidecar.ledger.latency.forecast(sidecar.load())
            flight.forecast_at = now
        if self._consume(sidecar, flight, now):
            decision = self._decision(sidecar, flight, prompt, held=True)
            if admits_now(decision, len(sidecar.queue)):
                self._enter(sidecar, flight, prompt, spec.priority, decision, now)
                return
        # A continuation is accepted work: a full queue takes it all the same.
        if sidecar.queue.refuses(resumed=resumed):
            self.sim.end(flight, FinishReason.OVERLOAD, now, "sidecar queue full")
            return
        deadline = spec.arrival_s + spec.deadline_s if spec.deadline_s > 0 else 0.0
        wait = queue_wait_s(self._policy(), resumed)
        if not resumed:
            wait, deadline = self._patience_left(flight, now), 0.0
        flight.enqueue(now)
        self._where[flight.rid] = sidecar.index
        queued = queued_request(
            flight.rid, spec.priority, prompt, arrived_at=now, now=now, max_wait_s=wait,
            deadline_at=deadline, resumed=resumed, charge=sidecar.charge_for(flight, prompt, now),
        )  # fmt: skip
        sidecar.queue.offer(queued, flight)
        self._admit(sidecar, now)

    def _decision(
        self, sidecar: Sidecar, flight: SimFlight, prompt_tokens: int, *, held: bool = False
    ) -> AdmissionDecision:
        policy = self._policy()
        target_tpot_s = tpot_gate_s(policy.scheduling, sidecar.role)
        return decide_admission(
            sidecar.outlook(flight), prompt_tokens, sidecar.pool(target_tpot_s > 0.0),
            policy.kv, held=held, target_tpot_s=target_tpot_s,
        )  # fmt: skip

    def _admit(self, sidecar: Sidecar, now: float) -> None:
        """The sidecar's queue, by the live ledger's discipline (`AdmissionQueue`)."""
        if not len(sidecar.queue) or not self.sim.engines[sidecar.index].alive:
            return
        sim = self.sim
        for _, flight in sidecar.queue.expire(now):
            self._where.pop(flight.rid, None)
            self._wait_over(flight, now)
        decisions: dict[str, AdmissionDecision] = {}

        def decide(queued: QueuedRequest, flight: SimFlight) -> AdmissionVerdict:
            decision = self._decision(sidecar, flight, queued.prompt_tokens)
            decisions[queued.rid] = decision
            return decision.verdict

        sidecar.stalled_at = now
        for queued, flight, verdict in sidecar.queue.pump(now, decide):
            sidecar.stalled_at = -1.0
            decision = decisions[queued.rid]
            if verdict is AdmissionVerdict.REFUSE:
                self._where.pop(flight.rid, None)
                # A request that can never fit is refused; a continuation that no longer
                # fits (it grew) has nowhere to go and ends as aborted.
                ending = FinishReason.ABORTED if flight.generated else FinishReason.OVERLOAD
                sim.end(flight, ending, now, f"sidecar: {decision.reason}")
                continue
            self._enter(sidecar, flight, queued.prompt_tokens, queued.priority, decision, now)

    def _wait_over(self, flight: SimFlight, now: float) -> None:
        """A request waited in a sidecar's queue as long as it may. A new one is refused
        (its client's patience is spent). A resume is accepted work and goes back to its
        router, as the live sidecar answers it: one preempted here is handed back, one
        the router placed here is refused (429), and the router places it again."""
        role = self._role(flight)
        if flight.rid in self._in_place:
            self._in_place.discard(flight.rid)
            self._hand_back(flight, now, broken=False)
        elif flight.generated:
            router = self.routers[role]
            self._deliver(role, router.refused(flight.rid, now, self._snapshot(now, role)))
            self._mark_waiting(role, flight, now)
        else:
            self.sim.end(flight, FinishReason.OVERLOAD, now, "sidecar queue wait exceeded")

    def _enter(
        self,
        sidecar: Sidecar,
        flight: SimFlight,
        prompt_tokens: int,
        priority: int,
        decision: AdmissionDecision,
        now: float,
    ) -> None:
        """An admitted request goes into the engine, its KV committed here."""
        aging = self._policy().scheduling.aging_per_second
        slack = None
        if flight.spec.deadline_s > 0:
            slack = flight.spec.arrival_s + flight.spec.deadline_s - now
        engine_prio = engine_priority(priority, now - flight.spec.arrival_s, slack, aging)
        self._in_place.discard(flight.rid)
        if self.sim.submit(flight, sidecar.index, now, engine_prio):
            self._where[flight.rid] = sidecar.index
            charge = sidecar.queue.charge(sidecar.charge_for(flight, prompt_tokens, now))
            sidecar.held[flight.rid] = _Held(flight, prompt_tokens, flight.generated, charge)
            sidecar.used_tokens += prompt_tokens
            sidecar.reserved_tokens += decision.needed_tokens - prompt_tokens
            if prompt_tokens >= LONG_PROMPT_TOKENS:
                # Seconds of prefill just landed here: tell the routers now, not at
                # the next heartbeat, so short requests go elsewhere meanwhile.
                self._heartbeat(sidecar, now)

    # -- room held for migrations -----------------------------------------------------------
    def _reserve_target(
        self, victim: VictimChoice, targets: TargetRooms, now: float
    ) -> tuple[str, str] | None:
        """(target, reservation id) of the first peer, in `targets`' order, that holds
        room for the victim's continuation (a dead one answers nothing); None when none
        does."""
        while (target := targets.pick(victim.tokens)) is not None:
            peer = self.sidecars[int(target.rsplit("-", 1)[1])]
            self.sim.interrupt(peer.index)  # its room held may expire or be taken
            granted = None
            if self.sim.engines[peer.index].alive:
                peer.reservations.expire(now)
                if 0 < victim.tokens <= peer.room_tokens():
                    granted = peer.reservations.take(
                        victim.rid, victim.tokens, now, RESERVATION_TTL_S
                    )
            targets.answered(target, victim.tokens, granted is not None, peer.room_tokens())
            if granted is not None:
                self._held_changed(peer, now)
                self.sim.at(granted.expires_at, functools.partial(self._expire_held, peer))
                return target, granted.reservation_id
        return None

    def _consume(self, sidecar: Sidecar, flight: SimFlight, now: float) -> bool:
        """Whether room was held here for the flight (now released to its admission)."""
        target, reservation = flight.target, flight.reservation
        flight.target = flight.reservation = ""
        if target != sidecar.endpoint_id:
            return False
        sidecar.reservations.expire(now)
        if sidecar.reservations.consume(reservation, flight.rid) is None:
            return False
        self._held_changed(sidecar, now)
        return True

    def _expire_held(self, sidecar: Sidecar) -> None:
        now = self.sim.now
        if sidecar.reservations.expire(now):
            self._held_changed(sidecar, now)
            self._admit(sidecar, now)

    def _held_changed(self, sidecar: Sidecar, now: float) -> None:
        """Room held changed: re-evaluated and published at once, as the live ledger does."""
        self.sim.interrupt(sidecar.index)
        sidecar.watermark = classify_watermark(
            sidecar.usage(), sidecar.watermark, self._policy().kv
        )
        self._heartbeat(sidecar, now)

    def before_step(self, engine: int, now: float) -> None:
        self._admit(self.sidecars[engine], now)

    def quiet_until(self, engine: int, now: float) -> float:
        """Below the pressure watermark, the sidecar does nothing at an iteration until
        its next KV account: its watermark, classified again from the same account,
        stays (a change comes from an admission, a release or room held, which
        interrupt the engine), and its admission has nobody to admit — nothing queued,
        or a queue its pump just let nothing out of, until the queue's rule says that
        may change (`AdmissionQueue.settled_until`: with what the decisions read
        unchanged, which the same interruptions guarantee)."""
        sidecar = self.sidecars[engine]
        if sidecar.watermark.rank >= WatermarkState.PRESSURE.rank:
            return now
        until = sidecar.accounted_at + self._engine_poll_s - ACCOUNT_MARGIN_S
        if len(sidecar.queue):
            if sidecar.stalled_at != now:
                return now
            until = min(until, sidecar.queue.settled_until() - ACCOUNT_MARGIN_S)
        return until

    def after_step(self, engine: int, now: float) -> None:
        sidecar = self.sidecars[engine]
        # The sidecar re-derives its KV account at its engine-poll rhythm, not every
        # iteration; admissions and releases adjust it in between.
        if now - sidecar.accounted_at >= self._engine_poll_s:
            sidecar.account()
            sidecar.accounted_at = now
            # The live sidecar's poll reads this from the engine's load report too.
            sidecar.engine_waiting = len(self.sim.engines[engine].model.waiting)
        previous = sidecar.watermark
        sidecar.watermark = classify_watermark(sidecar.usage(), previous, sidecar.policy.kv)
        if sidecar.watermark.rank >= WatermarkState.PRESSURE.rank:
            self._relieve(sidecar, now)
        else:
            sidecar.admission_paused = False
        if sidecar.watermark is not previous:
            self._heartbeat(sidecar, now)  # a watermark change is published at once

    def _relieve(self, sidecar: Sidecar, now: float) -> None:
        policy = self._policy()
        # Relief reads its candidates only when a rung needs them (near-done requests at
        # critical, victims at exhaustion): below that, predicting every running
        # request's length for them was most of a long run's time.
        candidates = _OnDemand(functools.partial(self._victim_candidates, sidecar))
        # The room elsewhere, from what the other sidecars last published (the live
        # sidecar reads the same from the control plane).
        peers = [
            v.state
            for i, v in self._views.items()
            if i != sidecar.index and v.state.role is sidecar.role and v.lease_deadline > now
        ]
        rooms = peer_rooms(peers, policy.kv)
        costs = self._costs
        if costs is not None:
            on_host = sidecar.host_held()
            costs = replace(costs, host_room_tokens=max(0, costs.host_room_tokens - on_host))
        usage = sidecar.usage()
        plan = plan_relief(usage, sidecar.watermark, candidates, policy, now, rooms, costs)
        sidecar.admission_paused = plan.admission_paused
        targets = TargetRooms(rooms)
        for victim in plan.victims:
            mode: Rung | None = victim.mode
            held_at = None
            if mode is Rung.MIGRATE:
                held_at = self._reserve_target(victim, targets, now)
                if held_at is None:
                    mode = victim.fallback
            if mode is None:
                continue  # no peer held room for it, and it cannot resume in place
            flight = sidecar.held[victim.rid].flight
            self._release(sidecar, flight, now)
            self.sim.withdraw(flight, now)
            # What its continuation computes again is known when it resumes: its history
            # less what a prefix cache (device or host) gives back there.
            flight.resume_tokens = flight.spec.input_tokens + flight.generated
            if held_at is not None:
                flight.preempted("migrate")
                flight.target, flight.reservation = held_at
                self._hand_back(flight, now, broken=False)
            elif mode in (Rung.RECOMPUTE, Rung.OFFLOAD):
                flight.preempted(mode.value)
                if mode is Rung.OFFLOAD:
                    sidecar.offloaded[flight.rid] = (flight, flight.resume_tokens)
                self._in_place.add(flight.rid)
                self._offer(sidecar, flight, now)
            else:
                self.sim.end(flight, FinishReason.ABORTED, now, "terminated by relief")
        if plan.victims:
            sidecar.account()

    def _victim_candidates(self, sidecar: Sidecar) -> list[VictimCandidate]:
        horizon = self._policy().kv.growth_horizon_steps
        # A victim can migrate only to another live endpoint of the same role.
        migratable = any(
            other is not sidecar and other.role is sidecar.role and slot.alive
            for other, slot in zip(self.sidecars, self.sim.engines, strict=True)
        )
        candidates = []
        for held in sidecar.held.values():
            flight = held.flight
            if flight.first_token_at < 0 or flight.stage is not Stage.ENGINE:
                continue
            spec = flight.spec
            outlook = sidecar.outlook(flight)
            candidates.append(
                VictimCandidate(
                    rid=flight.rid,
                    prompt_tokens=held.prompt_tokens,
                    generated_tokens=flight.generated,
                    max_new_tokens=spec.max_tokens,
                    predicted_total_tokens=outlook.predicted_total_tokens,
                    reserved_growth_tokens=growth_reserve(outlook, horizon),
                    priority=spec.priority,
                    deadline_at=spec.arrival_s + spec.deadline_s if spec.deadline_s else 0.0,
                    preemptions=sum(flight.preemptions.values()),
                    recomputable=True,
                    migratable=migratable,
                )
            )
        return candidates

    def _release(self, sidecar: Sidecar, flight: SimFlight, now: float) -> None:
        sidecar.release(flight.rid, now)
        self._where.pop(flight.rid, None)

    # -- endings and failures -------------------------------------------------------------
    def ended(self, flight: SimFlight, now: float) -> None:
        self.gate.release(flight, now)
        self.gate.settle(flight, now)
        self._in_place.discard(flight.rid)
        let_go = self._let_go(flight, now)
        if let_go is not None and let_go[1]:
            self._held_changed(let_go[0], now)
            self._admit(let_go[0], now)
        for role, router in self.routers.items():
            snapshot = self._pump_snapshot(now, role)
            self._deliver(role, router.finished(flight.rid, flight.generated, now, snapshot))
        index = self._where.pop(flight.rid, -1)
        if index < 0:
            return
        sidecar = self.sidecars[index]
        self.sim.interrupt(index)  # its account changes
        sidecar.queue.remove(flight.rid)
        if sidecar.release(flight.rid, now) is not None:
            sidecar.learn_latency(flight)
            if flight.completed:
                sidecar.predictor.observe(_length_key(flight.spec.tenant), flight.generated)
                if flight.generated > 1:
                    sidecar.ledger.observe_tpot(flight.tpot_s)
        if self.sim.engines[index].alive:
            sidecar.account()

    def handoff(self, flight: SimFlight, prefill_engine: int, now: float) -> None:
        """The prompt's KV reached the decode side: the prefill sidecar lets go of it, the
        credit is consumed, and the decode engine picked when the pair started takes it
        into the room its sidecar held. (One that died meanwhile broke the leg: the
        decode pool's router resumes it elsewhere.)"""
        sidecar = self.sidecars[prefill_engine]
        sidecar.learn_latency(flight)  # its TTFT: the prefill side's only measure
        self._release(sidecar, flight, now)
        sidecar.account()
        # The transfer ends after the engine let the request go, so no iteration of an
        # engine left idle would look at the queue the freed KV can now admit from.
        self._admit(sidecar, now)
        self.gate.settle(flight, now)
        # The prefill pool's router is done with it (its charge settled); the decode
        # pool's has had it since the pair started.
        prefill = self.routers[Role.PREFILL]
        self._deliver(
            Role.PREFILL,
            prefill.finished(flight.rid, flight.generated, now, self._snapshot(now, Role.PREFILL)),
        )
        let_go = self._let_go(flight, now)
        assert let_go is not None, "a prefill runs only once its pair holds decode room"
        decode = let_go[0]
        if not self.sim.engines[decode.index].alive:
            self._hand_back(flight, now, broken=True)
            return
        prompt = flight.spec.input_tokens + flight.generated
        decision = self._decision(decode, flight, prompt, held=True)
        self._enter(decode, flight, prompt, flight.spec.priority, decision, now)
        self._held_changed(decode, now)

    def engine_failed(self, engine: int, flights: list[SimFlight], now: float) -> None:
        sidecar = self.sidecars[engine]
        lease = LEASE_HEARTBEATS * self.staleness.heartbeat_period_s
        self.sim.at(now + lease, lambda: self._membership_changed(self.sim.now))
        stranded = [*flights, *(f for _, f in sidecar.queue.entries())]
        for flight in stranded:
            sidecar.queue.remove(flight.rid)
        for rid in list(sidecar.held):
            sidecar.release(rid, now)
        self.index.forget(sidecar.endpoint_id)
        for flight in stranded:
            self._where.pop(flight.rid, None)
            flight.preempted("failover")
            self._hand_back(flight, now, broken=True)


class _OnDemand(Sequence[VictimCandidate]):
    """A sequence built by `build` the first time anything reads it."""

    def __init__(self, build: Callable[[], list[VictimCandidate]]) -> None:
        self._build: Callable[[], list[VictimCandidate]] | None = build
        self._items: list[VictimCandidate] = []

    def _all(self) -> list[VictimCandidate]:
        if self._build is not None:
            self._items, self._build = self._build(), None
        return self._items

    @overload
    def __getitem__(self, index: int) -> VictimCandidate: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[VictimCandidate]: ...
    def __getitem__(self, index: int | slice) -> VictimCandidate | Sequence[VictimCandidate]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[VictimCandidate]:
        return iter(self._all())


def _block_hashes(flight: SimFlight) -> tuple[int, ...]:
    """The prompt's full blocks (the workloads' block ids are its chained hashes)."""
    spec = flight.spec
    return spec.block_ids[: spec.input_tokens // BLOCK_TOKENS]
