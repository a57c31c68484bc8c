"""The discrete-event loop: N engine models on one virtual clock, driven by a fleet policy.

Each engine is the reference engine's `EngineModel` — the scheduler `weir engine` runs —
stepped in virtual time: an iteration starts at `t`, its tokens and finishes are applied
at `t + duration`, and the next iteration starts then. Everything else (arrivals,
heartbeats, scrapes, cancellations, deadlines, engine failures) is a timed callback on one
heap, ordered by time and then by insertion, so a run is a pure function of its inputs
and seed.

P/D: on a disaggregated fleet a request is first sent to a prefill engine for its prompt
and first token only; its prompt's KV then travels to a decode engine (the transfer takes
KV bytes / link bandwidth), and the policy's `handoff` places it there, where the engine
imports the KV instead of computing it again.

The engine never learns how long an answer will be. It is asked for up to the client's
`max_tokens` (so its own admission sees what SGLang would see) and the simulator ends the
request when its natural length is reached, as the model's end-of-sequence token would.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.contract import FinishReason, Role
from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, EngineRequestError
from fleetsim.sim.config import FleetConfig
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.workloads import RequestSpec, prompt_token_ids
from fleetsim.workloads.scenarios import EngineFailure


class FleetPolicy(Protocol):
    """Routing and admission for a whole fleet: a baseline, or Weir's driver."""

    name: str

    def tune(self, config: EngineConfig, fleet: FleetConfig) -> EngineConfig:
        """The engine flags this policy runs its engines with."""

    def start(self, sim: Simulation) -> None:
        """Called once before the first event (schedule periodic work here)."""

    def arrive(self, flight: SimFlight, now: float) -> None:
        """A client request arrived: dispatch, queue or refuse it."""

    def before_step(self, engine: int, now: float) -> None:
        """The engine is about to run an iteration: admit what should go in."""

    def after_step(self, engine: int, now: float) -> None:
        """An iteration's tokens were applied: watch pressure, relieve it."""

    def ended(self, flight: SimFlight, now: float) -> None:
        """A flight ended for any reason (the policy drops its bookkeeping)."""

    def engine_failed(self, engine: int, flights: list[SimFlight], now: float) -> None:
        """The engine died with these flights on it."""

    def handoff(self, flight: SimFlight, prefill_engine: int, now: float) -> None:
        """P/D: the flight's prompt KV has reached the decode side (`flight.kv_ready`
        tokens of it); place it on a decode engine."""


@dataclass(slots=True)
class EngineSlot:
    index: int
    model: EngineModel
    role: Role = Role.MIXED
    alive: bool = True
    scheduled: bool = False
    pending: list[EngineRequest] = field(default_factory=list)
    pending_finished: list[EngineRequest] = field(default_factory=list)
    pending_retracted: list[EngineRequest] = field(default_factory=list)
    flights: dict[str, SimFlight] = field(default_factory=dict)
    step: Callable[[], None] = field(init=False)  # the loop's next iteration of it
    exhaustion_events: int = 0
    high_water_s: float = 0.0
    busy_s: float = 0.0
    peak_usage: float = 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.model.total_tokens

    @property
    def used_tokens(self) -> int:
        return self.model.kv.used_pages * self.model.page_size

    @property
    def usage(self) -> float:
        return self.used_tokens / self.model.total_tokens


@dataclass(slots=True)
class KVSample:
    at: float
    mean_usage: float
    max_usage: float


@dataclass(slots=True)
class SimResult:
    policy: str
    flights: list[SimFlight]
    engines: int
    duration_s: float
    end_s: float
    kv_samples: list[KVSample]
    exhaustion_events: int
    high_water_s: float
    engine_seconds: float
    peak_usage: float


