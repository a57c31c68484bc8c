"""Weir's real policy code driving the simulated fleet.

Router (`controlplane.routing`, `controlplane.ownership`): the prompt's primary and
secondary owners on the consistent-hash ring (rebuilt when a lease lapses); the default
scheduling profile (filters → weighted
cost-model scorers → max-score picker) over a `PoolSnapshot` built from the sidecars'
heartbeats, as stale as the heartbeat period plus the change-feed delay; the router's own
in-flight counts since each endpoint's last visible heartbeat; the approximate
`PrefixIndex`; and the tenant-fair `FairQueue` for requests no endpoint may take now.

Sidecar (`engine_sidecar.policy`), one per engine: growth-reserve admission
(`decide_admission`) over the KV its requests hold plus the growth the running ones are
predicted to add (`OutputLengthPredictor`, or the client's hint); the bounded local queue
by the live ledger's own discipline (`AdmissionQueue`: no overtaking, priority with aging,
resumes one class ahead and never refused for a full queue; held equal to the ledger by
tests/fleetsim/test_orchestration_parity.py); engine priority from urgency (`engine_priority`);
watermarks with hysteresis (`classify`) published with every heartbeat and at once on a
change; and the relief ladder (`plan_relief`): at exhaustion, victims are migrated (a
continuation re-routed by the router, excluding this endpoint), offloaded (resumed in
place from the engine's host tier) or recomputed in place. On engines with a host tier
the choice is relief's cost comparison (`ReliefCosts` from the engines' roofline, the
host room less what this sidecar's offloads not yet resumed hold).

Router gate (`fleetsim.sim.gate`): tenant quotas, when the pool policy declares tenants,
and on a disaggregated fleet a decode handoff credit before a prefill is admitted, both
by the control plane's pure rules (`controlplane.contract.quota_rules`, `credit_rules`)
and refused as the gateway refuses (429 with the limit as reason and Retry-After). A
client with a maximum wait of its own retries after Retry-After while that wait lasts; an
interactive one takes the refusal.

P/D: sidecars publish their engine's role; the prefill is routed over the prefill
endpoints, and when its KV has moved, the decode over the decode endpoints, by the same
profile (its role filter and transfer term). The decode class's credit budget comes from
what the decode sidecars last published (`credit_rules.decode_budget`): the room each
routable endpoint's sidecar would admit, summed for the class cap, and the largest one
as the bound on a single credit (a handoff lands on one engine); the decode side
consumes a credit when the handoff arrives.

Engines run with Weir's engine flags (priority scheduling with aging, prefill yielding at
chunk boundaries, mixed prefill/decode iterations with a prefill time budget), as the
operator renders them from the pool spec. When an engine dies,
the router, which holds every stream, re-routes what it had in flight as continuations.

Not modelled: KV token-second quotas (the sidecar's charge).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from controlplane.contract import (
    CacheIdentity,
    EndpointState,
    FinishReason,
    PoolPolicy,
    Role,
    WatermarkState,
)
from controlplane.contract.credit_rules import decode_budget
from controlplane.ownership import Membership, OwnershipRing, prefix_key
from controlplane.routing import (
    SATURATION,
    FairQueue,
    InFlight,
    PoolSnapshot,
    PrefixIndex,
    Profile,
    QueueFullError,
    RouteRequest,
    RoutingContext,
    default_config,
    profile_from_config,
    service_correction,
    service_estimate,
)
from controlplane.routing.snapshot import EndpointView
from engine_sidecar.ledger import Ledger
from engine_sidecar.policy import (
    AdmissionDecision,
    AdmissionQueue,
    AdmissionVerdict,
    KVUsage,
    LengthKey,
    OutputLengthPredictor,
    PoolOutlook,
    QueuedRequest,
    ReliefCosts,
    Rung,
    SequenceOutlook,
    VictimCandidate,
    classify,
    decide_admission,
    engine_priority,
    growth_reserve,
    peer_room,
    plan_relief,
)
from fleetsim.engine import EngineConfig
from fleetsim.sim.config import MODEL, FleetConfig
from fleetsim.sim.flight import Flight, Stage
from fleetsim.sim.gate import HOLDER_TTL_MS, Refusal, RouterGate
from fleetsim.sim.loop import Simulation
from fleetsim.workloads import BLOCK_TOKENS, prompt_token_ids

# A lease lapses after this many missed heartbeats.
LEASE_HEARTBEATS = 3
# Weir's engine flags bound one iteration's prefill work so decodes keep flowing beside a
# long prompt (SGLang: --enable-mixed-chunk and a smaller chunk).
PREFILL_TIME_BUDGET_S = 0.05
# Admitting a prompt this long publishes the sidecar's state at once.
LONG_PROMPT_TOKENS = 4096
# A continuation (already streaming) waits for a new endpoint at most this long.
CONTINUATION_MAX_WAIT_S = 600.0
# A patient client retries a 503 without Retry-After after this long.
CLIENT_BACKOFF_S = 1.0
# The router renews its quota holder lease at a third of its time to live, as
# `QuotaGate.keep_lease` does.
HOLDER_RENEW_S = HOLDER_TTL_MS / 3000


@dataclass(slots=True)
class _Held:
    """What the sidecar knows about one request it admitted into its engine."""

    flight: Flight
    prompt_tokens: int
    generated_at_admission: int


@dataclass(slots=True)
class Sidecar:
    index: int
    endpoint_id: str
    capacity_tokens: int
    policy: PoolPolicy
    clock: Callable[[], float]
    role: Role = Role.MIXED
    # The live sidecar's ledger, for its output-length predictor and its TPOT estimate
    # (smoothed over finished requests, published as `predicted_tpot_s`); the simulator
    # keeps its own KV account below, on the virtual clock.
    ledger: Ledger = field(init=False)
    queue: AdmissionQueue[Flight] = field(init=False)
    held: dict[str, _Held] = field(default_factory=dict)
    watermark: WatermarkState = WatermarkState.NORMAL
    admission_paused: bool = False
    used_tokens: int = 0
    reserved_tokens: int = 0
    accounted_at: float = -1e9
    version: int = 0
    # Offloaded victims not yet back in the engine, with the KV each left in its host tier.
    offloaded: dict[str, tuple[Flight, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.policy, self.capacity_tokens, self.clock)
        sched = self.policy.scheduling
        self.queue = AdmissionQueue(sched.local_queue_size, sched.aging_per_second)

    @property
    def predictor(self) -> OutputLengthPredictor:
        return self.ledger.predictor

    def predicted_total(self, flight: Flight) -> int:
        spec = flight.spec
        if spec.output_hint_tokens > 0:
            return max(flight.generated + 1, min(spec.max_tokens, spec.output_hint_tokens))
        return self.predictor.predict_total(
            LengthKey(spec.tenant, MODEL),
            self.policy.kv.growth_quantile,
            flight.generated,
            spec.max_tokens,
        )

    def outlook(self, flight: Flight) -> SequenceOutlook:
        return SequenceOutlook(
            flight.generated, flight.spec.max_tokens, self.predicted_total(flight)
        )

    def account(self) -> None:
        """KV held (prompt not served from cache + generated) and reserved growth of the
        requests in the engine, from the sidecar's own streamed-token accounting."""
        horizon = self.policy.kv.growth_horizon_steps
        used = reserved = 0
        for held in self.held.values():
            flight = held.flight
            cached = max(0, flight.visit_cached)
            used += held.prompt_tokens - cached + flight.generated - held.generated_at_admission
            reserved += growth_reserve(self.outlook(flight), horizon)
        self.used_tokens = used
        self.reserved_tokens = reserved

    def usage(self) -> KVUsage:
        return KVUsage(self.capacity_tokens, self.used_tokens, self.reserved_tokens)

    def host_held(self) -> int:
        """KV its offloads left in the host tier and have not loaded back yet."""
        for rid, (flight, _) in list(self.offloaded.items()):
            if flight.done or flight.stage is Stage.ENGINE:
                del self.offloaded[rid]
        return sum(tokens for _, tokens in self.offloaded.values())


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
    )


