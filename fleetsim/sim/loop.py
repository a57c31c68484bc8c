"""The discrete-event loop: N engine models on one virtual clock, driven by a fleet policy.

Each engine is the reference engine's `EngineModel` — the scheduler `weir engine` runs —
stepped in virtual time: an iteration starts at `t`, its tokens and finishes are applied
at `t + duration`, and the next iteration starts then. Everything else (heartbeats,
scrapes, cancellations, deadlines, engine failures) is a timed callback on one heap,
ordered by time and then by insertion; arrivals, all known in advance, are read in order
beside it and go first at an equal time. A run is a pure function of its inputs and seed.

P/D: on a disaggregated fleet a request is first sent to a prefill engine for its prompt
and first token only; its prompt's KV then travels to a decode engine (the transfer takes
KV bytes / link bandwidth), and the policy's `handoff` places it there, where the engine
imports the KV instead of computing it again.

The engine never learns how long an answer will be. It is asked for up to the client's
`max_tokens` (so its own admission sees what SGLang would see) and the simulator ends the
request when its natural length is reached, as the model's end-of-sequence token would.

Fast-forward: most iterations only decode, and nothing but their own tokens happens to
their engine between two events that concern it. When an engine's next iteration is such
one, the loop plans the run of them (`EngineModel.decode_run`: up to the first that
finishes a request's answer or would run short of pages, the policy's `quiet_until`, or
`FAST_FORWARD_STEPS`) and schedules one event at its end instead of one per iteration.
The iterations themselves run lazily, when the clock passes them and something looks:
a submit or an abort on the engine (`interrupt`), its failure, the run's end. Its KV
usage (`EngineSlot.used_tokens`, read by samples and scrapes) comes from the pages the
run planned for each iteration, without running them. Each runs as it would have, at the
time it would have started; its tokens reach the flights at the time its successor starts. An
interrupted run hands back to one event per iteration from the next iteration's end. So
a run is the same function of its inputs and seed with and without fast-forward
(tests/fleetsim/test_sim_identical.py), except that an event at exactly the instant an
iteration ends (equal floats) sees that iteration's tokens not yet applied.
"""

from __future__ import annotations

import bisect
import functools
import gc
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from controlplane.contract import FinishReason, Role
from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, EngineRequestError
from fleetsim.sim.config import FleetConfig
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.workloads import RequestSpec, prompt_token_bytes_each
from fleetsim.workloads.scenarios import EngineFailure

# The most iterations one fast-forward plans: their ends are computed when it starts, and
# a run an arrival interrupts early has computed the rest for nothing.
FAST_FORWARD_STEPS = 32
# Arrivals whose prompt ids are made together (`prompt_token_bytes_each`).
PROMPT_CHUNK: Final = 32


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

    def quiet_until(self, engine: int, now: float) -> float:
        """Until when `after_step` and `before_step` would do nothing for this engine
        (with nothing but its own iterations happening to it: what does happen, the
        policy reports with `Simulation.interrupt`), so the loop may run its iterations
        without calling them; `now` or earlier when they must see the next one."""

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
    run: DecodeRun | None = None  # a fast-forward under way
    # The pages a fast-forward under way has in use at the clock.
    run_pages: Callable[[], int] = field(init=False)
    exhaustion_events: int = 0
    high_water_s: float = 0.0
    busy_s: float = 0.0
    peak_usage: float = 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.model.total_tokens

    @property
    def used_tokens(self) -> int:
        pages = self.model.kv.used_pages if self.run is None else self.run_pages()
        return pages * self.model.page_size

    @property
    def usage(self) -> float:
        return self.used_tokens / self.model.total_tokens

    def tally(self, durations: Sequence[float], used_pages: Sequence[int], high: float) -> None:
        """Count iterations that took `durations`, with `used_pages` of the KV in use
        after each; the time at or above the `high` usage counts as high water."""
        ps, total = self.model.page_size, self.model.total_tokens
        busy, high_s, peak = self.busy_s, self.high_water_s, self.peak_usage
        for duration, pages in zip(durations, used_pages, strict=True):
            busy += duration
            usage = pages * ps / total
            if usage >= high:
                high_s += duration
            if usage > peak:
                peak = usage
        self.busy_s, self.high_water_s, self.peak_usage = busy, high_s, peak