class Simulation:
    def __init__(
        self,
        specs: Sequence[RequestSpec],
        policy: FleetPolicy,
        config: FleetConfig | None = None,
        *,
        failures: Sequence[EngineFailure] = (),
        engine_config: EngineConfig | None = None,
    ) -> None:
        self.config = config or FleetConfig()
        self.policy = policy
        self.flights = [SimFlight(spec) for spec in specs]
        self.engine_config = policy.tune(
            engine_config or engine_config_for(self.config), self.config
        )
        self.engines = [self._engine(i) for i in range(self.config.engines)]
        # Read at every iteration: looked up once, each slot's step bound once.
        self._high_watermark = self.config.policy.kv.high_watermark
        for slot in self.engines:
            slot.step = functools.partial(self._step, slot)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._open = len(self.flights)
        self.last_arrival = max((s.arrival_s for s in specs), default=0.0)
        self.horizon = self.last_arrival + self.config.drain_s
        self.kv_samples: list[KVSample] = []
        for flight in self.flights:
            self.at(flight.spec.arrival_s, functools.partial(self._arrive, flight))
        for failure in failures:
            if failure.engine < len(self.engines):
                self.at(failure.at_s, functools.partial(self._fail, failure.engine))

    def _engine(self, index: int) -> EngineSlot:
        config = self.config
        if not config.disaggregated:
            return EngineSlot(index, EngineModel(self.engine_config))
        if index < config.prefill_engines:
            return EngineSlot(index, EngineModel(self.engine_config), Role.PREFILL)
        tokens = int(self.engine_config.total_tokens * config.decode_kv_factor)
        decode = self.engine_config.replace(max_total_tokens=max(config.page_size, tokens))
        return EngineSlot(index, EngineModel(decode), Role.DECODE)

    def role_engines(self, role: Role) -> list[EngineSlot]:
        return [e for e in self.engines if e.role is role]

    # -- the clock -----------------------------------------------------------------------
    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), action))

    @property
    def active(self) -> bool:
        """Whether periodic work should keep rescheduling itself."""
        return self._open > 0 and self.now < self.horizon

    def every(self, period: float, action: Callable[[float], None], start: float = 0.0) -> None:
        """Run `action(now)` every `period` seconds while requests remain open."""

        def tick() -> None:
            action(self.now)
            if self.active:
                self.at(self.now + period, tick)

        self.at(start, tick)

    def run(self) -> SimResult:
        self.policy.start(self)
        self.every(self.config.sample_period_s, self._sample)
        heap = self._heap
        while heap and self._open > 0:
            when, _, action = heapq.heappop(heap)
            if when > self.horizon:
                break
            self.now = when
            action()
        for flight in self.flights:
            if not flight.done:
                flight.detail = "unfinished at the end of the run"
        return SimResult(
            policy=self.policy.name,
            flights=self.flights,
            engines=len(self.engines),
            duration_s=self.last_arrival,
            end_s=self.now,
            kv_samples=self.kv_samples,
            exhaustion_events=sum(e.exhaustion_events for e in self.engines),
            high_water_s=sum(e.high_water_s for e in self.engines),
            engine_seconds=sum(e.busy_s for e in self.engines),
            peak_usage=max(e.peak_usage for e in self.engines),
        )

    # -- what policies call --------------------------------------------------------------
    def alive(self) -> list[EngineSlot]:
        return [e for e in self.engines if e.alive]

    def submit(self, flight: SimFlight, engine: int, now: float, priority: int = 0) -> bool:
        """Send a flight (or its continuation) to an engine. False, with the flight ended
        as `error`, when the engine refuses it outright (too long for its context).

        A prefill engine is asked for the first token only; a flight whose prompt KV was
        handed off (`kv_ready`) imports it."""
        slot = self.engines[engine]
        if not slot.alive:
            raise RuntimeError(f"engine {engine} is down")
        spec = flight.spec
        flight.dequeue(now)
        ids = prompt_token_ids(spec)
        if flight.output_ids:
            ids.extend(flight.output_ids)
        model = slot.model
        wanted = 1 if slot.role is Role.PREFILL else spec.max_tokens - flight.generated
        try:
            req = model.make_request(
                flight.engine_rid,
                ids,
                wanted,
                ignore_eos=True,
                priority=priority,
                kv_imported=flight.kv_ready,
                now=now,
            )
        except EngineRequestError as exc:
            self.end(flight, FinishReason.ERROR, now, f"engine refused: {exc}")
            return False
        model.submit(req, now)
        flight.kv_ready = 0
        slot.flights[req.rid] = flight
        flight.stage = Stage.ENGINE
        flight.engine = engine
        flight.accepted = True
        if flight.dispatched_at < 0:
            flight.dispatched_at = now
        self._wake(slot, now)
        return True

    def withdraw(self, flight: SimFlight, now: float) -> None:
        """Take a flight off its engine (preemption, cancellation): its KV is freed at once
        and what it generated stays with the flight for a continuation."""
        if flight.stage is not Stage.ENGINE:
            return
        slot = self.engines[flight.engine]
        rid = flight.engine_rid
        slot.flights.pop(rid, None)
        if slot.alive:
            slot.model.abort(rid, now=now)
            self._wake(slot, now)
        flight.leave_engine()

    def end(self, flight: SimFlight, reason: FinishReason, now: float, detail: str = "") -> None:
        if flight.done:
            return
        self.withdraw(flight, now)
        flight.dequeue(now)
        flight.stage = Stage.DONE
        flight.reason = reason
        flight.detail = detail
        flight.finished_at = now
        self._open -= 1
        self.policy.ended(flight, now)

    # -- events --------------------------------------------------------------------------
    def _arrive(self, flight: SimFlight) -> None:
        spec, now = flight.spec, self.now
        if spec.cancel_after_s > 0:
            self.at(
                now + spec.cancel_after_s, lambda: self._client_gone(flight, FinishReason.CANCELLED)
            )
        if spec.deadline_s > 0:
            self.at(now + spec.deadline_s, lambda: self._client_gone(flight, FinishReason.DEADLINE))
        self.policy.arrive(flight, now)

    def _client_gone(self, flight: SimFlight, reason: FinishReason) -> None:
        if not flight.done:
            self.end(flight, reason, self.now, "client")

    def _fail(self, engine: int) -> None:
        slot = self.engines[engine]
        if not slot.alive:
            return
        slot.alive = False
        victims = list(slot.flights.values())
        slot.flights.clear()
        for flight in victims:
            flight.leave_engine()
        self.policy.engine_failed(engine, victims, self.now)

    def _wake(self, slot: EngineSlot, now: float) -> None:
        if not slot.scheduled and slot.alive:
            slot.scheduled = True
            self.at(now, slot.step)

    def _step(self, slot: EngineSlot) -> None:
        # `scheduled` stays set while the policy hooks run, so a submit they make does
        # not schedule a second iteration for the same instant.
        now = self.now
        if not slot.alive:
            slot.scheduled = False
            return
        self._apply(slot, now)
        self.policy.after_step(slot.index, now)
        self.policy.before_step(slot.index, now)
        model = slot.model
        result = model.step(now) if model.has_work else None
        if result is None or result.idle:
            slot.scheduled = False  # nothing runs until a submit or an abort wakes it
            return
        slot.pending = result.emitted
        slot.pending_finished = result.finished
        slot.pending_retracted = result.retracted
        if result.retracted:
            slot.exhaustion_events += 1
        slot.busy_s += result.duration
        usage = slot.usage
        if usage >= self._high_watermark:
            slot.high_water_s += result.duration
        if usage > slot.peak_usage:
            slot.peak_usage = usage
        self.at(now + result.duration, slot.step)

    def _apply(self, slot: EngineSlot, now: float) -> None:
        """The tokens and finishes of the iteration that just ended, at its end time."""
        flights = slot.flights
        for req in slot.pending_retracted:
            flight = flights.get(req.rid)
            if flight is not None:
                flight.preempted("engine_retract")
                flight.recomputed_tokens += req.total_len
        prefill = slot.role is Role.PREFILL
        for req in slot.pending:
            flight = flights.get(req.rid)
            if flight is None:
                continue  # withdrawn while the iteration ran
            out = flight.output_ids
            out.append(req.output_ids[-1])
            if flight.visit_cached < 0:
                flight.visit_cached = req.cached_tokens
                flight.cached_tokens += req.cached_tokens
                if flight.resume_tokens:
                    flight.recomputed_tokens += max(0, flight.resume_tokens - req.cached_tokens)
                    flight.resume_tokens = 0
            if flight.first_token_at < 0:
                flight.first_token_at = now
            elif flight.handoff_from >= 0:
                flight.handoff_s = now - flight.handoff_from
                flight.handoff_from = -1.0
            flight.last_token_at = now
            if len(out) >= flight.target_tokens:
                reason = (
                    FinishReason.LENGTH if len(out) >= flight.spec.max_tokens else FinishReason.STOP
                )
                self.end(flight, reason, now)
            elif prefill:
                self._transfer(slot, flight, now)
        for req in slot.pending_finished:
            flight = flights.get(req.rid)
            if flight is None or flight.done:
                continue
            finish = req.finish
            if finish is not None and finish.kind == "length":
                self.end(flight, FinishReason.LENGTH, now)
            else:
                message = finish.message if finish is not None else "no finish"
                self.end(flight, FinishReason.ERROR, now, f"engine: {message}")
        slot.pending = []
        slot.pending_finished = []
        slot.pending_retracted = []

    def _transfer(self, slot: EngineSlot, flight: SimFlight, now: float) -> None:
        """The prefill engine streamed the first token: its request is over there (the
        engine finishes it at its one-token limit) and the prompt's KV starts moving."""
        slot.flights.pop(flight.engine_rid, None)
        flight.leave_engine()
        flight.handoff_from = now
        kv_tokens = flight.spec.input_tokens
        took = self.engine_config.timing.kv_transfer_s(kv_tokens, self.config.kv_link_bytes_per_s)
        flight.transfer_s += took

        def arrived() -> None:
            if not flight.done:
                flight.kv_ready = kv_tokens
                self.policy.handoff(flight, slot.index, self.now)

        self.at(now + took, arrived)

    def _sample(self, now: float) -> None:
        alive = self.alive()
        if not alive:
            return
        usages = [e.usage for e in alive]
        self.kv_samples.append(KVSample(now, sum(usages) / len(usages), max(usages)))


def engine_config_for(config: FleetConfig) -> EngineConfig:
    """The reference engine as a stock SGLang deployment runs it (first come, first
    served); a policy's `tune` may change its flags."""
    base = EngineConfig(
        page_size=config.page_size,
        chunked_prefill_size=config.chunked_prefill_size,
        max_running_requests=config.max_running_requests,
        timing=config.timing,
    )
    tokens = config.kv_tokens or base.total_tokens
    return base.replace(max_total_tokens=max(config.page_size, int(tokens * config.kv_scale)))