class WeirPolicy:
    name = "weir"

    def __init__(self, policy: PoolPolicy | None = None) -> None:
        self.pool_policy = policy
        self._sim: Simulation | None = None
        self.sidecars: list[Sidecar] = []
        self.profile: Profile | None = None
        self.index = PrefixIndex()
        # One router per pool: a P/D fleet is a prefill pool and a decode pool, each with
        # its own snapshot, ownership ring and queue (a colocated fleet has one, MIXED).
        self.queues: dict[Role, FairQueue[Flight]] = {}
        self.rings: dict[Role, OwnershipRing] = {}
        self._snapshots: dict[Role, PoolSnapshot] = {}
        self._states: dict[int, EndpointState] = {}
        self._leases: dict[int, float] = {}
        # Each pool's router's dispatches not yet shown by a report, as the gateway's;
        # and where each request was last dispatched.
        self.inflight: dict[Role, InFlight] = {}
        self._sent_to: dict[str, tuple[Role, str]] = {}
        self._where: dict[str, int] = {}
        self._excluded: dict[str, set[str]] = {}
        self._queued: dict[str, Flight] = {}
        self._owner_cache: dict[str, tuple[Role, int, tuple[str, ...]]] = {}
        self._gate: RouterGate | None = None
        self._costs: ReliefCosts | None = None

    @property
    def sim(self) -> Simulation:
        assert self._sim is not None, "start() first"
        return self._sim

    @property
    def gate(self) -> RouterGate:
        assert self._gate is not None, "start() first"
        return self._gate

    def tune(self, config: EngineConfig, fleet: FleetConfig) -> EngineConfig:
        """Weir's engine flags: priority scheduling with aging, prefill yielding, mixed
        prefill/decode iterations with a bounded prefill time per iteration."""
        policy = self.pool_policy or fleet.policy
        return config.replace(
            enable_priority_scheduling=True,
            priority_aging_s=1.0 / max(1e-9, policy.scheduling.aging_per_second),
            prefill_yield=True,
            enable_mixed_chunk=True,
            prefill_time_budget_s=PREFILL_TIME_BUDGET_S,
        )

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
        self.profile = profile_from_config(config)
        self._costs = relief_costs(sim.engine_config)
        self.sidecars = [
            Sidecar(
                e.index, f"engine-{e.index}", e.capacity_tokens, policy, lambda: sim.now, e.role
            )
            for e in sim.engines
        ]
        self._gate = RouterGate(
            policy, timing.model.kv_bytes_per_token, credits=sim.config.disaggregated
        )
        sim.every(HOLDER_RENEW_S, self.gate.renew)
        vnodes = policy.routing.virtual_nodes  # as the gateway's `RingOwners`
        for role in dict.fromkeys(s.role for s in self.sidecars):
            self.inflight[role] = InFlight()
            self.queues[role] = FairQueue(max_wait_s=CONTINUATION_MAX_WAIT_S)
            members = (s.endpoint_id for s in self.sidecars if s.role is role)
            self.rings[role] = OwnershipRing(Membership.of(1, members), vnodes)
        period = sim.config.staleness.heartbeat_period_s
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
        sim = self.sim
        slot = sim.engines[sidecar.index]
        if not slot.alive:
            return
        sidecar.version += 1
        # Prompt tokens not yet prefilled: queued here, or admitted and still waiting for
        # their first token (the sidecar knows what it sent and what has streamed back).
        waiting = sum(q.prompt_tokens for q, _ in sidecar.queue.entries())
        waiting += sum(
            h.prompt_tokens - max(0, h.flight.visit_cached)
            for h in sidecar.held.values()
            if h.flight.generated == h.generated_at_admission
        )
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
            predicted_tpot_s=sidecar.ledger.tpot_s,
            kv_used_tokens=sidecar.used_tokens,
            kv_reserved_growth_tokens=sidecar.reserved_tokens,
            waiting_prefill_tokens=waiting,
            running_requests=len(sidecar.held),
            queued_requests=len(sidecar.queue),
            updated_at=now,
        )
        lease = now + LEASE_HEARTBEATS * sim.config.staleness.heartbeat_period_s
        if registered:
            self._publish(sidecar.index, state, lease, now)
            return
        delay = sim.config.staleness.notify_delay_s
        sim.at(now + delay, lambda: self._publish(sidecar.index, state, lease, now))

    def _publish(self, index: int, state: EndpointState, lease: float, taken_at: float) -> None:
        self._states[index] = state
        self._leases[index] = lease
        self.inflight[state.role].reported(state.endpoint_id, taken_at)
        self._snapshots.clear()
        now = self.sim.now
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
        self._drain(now)

    def _snapshot(self, now: float, role: Role) -> PoolSnapshot:
        """`role`'s pool as the router sees it."""
        snapshot = self._snapshots.get(role)
        if snapshot is None:
            views = tuple(
                EndpointView(state, self._leases[i])
                for i, state in sorted(self._states.items())
                if state.role is role
            )
            snapshot = self._snapshots[role] = PoolSnapshot(
                self._policy().pool, views, taken_at=now
            )
        return snapshot

    def _context(self, now: float, role: Role) -> RoutingContext:
        """What the router of `role`'s pool sees."""
        inflight = self.inflight[role]
        return RoutingContext(
            self._snapshot(now, role), now, inflight.counts, inflight.total, self.index
        )

    # -- the router -------------------------------------------------------------------------
    def arrive(self, flight: Flight, now: float) -> None:
        refusal = self.gate.admit(flight, now)
        if refusal is not None:
            self._refused(flight, refusal, now)
            return
        self._dispatch(flight, now)

    def _dispatch(self, flight: Flight, now: float) -> None:
        if self.queues[self._role(flight)].waiting_at_or_above(flight.spec.priority):
            self._enqueue(flight, now)  # never jump the queue of one's own class
            self._drain(now)
            return
        refusal = self._route(flight, now, frozenset())
        if not refusal:
            self._charge(flight)
        elif refusal in SATURATION:
            self._enqueue(flight, now)
        else:  # nothing could serve it, full or not: the gateway answers 503
            self._refused(flight, Refusal(503, refusal, 1.0), now)

    def _charge(self, flight: Flight) -> None:
        """Charge the tenant's counter in its router's fair queue once per request, as
        the gateway does on dispatch (`service_estimate`; settled when it ends)."""
        if not flight.charged_in:
            role = self._role(flight)
            self.queues[role].charge(
                flight.spec.tenant,
                service_estimate(flight.spec.input_tokens, flight.spec.max_tokens),
            )
            flight.charged_in = role.value

    def _refused(self, flight: Flight, refusal: Refusal, now: float) -> None:
        """The gateway's answer reaches the client: a patient one (its own maximum wait)
        sends the request again after Retry-After while that wait lasts."""
        spec = flight.spec
        delay = refusal.retry_after_s if refusal.retry_after_s is not None else CLIENT_BACKOFF_S
        if refusal.retryable and now + delay < spec.arrival_s + spec.max_wait_s:
            flight.retries += 1
            self.sim.at(now + delay, lambda: self._retry(flight))
            return
        ending = FinishReason.OVERLOAD if refusal.retryable else FinishReason.ERROR
        self.sim.end(flight, ending, now, f"router: {refusal.status} {refusal.reason}")

    def _retry(self, flight: Flight) -> None:
        if not flight.done:
            self.arrive(flight, self.sim.now)

    def _role(self, flight: Flight) -> Role:
        """Where the flight goes next: a fresh request prefills on a P/D fleet's prefill
        side; a handed-off one, or a continuation, goes to the decode side."""
        if not self.sim.config.disaggregated:
            return Role.MIXED
        return Role.DECODE if flight.kv_ready or flight.generated else Role.PREFILL

    def _route(self, flight: Flight, now: float, exclude: frozenset[str]) -> str:
        """Place the flight on an endpoint's sidecar; "" when placed, else the refusal."""
        spec = flight.spec
        assert self.profile is not None
        full = spec.input_tokens // BLOCK_TOKENS
        role = self._role(flight)
        deadline = 0.0
        if spec.deadline_s > 0:
            deadline = max(1e-3, spec.arrival_s + spec.deadline_s - now)
        request = RouteRequest(
            request_id=spec.request_id,
            model=MODEL,
            prompt_tokens=spec.input_tokens + flight.generated,
            max_new_tokens=spec.max_tokens - flight.generated,
            tenant=spec.tenant,
            role=role,
            priority=spec.priority,
            deadline_s=deadline,
            waited_s=now - spec.arrival_s,
            block_hashes=spec.block_ids[:full],
            owners=self._owners(flight, role),
            exclude=exclude,
        )
        # A continuation (it has streamed) is routed as the router routes a resume.
        decide = self.profile.decide_resume if flight.generated else self.profile.decide
        while True:
            decision = decide(request, self._context(now, role))
            if not decision.endpoint_id:
                return decision.refusal
            index = int(decision.endpoint_id.rsplit("-", 1)[1])
            if self.sim.engines[index].alive:
                break
            # Its lease has not lapsed yet but the connection is refused: try the others.
            request = replace(request, exclude=request.exclude | {decision.endpoint_id})
        self.index.record(decision.endpoint_id, request.block_hashes)
        self._unsent(flight.rid)  # a continuation leaves where it was, as a release
        self.inflight[role].add(decision.endpoint_id, flight.rid, now)
        self._sent_to[flight.rid] = (role, decision.endpoint_id)
        flight.accepted = True
        self._offer(self.sidecars[index], flight, now)
        return ""

    def _unsent(self, rid: str) -> None:
        """The request left the endpoint it was last sent to (the gateway's release)."""
        sent = self._sent_to.pop(rid, None)
        if sent is not None:
            self.inflight[sent[0]].remove(sent[1], rid)

    def _owners(self, flight: Flight, role: Role) -> tuple[str, ...]:
        """Primary and secondary owner of the prompt's prefix key on the current ring of
        the pool, keyed from the prompt's first tokens exactly as the gateway keys it."""
        rid, ring = flight.rid, self.rings[role]
        cached = self._owner_cache.get(rid)
        if cached is not None and cached[:2] == (role, ring.version):
            return cached[2]
        routing = self._policy().routing
        head = prompt_token_ids(flight.spec)[: routing.prefix_blocks_for_owner * BLOCK_TOKENS]
        key = prefix_key(
            CacheIdentity(model=MODEL),
            head,
            routing.prefix_block_tokens,
            routing.prefix_blocks_for_owner,
        )
        owners = tuple(o for o in ring.owners(key) if o)
        self._owner_cache[rid] = (role, ring.version, owners)
        return owners

    def _membership_changed(self, now: float) -> None:
        """A lapsed lease (a dead engine) leaves its pool's ring: a new membership version."""
        for role, ring in self.rings.items():
            live = [
                s.endpoint_id
                for s in self.sidecars
                if s.role is role and self.sim.engines[s.index].alive
            ]
            self.rings[role] = OwnershipRing(Membership.of(ring.version + 1, live), ring.vnodes)

    def _enqueue(self, flight: Flight, now: float) -> None:
        spec = flight.spec
        try:
            self.queues[self._role(flight)].offer(
                spec.request_id,
                spec.tenant,
                spec.priority,
                service_estimate(spec.input_tokens, spec.max_tokens),
                now,
                flight,
            )
        except QueueFullError as exc:
            self.sim.end(flight, FinishReason.OVERLOAD, now, f"router queue full: {exc}")
            return
        flight.accepted = True
        flight.enqueue(now)
        self._queued[spec.request_id] = flight

    def give_up_at(self, flight: Flight) -> float:
        """When a request that has not started yet is refused with `overload` instead of
        waiting on: its client's patience (`max_wait_s`), else the pool's local-queue
        wait, counted from arrival. A continuation already streaming is never refused."""
        spec = flight.spec
        if flight.generated:
            return spec.arrival_s + CONTINUATION_MAX_WAIT_S
        wait = spec.max_wait_s or self._policy().scheduling.local_queue_max_wait_s
        return spec.arrival_s + wait

    def _drain(self, now: float) -> None:
        sim = self.sim
        for flight in [f for f in self._queued.values() if self.give_up_at(f) <= now]:
            sim.end(flight, FinishReason.OVERLOAD, now, "router queue wait exceeded")
        for queue in self.queues.values():
            for expired in queue.expire(now):
                detail = "continuation found no endpoint"
                sim.end(expired.payload, FinishReason.ABORTED, now, detail)
            while (entry := queue.peek()) is not None:
                flight = entry.payload
                exclude = frozenset(self._excluded.get(flight.rid, ()))
                if self._route(flight, now, exclude):
                    break
                # Dispatched (it may even have ended already): out of the queue, and its
                # tenant is charged for the service, as `FairQueue.pop` would.
                queue.remove(entry.key)
                self._queued.pop(entry.key, None)
                self._charge(flight)

    def _reroute(self, flight: Flight, away_from: int, now: float) -> None:
        """A continuation (migration or failover): anywhere but where it was."""
        excluded = self._excluded.setdefault(flight.rid, set())
        excluded.add(self.sidecars[away_from].endpoint_id)
        role = self._role(flight)
        if len(excluded) >= sum(1 for s in self.sidecars if s.role is role):
            excluded.clear()
            excluded.add(self.sidecars[away_from].endpoint_id)
        if self._route(flight, now, frozenset(excluded)):
            self._enqueue(flight, now)

    # -- the sidecars ----------------------------------------------------------------------
    def _offer(self, sidecar: Sidecar, flight: Flight, now: float) -> None:
        # A continuation is accepted work: a full queue takes it all the same.
        if sidecar.queue.refuses(resumed=bool(flight.generated)):
            self.sim.end(flight, FinishReason.OVERLOAD, now, "sidecar queue full")
            return
        spec = flight.spec
        flight.enqueue(now)
        self._where[flight.rid] = sidecar.index
        sidecar.queue.offer(
            QueuedRequest(
                flight.rid,
                spec.priority,
                now,
                self.give_up_at(flight),
                spec.input_tokens + flight.generated,
                resumed=bool(flight.generated),
            ),
            flight,
        )
        self._admit(sidecar, now)

    def _admit(self, sidecar: Sidecar, now: float) -> None:
        """The sidecar's queue, by the live ledger's discipline (`AdmissionQueue`)."""
        if not len(sidecar.queue) or not self.sim.engines[sidecar.index].alive:
            return
        sim, policy = self.sim, self._policy()
        aging = policy.scheduling.aging_per_second
        for _, flight in sidecar.queue.expire(now):
            self._where.pop(flight.rid, None)
            if flight.generated:
                sim.end(flight, FinishReason.ABORTED, now, "continuation waited too long")
            else:
                sim.end(flight, FinishReason.OVERLOAD, now, "sidecar queue wait exceeded")
        decisions: dict[str, AdmissionDecision] = {}

        def decide(queued: QueuedRequest, flight: Flight) -> AdmissionVerdict:
            pool = PoolOutlook(
                sidecar.capacity_tokens,
                sidecar.used_tokens,
                sidecar.reserved_tokens,
                sidecar.watermark,
                admission_open=not sidecar.admission_paused,
            )
            decision = decide_admission(
                sidecar.outlook(flight), queued.prompt_tokens, pool, policy.kv
            )
            decisions[queued.rid] = decision
            return decision.verdict

        for queued, flight, verdict in sidecar.queue.pump(now, decide):
            decision = decisions[queued.rid]
            if verdict is AdmissionVerdict.REFUSE:
                self._where.pop(flight.rid, None)
                # A request that can never fit is refused; a continuation that no longer
                # fits (it grew) has nowhere to go and ends as aborted.
                ending = FinishReason.ABORTED if flight.generated else FinishReason.OVERLOAD
                sim.end(flight, ending, now, f"sidecar: {decision.reason}")
                continue
            slack = None
            if flight.spec.deadline_s > 0:
                slack = flight.spec.arrival_s + flight.spec.deadline_s - now
            priority = engine_priority(queued.priority, now - flight.spec.arrival_s, slack, aging)
            if sim.submit(flight, sidecar.index, now, priority):
                self._where[flight.rid] = sidecar.index
                sidecar.held[flight.rid] = _Held(flight, queued.prompt_tokens, flight.generated)
                sidecar.used_tokens += queued.prompt_tokens
                sidecar.reserved_tokens += decision.needed_tokens - queued.prompt_tokens
                if queued.prompt_tokens >= LONG_PROMPT_TOKENS:
                    # Seconds of prefill just landed here: tell the routers now, not at
                    # the next heartbeat, so short requests go elsewhere meanwhile.
                    self._heartbeat(sidecar, now)

    def before_step(self, engine: int, now: float) -> None:
        self._admit(self.sidecars[engine], now)

    def after_step(self, engine: int, now: float) -> None:
        sidecar = self.sidecars[engine]
        # The sidecar re-derives its KV account at its engine-poll rhythm, not every
        # iteration; admissions and releases adjust it in between.
        if now - sidecar.accounted_at >= self.sim.config.staleness.engine_poll_s:
            sidecar.account()
            sidecar.accounted_at = now
        previous = sidecar.watermark
        policy = self._policy()
        sidecar.watermark = classify(sidecar.usage(), previous, policy.kv)
        if sidecar.watermark.rank >= WatermarkState.PRESSURE.rank:
            self._relieve(sidecar, now)
        else:
            sidecar.admission_paused = False
        if sidecar.watermark is not previous:
            self._heartbeat(sidecar, now)  # a watermark change is published at once

    def _relieve(self, sidecar: Sidecar, now: float) -> None:
        policy = self._policy()
        horizon = policy.kv.growth_horizon_steps
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
        # The room elsewhere, from what the other sidecars last published (the live
        # sidecar reads the same from the control plane).
        peers = [
            state
            for i, state in self._states.items()
            if i != sidecar.index and state.role is sidecar.role and self._leases[i] > now
        ]
        room = peer_room(peers, policy.kv)
        costs = self._costs
        if costs is not None:
            on_host = sidecar.host_held()
            costs = replace(costs, host_room_tokens=max(0, costs.host_room_tokens - on_host))
        plan = plan_relief(sidecar.usage(), sidecar.watermark, candidates, policy, now, room, costs)
        sidecar.admission_paused = plan.admission_paused
        for victim in plan.victims:
            flight = sidecar.held[victim.rid].flight
            self._release(sidecar, flight)
            self.sim.withdraw(flight, now)
            # What its continuation computes again is known when it resumes: its history
            # less what a prefix cache (device or host) gives back there.
            flight.resume_tokens = flight.spec.input_tokens + flight.generated
            if victim.mode is Rung.MIGRATE:
                flight.preempted("migrate")
                self._reroute(flight, sidecar.index, now)
            elif victim.mode in (Rung.RECOMPUTE, Rung.OFFLOAD):
                flight.preempted(victim.mode.value)
                if victim.mode is Rung.OFFLOAD:
                    sidecar.offloaded[flight.rid] = (flight, flight.resume_tokens)
                self._offer(sidecar, flight, now)
            else:
                self.sim.end(flight, FinishReason.ABORTED, now, "terminated by relief")
        if plan.victims:
            sidecar.account()

    def _release(self, sidecar: Sidecar, flight: Flight) -> None:
        sidecar.held.pop(flight.rid, None)
        self._where.pop(flight.rid, None)

    # -- endings and failures -------------------------------------------------------------
    def ended(self, flight: Flight, now: float) -> None:
        self.gate.release(flight, now)
        self._unsent(flight.rid)
        if flight.charged_in:  # estimate -> what it really generated, as the gateway does
            self.queues[Role(flight.charged_in)].charge(
                flight.spec.tenant, service_correction(flight.spec.max_tokens, flight.generated)
            )
        for queue in self.queues.values():
            queue.remove(flight.rid)
        self._queued.pop(flight.rid, None)
        self._excluded.pop(flight.rid, None)
        self._owner_cache.pop(flight.rid, None)
        index = self._where.pop(flight.rid, -1)
        if index < 0:
            return
        sidecar = self.sidecars[index]
        sidecar.queue.remove(flight.rid)
        if sidecar.held.pop(flight.rid, None) is not None and flight.completed:
            sidecar.predictor.observe(LengthKey(flight.spec.tenant, MODEL), flight.generated)
            if flight.generated > 1:
                sidecar.ledger.observe_tpot(flight.tpot_s)
        if self.sim.engines[index].alive:
            sidecar.account()

    def handoff(self, flight: Flight, prefill_engine: int, now: float) -> None:
        """The prompt's KV reached the decode side: the prefill sidecar lets go of it, the
        credit is consumed, and the decode is routed like a continuation."""
        sidecar = self.sidecars[prefill_engine]
        self._release(sidecar, flight)
        sidecar.account()
        # The transfer ends after the engine let the request go, so no iteration of an
        # engine left idle would look at the queue the freed KV can now admit from.
        self._admit(sidecar, now)
        self.gate.handed_off(flight, now)
        if self._route(flight, now, frozenset()):
            self._enqueue(flight, now)

    def engine_failed(self, engine: int, flights: list[Flight], now: float) -> None:
        sidecar = self.sidecars[engine]
        lease = LEASE_HEARTBEATS * self.sim.config.staleness.heartbeat_period_s
        self.sim.at(now + lease, lambda: self._membership_changed(self.sim.now))
        stranded = [*flights, *(f for _, f in sidecar.queue.entries())]
        for flight in stranded:
            sidecar.queue.remove(flight.rid)
        sidecar.held.clear()
        self.index.forget(sidecar.endpoint_id)
        for flight in stranded:
            self._where.pop(flight.rid, None)
            flight.preempted("failover")
            self._reroute(flight, engine, now)