@dataclass(slots=True)
class DecodeRun:
    """A fast-forward: iterations that only decode, starting at `times[:-1]` and taking
    `durations`, the last ending at `times[-1]` (the engine's next step event). The
    model has run `done` of them (a catch-up runs every one started by then, the one
    under way included); the flights hold the tokens of all but the last of those."""

    times: list[float]
    durations: list[float]
    batch: list[tuple[EngineRequest, SimFlight]]
    pages: list[int]  # in use after each iteration
    done: int = 0


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
            slot.run_pages = functools.partial(self._run_pages, slot)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        # Step events an interrupted fast-forward left in the heap, skipped when due.
        self._stale: set[Callable[[], None]] = set()
        self._seq = 0  # insertion order, which breaks ties in time
        self._open = len(self.flights)
        self.last_arrival = max((s.arrival_s for s in specs), default=0.0)
        self.horizon = self.last_arrival + self.config.drain_s
        self.kv_samples: list[KVSample] = []
        # Arrivals are known in advance: read in order beside the heap rather than pushed
        # into it (a million-request trace would make every heap operation pay for them).
        # An arrival goes before any heap event at the same instant, as if it had been
        # pushed first.
        self._arrivals = sorted(self.flights, key=lambda f: f.spec.arrival_s)
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
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, action))

    @property
    def active(self) -> bool:
        """Whether periodic work should keep rescheduling itself."""
        return self._open > 0 and self.now < self.horizon

    def every(self, period: float, action: Callable[[float], None], start: float = 0.0) -> None:
        """Run `action(now)` every `period` seconds while requests remain open."""
        self.at(start, functools.partial(self._tick, period, action))

    def _tick(self, period: float, action: Callable[[float], None]) -> None:
        # A partial each time, not a closure that schedules itself: that is a reference
        # cycle, which a run must not make (see `run`).
        action(self.now)
        if self.active:
            self.at(self.now + period, functools.partial(self._tick, period, action))

    def run(self) -> SimResult:
        self.policy.start(self)
        self.every(self.config.sample_period_s, self._sample)
        # A run makes no reference cycles (`test_a_run_leaves_no_reference_cycles`):
        # reference counting frees everything it drops, and Python's cyclic collector
        # would only scan the run's millions of live objects (the flights, the engines'
        # caches) for nothing — 5-7 % of a compiled run's time, at a fiftieth of its
        # default rhythm. It is off while the events run.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._events()
        finally:
            if collecting:
                gc.enable()
        return self._finish()

    def _events(self) -> None:
        """Every event in time order until the flights are all done or the horizon."""
        heap, stale, horizon = self._heap, self._stale, self.horizon
        arrivals, arrive = self._arrivals, self._arrive
        following, last = 0, len(arrivals)
        primed = 0  # arrivals whose prompt ids are made
        while self._open > 0:
            if following < last and (not heap or arrivals[following].spec.arrival_s <= heap[0][0]):
                if following == primed:
                    # The next few arrivals' prompts in one pass: numpy's cost per call was
                    # most of a prompt's. (Few: the ids of many would leave the CPU cache.)
                    chunk = arrivals[primed : primed + PROMPT_CHUNK]
                    for ahead, ids in zip(
                        chunk, prompt_token_bytes_each([f.spec for f in chunk]), strict=True
                    ):
                        ahead.primed(ids)
                    primed += len(chunk)
                flight = arrivals[following]
                following += 1
                when = max(0.0, flight.spec.arrival_s)
                if when > horizon:
                    break
                self.now = when
                arrive(flight)
                continue
            if not heap:
                break
            when, _, action = heapq.heappop(heap)
            if when > horizon:
                break
            if action in stale:
                stale.discard(action)
                continue
            self.now = when
            action()

    def _finish(self) -> SimResult:
        """The result. Only the horizon ends a run with fast-forwards under way (their
        flights are open): the iterations that ended by then ran, and the last of them
        ends the run if it came after every event."""
        for slot in self.engines:
            if slot.run is not None:
                self._catch_up(slot, self.horizon, through=True)
                self.now = max(self.now, slot.run.times[slot.run.done - 1])
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
            high_water_s=sum((e.high_water_s for e in self.engines), 0.0),
            engine_seconds=sum((e.busy_s for e in self.engines), 0.0),
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
        self.interrupt(engine)
        spec = flight.spec
        flight.dequeue(now)
        ids = flight.continuation_ids()
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
        self.interrupt(flight.engine)
        slot = self.engines[flight.engine]
        rid = flight.engine_rid
        slot.flights.pop(rid, None)
        if slot.alive:
            slot.model.abort(rid, now=now)
            self._wake(slot, now)
        flight.leave_engine()

    def interrupt(self, engine: int) -> None:
        """Something besides its own iterations is about to change what the engine's
        next iterations see (a submit, an abort, its policy's state for it): a
        fast-forward under way stops, and the loop steps it one iteration at a time again
        from the end of the one under way."""
        slot = self.engines[engine]
        run = slot.run
        if run is None:
            return
        self._catch_up(slot, self.now)
        slot.run = None
        slot.pending = [req for req, _ in run.batch]
        if run.done < len(run.times) - 1:  # else its step event is the one due
            self._stale.add(slot.step)
            slot.step = functools.partial(self._step, slot)
            self.at(run.times[run.done], slot.step)

    def end(self, flight: SimFlight, reason: FinishReason, now: float, detail: str = "") -> None:
        if flight.done:
            return
        self.withdraw(flight, now)
        flight.dequeue(now)
        flight.close(reason, now, detail)
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
        self.interrupt(engine)  # what it ran until now counts
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
        run = slot.run
        if run is not None:  # a fast-forward ends: its last iteration's tokens are due
            self._catch_up(slot, now)
            slot.run = None
            slot.pending = [req for req, _ in run.batch]
        self._apply(slot, now)
        self.policy.after_step(slot.index, now)
        self.policy.before_step(slot.index, now)
        model = slot.model
        if not model.has_work:
            slot.scheduled = False  # nothing runs until a submit or an abort wakes it
            return
        if model.plain_decode() and self._fast_forward(slot, now):
            return
        result = model.step(now)
        if result.idle:
            slot.scheduled = False
            return
        slot.pending = result.emitted
        slot.pending_finished = result.finished
        slot.pending_retracted = result.retracted
        if result.retracted:
            slot.exhaustion_events += 1
        slot.tally((result.duration,), (model.kv.used_pages,), self._high_watermark)
        self.at(now + result.duration, slot.step)

    def _fast_forward(self, slot: EngineSlot, now: float) -> bool:
        """Start a fast-forward if at least two iterations can run without an event
        between them (see the module docstring)."""
        if slot.role is Role.PREFILL:
            return False  # its requests' first tokens start transfers
        until = self.policy.quiet_until(slot.index, now)
        if until <= now:
            return False
        flights = slot.flights
        limit = FAST_FORWARD_STEPS
        batch = []
        for req in slot.model.decoding:
            flight = flights.get(req.rid)
            if flight is None or flight.visit_cached < 0 or flight.handoff_from >= 0:
                return False  # its next token is its first on this engine
            # The iteration that streams its last token ends the run: the flight ends then.
            limit = min(limit, flight.target_tokens - flight.generated)
            batch.append((req, flight))
        durations, pages = slot.model.decode_run(now, limit, until)
        if len(durations) < 2:
            return False
        times = [now]
        for duration in durations:
            now += duration
            times.append(now)
        # Its iterations run when something catches it up (the first too: nothing reads
        # the engine before then without doing so, and a run caught up once at its end
        # pays the per-request work of a catch-up once).
        slot.run = DecodeRun(times, durations, batch, pages)
        self.at(now, slot.step)
        return True

    def _run_pages(self, slot: EngineSlot) -> int:
        """The pages in use after the fast-forward's last iteration to start before the
        clock, as catching up to it (`_catch_up`) would leave them."""
        run = slot.run
        assert run is not None
        times = run.times
        started = bisect.bisect_left(times, self.now, 1, len(times) - 1) - 1
        return run.pages[max(run.done - 1, started)]

    def _catch_up(self, slot: EngineSlot, now: float, through: bool = False) -> None:
        """Run a fast-forward's iterations that started before `now` (or at it,
        `through`), and give the flights the tokens of those that ended before it."""
        run = slot.run
        assert run is not None
        times = run.times
        last = len(times) - 1
        ended = (bisect.bisect_right if through else bisect.bisect_left)(times, now, 1, last) - 1
        if ended + 1 <= run.done:
            return
        applied = max(0, run.done - 1)
        durations = run.durations[run.done : ended + 1]
        used = slot.model.decode_ahead(times[run.done : ended + 1], durations)
        slot.tally(durations, used, self._high_watermark)
        run.done = ended + 1
        if ended > applied:
            at = times[ended]
            for req, flight in run.batch:
                out = req.output_ids
                n = len(out)
                flight.streamed(out[n - 1 - (ended - applied) : n - 1])
                flight.last_token_at = at

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
            flight.streamed_one(req.output_ids[-1])
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
            if flight.generated >= flight.target_tokens:
                reason = (
                    FinishReason.LENGTH
                    if flight.generated >= flight.spec.max_tokens
                    else FinishReason.STOP
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
        self.kv_samples.append(KVSample(now, sum(usages, 0.0) / len(usages), max(usages)))


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
