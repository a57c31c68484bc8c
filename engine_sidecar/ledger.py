"""The sidecar's live account of its engine's KV: requests, reservations, watermark, queue.

The ledger is the one mutable place the proxy, the relief loop, the control-plane link
and the metrics read from; every decision in it is delegated to the pure policy in
`engine_sidecar.policy`. It keeps running sums (KV held, growth reserved, prompt tokens
waiting for prefill) that move by deltas, so a streamed token costs a few additions, not a
pass over every request.

A request's KV counts from the moment it is admitted (its prompt is committed even before
the engine starts the prefill) until its engine stream has ended — at finish, cancel or
preemption — so that admission never counts on capacity the engine has not yet released.

Room held for a continuation migrating here (`reserve`, see
`engine_sidecar.policy.reservation`) counts as committed from when it is granted until the
continuation's admission takes it or it expires.

Each admission charges the request's tenant the KV it is expected to pin, settled to what
it pinned when its KV is released (`AdmissionQueue.charge`, `settle`): the counters the
local queue orders tenants by.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.contract import FinishReason, PoolPolicy, WatermarkState
from controlplane.rules.fairness import Charge, tenant_weights
from controlplane.trace.trail import request_id_of
from engine_sidecar.intake import Intake
from engine_sidecar.policy import (
    AdmissionDecision,
    AdmissionQueue,
    AdmissionVerdict,
    EngineLoad,
    GrowthRate,
    KVUsage,
    LatencyForecast,
    LatencyPredictor,
    LengthKey,
    OutputLengthPredictor,
    PoolOutlook,
    PromptSizer,
    QueuedRequest,
    RequestRecord,
    RequestState,
    Reservation,
    Reservations,
    SequenceOutlook,
    VictimCandidate,
    admits_now,
    classify_watermark,
    decide_admission,
    growth_reserve,
    queue_wait_s,
    queued_request,
    reconcile_used,
    reservable_tokens,
    retry_after_s,
    steady_range,
    tpot_gate_s,
)

_S = RequestState
COMMITTED = frozenset({_S.PREFILL_READY, _S.PREFILL_RUNNING, _S.DECODE_READY, _S.DECODING})
_PREFILL = frozenset({_S.PREFILL_READY, _S.PREFILL_RUNNING})


class OverloadError(Exception):
    """Refused by local admission, with `reason`: answered 429 with Retry-After (400 for
    `too_large`, a request that can never fit, unless it is a resume)."""

    def __init__(self, reason: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Preemption(enum.StrEnum):
    """How a preempted request goes on: resumed here, recomputed or from the engine's
    host tier (offload); handed back to the router to resume elsewhere (migrate); or
    ended. The pool policy's `PreemptionMode`s say which of the first three it allows;
    the values are the wire's (`/weir/v1/preempt`'s `mode`, metric labels, the trail)."""

    RECOMPUTE = "recompute"
    OFFLOAD = "offload"
    MIGRATE = "migrate"
    TERMINATE = "terminate"


@dataclass(eq=False)
class Flight:
    """One client request on this endpoint, across all its engine segments."""

    intake: Intake
    _record: RequestRecord
    arrived_mono: float
    # The live generated-token count: the hot path bumps it, and it is folded into the
    # immutable record only when the record is read (a record copy per token is costly).
    generated: int = 0
    predicted_total: int = 0
    predicted_at_admission: int = 0
    kv: int = 0  # this request's share of the ledger's sums
    reserve: int = 0
    prefill: int = 0
    # What the client has received, for a continuation: ids when the engine reports them,
    # always the text.
    generated_ids: list[int] = field(default_factory=list)
    generated_text: list[str] = field(default_factory=list)
    engine_rid: str = ""
    client_rid: str = ""  # the rid the client (a router) gave, for its /abort_request
    task: asyncio.Task[Any] | None = None  # the handler serving it, cancelled by an abort
    preempt_mode: Preemption | None = None  # set by relief, a command or an admin
    offloaded: int = 0  # KV tokens an offload left in the engine's host tier, until it resumes
    prompt_counted: bool = False  # the engine has said its prompt's size
    prefix_block: int = 0  # the router's key of its prompt (wire.PREFIX_BLOCK); 0: none
    first_token_mono: float = 0.0
    cancelled_mono: float = 0.0
    resumed: bool = False  # a continuation from another endpoint: accepted work
    reservation: str = ""  # the room this endpoint holds for it, if its migration took one
    # Where relief migrates it, and the room held for it there (its continuation names them).
    target: str = ""
    target_reservation: str = ""
    admission: AdmissionDecision | None = None  # the last admission decision, explained
    # Its tenant's charge for the KV it holds now (admitted until released), and its
    # output when it was charged.
    charge: Charge | None = None
    charged_from: int = 0
    # The latency model's forecast when it reached this sidecar (new requests only).
    forecast: LatencyForecast | None = None
    committed: bool = False  # counted in the ledger's `running`

    @property
    def record(self) -> RequestRecord:
        rec = self._record
        if rec.generated_tokens != self.generated:
            rec = self._record = rec.with_generated(self.generated)
        return rec

    @record.setter
    def record(self, value: RequestRecord) -> None:
        self._record = value
        self.generated = value.generated_tokens

    @property
    def state(self) -> RequestState:
        return self._record.state

    @property
    def rid(self) -> str:
        return self._record.rid

    @property
    def key(self) -> LengthKey:
        return LengthKey(self.record.tenant, self.record.model)


class Ledger:
    """KV accounting, watermark and local admission for one engine."""

    def __init__(
        self,
        policy: PoolPolicy,
        capacity_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.capacity_tokens = capacity_tokens
        self.clock = clock
        self.predictor = OutputLengthPredictor()
        self.prompt_sizer = PromptSizer()  # text prompts' tokens, learnt from the engine's
        self.latency = LatencyPredictor()
        self.flights: dict[str, Flight] = {}
        self.own_used = 0
        self.reserved = 0
        self.waiting_prefill = 0
        self.running = 0  # requests whose KV is committed: the engine's batch, or about to be
        self.watermark = WatermarkState.NORMAL
        # Committed KV within this range keeps the watermark (no classification needed).
        self._steady = steady_range(self.watermark, capacity_tokens, policy.kv)
        self.admission_open = True
        self.growth = GrowthRate()
        self.engine_used: int | None = None
        self.engine_waiting = 0  # requests waiting in the engine, as it last reported
        self.engine_sampled_at = 0.0
        self.last_release_at = 0.0
        self.preemptions = 0
        self.tpot_s = 0.02  # smoothed seconds per output token, from finished requests
        # Publication: `changed` wakes the control-plane link when the watermark state
        # changes or KV moved by 1 % of capacity from what was last published;
        # `changed_at` is when the oldest unpublished change happened (for the metric).
        self.changed = asyncio.Event()
        self.changed_at: float | None = None
        self.pressure = asyncio.Event()  # wakes the relief loop
        self._published_used = 0
        # Room held for continuations migrating here; `on_reservation` hears of each one
        # taken, refused, consumed or expired (the service counts and traces them).
        self.reservations = Reservations(secrets.token_hex(4))
        self.on_reservation: Callable[[str, Reservation], None] = _ignore
        self._reservations_due: asyncio.TimerHandle | None = None
        sched = policy.scheduling
        self._queue: AdmissionQueue[asyncio.Future[None]] = AdmissionQueue(
            sched.local_queue_size, sched.aging_per_second, tenant_weights(policy.tenants)
        )
        self._idle = asyncio.Event()
        self._idle.set()

    # -- reading -----------------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        return reconcile_used(
            self.own_used, self.engine_used, self.engine_sampled_at, self.last_release_at
        )

    @property
    def held_tokens(self) -> int:
        """Room held for continuations migrating here."""
        return self.reservations.held_tokens

    def usage(self) -> KVUsage:
        """Used KV, and what is committed beside it: growth reserved and room held."""
        return KVUsage(self.capacity_tokens, self.used_tokens, self.reserved + self.held_tokens)

    @property
    def queued(self) -> int:
        """Requests waiting in the local queue (not those admitted and about to leave it)."""
        return sum(1 for _, future in self._queue.entries() if not future.done())

    def load(self) -> EngineLoad:
        """The engine's load as the latency model sees it: prompt tokens admitted or queued
        and not yet prefilled, the batch, the KV committed, the requests queued here and
        in the engine."""
        usage = self.usage()
        committed = usage.used_tokens + usage.reserved_growth_tokens
        return EngineLoad(
            self.waiting_prefill + self._queue.prompt_tokens,
            self.running,
            committed / self.capacity_tokens if self.capacity_tokens > 0 else 1.0,
            len(self._queue),
            self.engine_waiting,
        )

    def oldest_wait_s(self) -> float:
        now = self.clock()
        waiting = [q.enqueued_at for q, _ in self._queue.entries()]
        waiting += [f.record.state_since for f in self.flights.values() if f.prefill]
        return max(0.0, now - min(waiting)) if waiting else 0.0

    def candidates(self) -> list[VictimCandidate]:
        """Running sequences that relief may preempt."""
        return [
            _candidate(f)
            for f in self.flights.values()
            if f.record.state is _S.DECODING and not f.preempt_mode
        ]

    def candidate(self, rid: str) -> VictimCandidate | None:
        """`rid` as a preemption candidate, if it is one."""
        f = self.flights.get(rid)
        if f is None or f.record.state is not _S.DECODING or f.preempt_mode:
            return None
        return _candidate(f)

    # -- changing ------------------------------------------------------------------------

    def add(self, flight: Flight) -> None:
        if flight.rid in self.flights:
            raise ValueError(f"request id {flight.rid} is already tracked")
        self.flights[flight.rid] = flight
        self._idle.clear()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is tracked; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def predict(self, flight: Flight) -> int:
        """The request's predicted total output (the growth quantile), kept on the flight."""
        rec = flight.record
        flight.predicted_total = self.predictor.predict_total(
            flight.key, self.policy.kv.growth_quantile, rec.generated_tokens, rec.max_new_tokens
        )
        return flight.predicted_total

    def _outlook(self, flight: Flight) -> SequenceOutlook:
        rec = flight.record
        return SequenceOutlook(rec.generated_tokens, rec.max_new_tokens, flight.predicted_total)

    def _account(self, flight: Flight) -> None:
        """Bring the sums in line with `flight.record` and re-evaluate the watermark."""
        rec = flight.record
        committed = rec.state in COMMITTED
        kv = rec.prompt_tokens + rec.generated_tokens if committed else 0
        reserve = (
            growth_reserve(self._outlook(flight), self.policy.kv.growth_horizon_steps)
            if committed
            else 0
        )
        prefill = rec.prompt_tokens if rec.state in _PREFILL else 0
        released = kv < flight.kv
        self.own_used += kv - flight.kv
        self.reserved += reserve - flight.reserve
        self.waiting_prefill += prefill - flight.prefill
        self.running += committed - flight.committed
        flight.kv, flight.reserve, flight.prefill = kv, reserve, prefill
        flight.committed = committed
        now = self.clock()
        if released:
            self.last_release_at = now
        self._reclassify(now)

    def _reclassify(self, now: float) -> None:
        low, high = self._steady
        committed = self.used_tokens + self.reserved + self.held_tokens
        state = self.watermark
        if not low <= committed < high:
            state = classify_watermark(self.usage(), self.watermark, self.policy.kv)
        moved = abs(self.own_used - self._published_used) * 100 >= max(1, self.capacity_tokens)
        if state is not self.watermark or moved:
            if state is not self.watermark:
                self.watermark = state
                self._steady = steady_range(state, self.capacity_tokens, self.policy.kv)
                if state is WatermarkState.EXHAUSTED:
                    self.pressure.set()
            if self.changed_at is None:
                self.changed_at = now
            self.changed.set()

    def published(self, own_used: int) -> None:
        """The control plane now shows the KV of `own_used`: later changes are measured
        against it (not against the last notification, which a quiet drift could hide)."""
        self._published_used = own_used

    def move(
        self, flight: Flight, to: RequestState, finish_reason: FinishReason | None = None
    ) -> None:
        flight.record = flight.record.transition(to, self.clock(), finish_reason)
        if to is _S.DECODE_PREEMPTED:
            self.preemptions += 1
        prefilling = self.waiting_prefill > 0
        self._account(flight)
        if flight.charge is not None and to not in COMMITTED:
            generated = flight.record.generated_tokens - flight.charged_from
            self._queue.settle(flight.charge, generated, self.clock())
            flight.charge = None
        if to.is_final:
            self.flights.pop(flight.rid, None)
            if not self.flights:
                self._idle.set()
        # KV released, or the last pending prefill done (the TPOT gate lifts): what waits
        # may be admitted now.
        if flight.kv == 0 or (prefilling and self.waiting_prefill == 0):
            self._pump()

    def set_prompt_tokens(self, flight: Flight, prompt_tokens: int) -> None:
        """The engine reported the real prompt size: replace the estimate (and, for a
        text prompt, learn from it how the next ones are sized)."""
        intake = flight.intake
        if intake.prompt_bytes and not flight.prompt_counted:
            flight.prompt_counted = True
            self.prompt_sizer.observe(intake.prompt_bytes, prompt_tokens - intake.template_tokens)
        if prompt_tokens > 0 and prompt_tokens != flight.record.prompt_tokens:
            flight.record = replace(flight.record, prompt_tokens=prompt_tokens)
            self._account(flight)
            self._pump()

    def add_tokens(self, flight: Flight, generated_total: int) -> None:
        """The stream reported `generated_total` output tokens so far (hot path)."""
        rec = flight._record
        total = min(generated_total, rec.max_new_tokens)
        if total <= flight.generated:
            return
        flight.generated = total
        if total >= flight.predicted_total:
            self.predict(flight)
        delta = total + rec.prompt_tokens - flight.kv
        outlook = SequenceOutlook(total, rec.max_new_tokens, flight.predicted_total)
        reserve = growth_reserve(outlook, self.policy.kv.growth_horizon_steps)
        self.own_used += delta
        self.reserved += reserve - flight.reserve
        flight.kv += delta
        flight.reserve = reserve
        self._reclassify(self.clock())

    def observe_engine(
        self, used_tokens: int, sampled_at: float, waiting_requests: int = 0
    ) -> None:
        self.engine_used = used_tokens
        self.engine_waiting = waiting_requests
        self.engine_sampled_at = sampled_at
        now = self.clock()
        self.growth = self.growth.observe(self.used_tokens, now)
        self._reclassify(now)
        # A smaller report frees room, and the engine's queue moves the predicted TPOT
        # the gate reads: what waits is decided again at each poll, not only at the next
        # release or first token.
        self._pump()

    def observe_tpot(self, tpot_s: float) -> None:
        self.tpot_s = 0.9 * self.tpot_s + 0.1 * tpot_s

    def finished_naturally(self, flight: Flight) -> int:
        """Calibrate the predictor with a natural ending; returns the prediction's error."""
        total = flight.record.generated_tokens
        self.predictor.observe(flight.key, total)
        return abs(flight.predicted_at_admission - total)

    def first_token_latency(self, flight: Flight, cached_tokens: int) -> float | None:
        """Train the latency model's TTFT on a new request's first token (`cached_tokens`:
        the prompt tokens the engine served from its cache); returns the forecast's error.
        Only a request that reached its first token undisturbed teaches it: one that
        waited out a preemption saw latency its arrival's load did not cause."""
        rec, forecast = flight.record, flight.forecast
        if forecast is None or rec.preemptions:
            return None
        ttft = flight.first_token_mono - flight.arrived_mono
        return self.latency.observe_ttft(forecast, rec.prompt_tokens - cached_tokens, ttft)

    def finished_latency(self, flight: Flight, now: float) -> float | None:
        """Train the latency model's TPOT on a request that finished undisturbed; returns
        the forecast's error."""
        rec, forecast = flight.record, flight.forecast
        tokens = rec.generated_tokens
        if forecast is None or rec.preemptions or tokens < 2 or not flight.first_token_mono:
            return None
        return self.latency.observe_tpot(forecast, (now - flight.first_token_mono) / (tokens - 1))

    def set_admission(self, open_: bool) -> None:
        self.admission_open = open_
        if open_:
            self._pump()
        self.changed.set()

    # -- admission -------------------------------------------------------------------------

    def _decide(self, flight: Flight, held: bool = False) -> AdmissionDecision:
        rec = flight.record
        if rec.generated_tokens == 0 or flight.predicted_total == 0:
            self.predict(flight)
        usage = self.usage()
        target_tpot_s = tpot_gate_s(self.policy.scheduling, self.policy.role)
        # The TPOT gate's inputs, read only where the pool declares an objective and a
        # prefill admitted here is pending (`decide_admission`).
        pending = target_tpot_s > 0.0 and self.waiting_prefill > 0
        pool = PoolOutlook(
            usage.capacity_tokens,
            usage.used_tokens,
            usage.reserved_growth_tokens,
            self.watermark,
            self.admission_open,
            prefill_pending=pending,
            predicted_tpot_s=self.latency.predicted_tpot_s(self.load()) if pending else 0.0,
        )
        flight.admission = decide_admission(
            self._outlook(flight), rec.prompt_tokens + rec.generated_tokens, pool, self.policy.kv,
            held=held, target_tpot_s=target_tpot_s,
        )  # fmt: skip
        return flight.admission

    async def admit(self, flight: Flight) -> None:
        """Admit `flight` (new, or preempted and resuming) now or after a bounded wait in
        the local queue (`AdmissionQueue`'s discipline); raises OverloadError. On return
        its KV is committed. A continuation for which room is held here takes that room
        at once, ahead of anything waiting."""
        sched = self.policy.scheduling
        if flight.forecast is None and not flight.resumed and flight.generated == 0:
            flight.forecast = self.latency.forecast(self.load())
        decision = self._decide(flight, held=self._consume(flight))
        verdict, reason = decision.verdict, decision.reason
        if verdict is AdmissionVerdict.REFUSE:
            raise _never_fits(reason)
        queue = self._queue
        if admits_now(decision, len(queue)):
            self._commit(flight)
            return
        if verdict is AdmissionVerdict.ADMIT:
            reason = "queued_ahead"  # it fits, but others wait: the queue decides
        rec = flight.record
        # Accepted work: a continuation from elsewhere, or one preempted here.
        resumed = flight.resumed or rec.state is _S.DECODE_PREEMPTED
        if queue.refuses(resumed):
            raise OverloadError(
                "queue_full",
                retry_after_s(len(queue), sched.local_queue_size, sched.local_queue_max_wait_s),
                f"local queue is full ({len(queue)} waiting; last reason {reason})",
            )
        now = self.clock()
        # One preempted here ages from its first arrival: ahead of newer ones of its class.
        arrived_at = rec.arrived_at if rec.state is _S.DECODE_PREEMPTED else now
        queued = queued_request(
            flight.rid, rec.priority, rec.prompt_tokens, arrived_at=arrived_at, now=now,
            max_wait_s=queue_wait_s(self.policy, resumed), deadline_at=rec.deadline_at,
            resumed=resumed, charge=self._charge_for(flight, now),
        )  # fmt: skip
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.offer(queued, future)
        self.changed.set()
        self._pump()  # it may be first in queue order
        try:
            await asyncio.wait_for(
                asyncio.shield(future), timeout=max(0.0, queued.expires_at - now)
            )
        except TimeoutError:
            if not future.done():
                raise self._timed_out(reason) from None
        finally:
            queue.remove(flight.rid)
            self._pump()

    def _timed_out(self, reason: str) -> OverloadError:
        sched = self.policy.scheduling
        return OverloadError(
            "queue_timeout",
            retry_after_s(len(self._queue), sched.local_queue_size, sched.local_queue_max_wait_s),
            f"not admitted within its wait (last reason {reason})",
        )

    # -- room held for migrations ------------------------------------------------------------

    def reserve(self, request_id: str, tokens: int, ttl_s: float) -> Reservation | None:
        """Hold `tokens` for the continuation of `request_id` migrating here, if admission
        would take it now (`room_tokens`); None when it would not."""
        now = self.clock()
        self._expire_reservations(now)
        if not 0 < tokens <= self.room_tokens():
            self.on_reservation("refused", Reservation("", request_id, tokens, now))
            return None
        reservation = self.reservations.take(request_id, tokens, now, ttl_s)
        self.on_reservation("taken", reservation)
        self._held_changed(now)
        return reservation

    def room_tokens(self) -> int:
        """The largest continuation a reservation here would be granted now."""
        return reservable_tokens(self.usage(), self.watermark, self.admission_open, self.policy.kv)

    def _consume(self, flight: Flight) -> bool:
        """Whether room was held here for `flight` (now released to its admission)."""
        if not flight.reservation:
            return False
        now = self.clock()
        self._expire_reservations(now)
        reservation = self.reservations.consume(flight.reservation, request_id_of(flight.rid))
        flight.reservation = ""
        if reservation is None:
            return False
        self.on_reservation("consumed", reservation)
        self._held_changed(now)
        return True

    def _expire_reservations(self, now: float) -> None:
        expired = self.reservations.expire(now)
        for reservation in expired:
            self.on_reservation("expired", reservation)
        if expired:
            self._held_changed(now)
            self._pump()  # the room returned: what waits may fit

    def _held_changed(self, now: float) -> None:
        """Room held here changed: re-evaluate, publish, and wake up when the next
        reservation expires. (A consumed reservation's room is its continuation's: no
        pump before that one is admitted.)"""
        self._reclassify(now)
        if self.changed_at is None:
            self.changed_at = now
        self.changed.set()
        if self._reservations_due is not None:
            self._reservations_due.cancel()
            self._reservations_due = None
        due = self.reservations.next_expiry()
        if due is not None:
            loop = asyncio.get_running_loop()
            self._reservations_due = loop.call_later(max(0.0, due - now), self._reservation_due)

    def _reservation_due(self) -> None:
        self._reservations_due = None
        self._expire_reservations(self.clock())

    def _charge_for(self, flight: Flight, now: float) -> Charge:
        """What admitting `flight` at `now` charges its tenant: the KV it holds (its
        prompt and what it generated) from now to its first token, as this engine's
        latency model predicts it, and the output it may still add at its TPOT."""
        rec = flight.record
        kv = rec.prompt_tokens + rec.generated_tokens
        ttft_s = self.latency.forecast(self.load()).ttft_s(kv)
        return Charge.placed(
            rec.tenant, kv, rec.remaining_tokens, now, ttft_s=ttft_s, tpot_s=self.tpot_s
        )

    def _commit(self, flight: Flight) -> None:
        flight.charge = self._queue.charge(self._charge_for(flight, self.clock()))
        flight.charged_from = flight.record.generated_tokens
        if flight.record.state is _S.WAITING_ADMISSION:
            self.move(flight, _S.PREFILL_READY)
            flight.predicted_at_admission = flight.predicted_total
        else:
            self.move(flight, _S.DECODE_READY)

    def _pump(self) -> None:
        """End the waits that are over, then admit queued requests in queue order while
        the head fits."""
        if not len(self._queue):
            return
        now = self.clock()
        for queued, future in self._queue.expire(now):
            self._wait_over(queued, future)
        for queued, future, verdict in self._queue.pump(now, self._verdict):
            if verdict is AdmissionVerdict.ADMIT:
                self._commit(self.flights[queued.rid])
                future.set_result(None)
            else:  # it grew past what the engine could ever hold
                future.set_exception(_never_fits("too_large"))

    def _wait_over(self, queued: QueuedRequest, waiter: asyncio.Future[None]) -> None:
        """`queued` waited as long as it may: its admission is refused."""
        if not waiter.done():
            flight = self.flights.get(queued.rid)
            last = flight.admission if flight is not None else None
            waiter.set_exception(self._timed_out(last.reason if last else "kv_reserve"))

    def _verdict(
        self, queued: QueuedRequest, waiter: asyncio.Future[None]
    ) -> AdmissionVerdict | None:
        flight = self.flights.get(queued.rid)
        if flight is None or waiter.done():
            return None  # its waiter left
        return self._decide(flight).verdict


def _ignore(outcome: str, reservation: Reservation) -> None:
    pass


def _never_fits(reason: str) -> OverloadError:
    return OverloadError(reason, 60, f"request can never fit this endpoint's KV ({reason})")


def _candidate(f: Flight) -> VictimCandidate:
    return VictimCandidate(
        rid=f.rid,
        prompt_tokens=f.record.prompt_tokens,
        generated_tokens=f.record.generated_tokens,
        max_new_tokens=f.record.max_new_tokens,
        predicted_total_tokens=f.predicted_total,
        reserved_growth_tokens=f.reserve,
        priority=f.record.priority,
        deadline_at=f.record.deadline_at,
        preemptions=f.record.preemptions,
        recomputable=f.record.recomputable,
        migratable=f.record.migratable,
    )
