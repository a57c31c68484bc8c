"""The router's dispatch: route or queue, reserve and release, charge, pump and resume.

One clock-injected core that does no I/O, driven by the router (`controlplane.router`)
and by the fleet simulator (`fleetsim.sim.weir`) alike; a parity test feeds both the same
events and compares their decisions (`tests/fleetsim/test_dispatch_parity.py`). The
caller passes the instant and the pool snapshot (None while it is too stale to route on)
and gets back events: `Placed` (send the payload to this endpoint) and `Refused` (answer
the client, or give up a stream). Payloads are the caller's own: the router's
exchanges, the simulator's flights. Waiting is the caller's too: it calls `pump` again
at `next_wakeup()`, when a report arrives, and nowhere else.

A request's life here:

- **Arrival.** Placed at once unless something of its class or above waits (nobody
  jumps the queue of their own class). Placed means reserved (`InFlight`) and its
  tenant charged, once per request, the KV cost it is expected to pin in the fair
  queue's counters (`kv_cost_estimate`, from the service times the endpoint it was
  placed at publishes).
  When only saturation stood in the way (`Decision.saturated`) it waits in the `FairQueue`
  (full: 429 `queue_full`); any other refusal means nothing could serve it: 503 named by
  the filter that removed the most candidates.
- **Waiting.** Room that returns (an end, a release, a report) is pumped fairest first,
  highest band first; the head of the queue holds the line for new work. A wait ends at
  the queue's time to live (429 `queue_timeout`) or the request's deadline if sooner
  (504 `deadline`).
- **Refused before its first byte.** An endpoint that refused it or could not be reached
  is not offered it again: the decision's next fallback takes it, up to
  `max_attempts` endpoints (then 429 `endpoints_overloaded`, with the largest
  Retry-After an endpoint gave).
- **Handed back.** A stream that stopped before the request did, after bytes of it
  reached the client — its endpoint broke (never tried again) or migrated it away — is a
  resume: placed by `decide_resume` (saturation is a preference for accepted work, not a
  veto). An endpoint that refuses a resume, or migrated it away, is avoided for a
  backoff that doubles with each refusal (50 ms to 1 s), then asked again. A resume
  waits ahead of new work of its class, without holding the line for anything (it can
  only wait for want of a routable endpoint), for up to `resume_wait_s` in all since it
  was handed back (then 503 `resume_failed`): the time an endpoint held it, queued there
  as accepted work until it refused it, does not count. A migration whose sidecar took
  room for it at a target (`target`) goes there first, if the filters a resume passes
  allow it: a preference, tried once; a target that refuses or is gone leaves the resume
  to `decide_resume`.
- **Reached.** Once the endpoint it was placed at has it, the caller says so (`reached`):
  the profile's post-decision hooks learn where it went (the prefix plugin records its
  prompt's blocks there, for the next decisions to find).
- **End.** Its reservation released, its charge settled to what it really cost
  (`kv_cost`: its prompt and the output it generated, held from its first placement to
  its end), the freed room pumped.

Configuration comes from the pool policy on both sides: its `RoutingPolicy`, and its
tenants' fair-share weights (`controlplane.rules.fairness.tenant_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, Generic, Protocol, TypeAlias, TypeVar

from controlplane.contract import RoutingPolicy
from controlplane.routing.fair_queue import FairQueue, QueueFullError
from controlplane.routing.framework import Decision
from controlplane.routing.inflight import InFlight
from controlplane.routing.prefix_index import PrefixIndex
from controlplane.routing.snapshot import PoolSnapshot, RouteRequest, RoutingContext
from controlplane.rules.fairness import Charge

P = TypeVar("P")

# How long an endpoint that refused a resume, or migrated it away, is avoided: doubled with
# each refusal of the same resume, up to the cap.
RESUME_BACKOFF_S: Final = 0.05
RESUME_BACKOFF_MAX_S: Final = 1.0
# A deadline is never passed to routing as spent: 0 means "no deadline" there.
_MIN_DEADLINE_S: Final = 1e-3

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
DEADLINE = "deadline"
ENDPOINTS_OVERLOADED = "endpoints_overloaded"
RESUME_FAILED = "resume_failed"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal as the router answers it: 429 and 503 are retryable after
    `retry_after_s` (None when the answer gives none), anything else is final."""

    status: int
    reason: str
    retry_after_s: float | None = None
    message: str = ""

    @property
    def retryable(self) -> bool:
        return self.status in (429, 503)


# The events and a request's record are plain classes: a generic dataclass does not import
# when mypyc compiles it (the fleet simulator's `--compiled` compiles this module).


class Placed(Generic[P]):
    """Send `payload` to `endpoint_id` (reserved for it until it ends or comes back);
    `route` is the request as it arrived, for `Dispatcher.reached`."""

    __slots__ = ("endpoint_id", "payload", "route")

    def __init__(self, payload: P, endpoint_id: str, route: RouteRequest) -> None:
        self.payload: Final = payload
        self.endpoint_id: Final = endpoint_id
        self.route: Final = route

    def __repr__(self) -> str:
        return f"Placed({self.payload!r}, {self.endpoint_id!r})"


class Refused(Generic[P]):
    """The router gives `payload` up: answer its client with `refusal`."""

    __slots__ = ("payload", "refusal")

    def __init__(self, payload: P, refusal: Refusal) -> None:
        self.payload: Final = payload
        self.refusal: Final = refusal

    def __repr__(self) -> str:
        return f"Refused({self.payload!r}, {self.refusal!r})"


Event: TypeAlias = Placed[P] | Refused[P]


class Decider(Protocol):
    """Where a request goes: `controlplane.routing.Profile`, or one that observes it."""

    def decide(self, request: RouteRequest, ctx: RoutingContext) -> Decision: ...

    def decide_resume(self, request: RouteRequest, ctx: RoutingContext) -> Decision: ...

    def placed(
        self, request: RouteRequest, endpoint_id: str, prefix_index: PrefixIndex
    ) -> None: ...


class _Request(Generic[P]):
    __slots__ = (
        "arrived_at", "avoided", "charge", "decision", "endpoint", "failed", "generated",
        "payload", "refusals", "resuming", "retry_after_s", "route", "target",
        "waited_before_s", "waiting_since",
    )  # fmt: skip

    def __init__(self, route: RouteRequest, payload: P, now: float) -> None:
        self.route = route  # as it arrived: prompt, output limit, deadline budget, owners
        self.payload = payload
        self.arrived_at = now
        # Arrival, or the last hand-back or refusal: a wait counts from it.
        self.waiting_since = now
        self.endpoint = ""  # reserved for it now
        self.charge: Charge | None = None  # the KV cost charged when it was first placed
        self.decision: Decision | None = None  # its first placement, for fallbacks
        self.failed: set[str] = set()  # never offered it again
        self.avoided: dict[str, float] = {}  # endpoint -> avoided until
        self.resuming = False
        self.refusals = 0  # of this resume, for the backoff
        # A resume's wait here before `waiting_since`: its earlier spells without an
        # endpoint (the time an endpoint held it, queued as accepted work, does not count).
        self.waited_before_s = 0.0
        self.generated = 0  # tokens the client holds: a resume's prompt grows by them
        self.retry_after_s = 0.0
        self.target = ""  # where room is held for its resume: tried first, once


class Dispatcher(Generic[P]):
    def __init__(
        self,
        decider: Decider,
        policy: RoutingPolicy,
        prefix_index: PrefixIndex | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        """`weights` are the tenants' fair-share weights (`tenant_weights` of the pool
        policy's tenants; 1 for any other)."""
        self.decider = decider
        self.policy = policy
        self.prefix_index = prefix_index
        self.queue: FairQueue[_Request[P]] = FairQueue(
            policy.queue_capacity_per_band, policy.queue_max_wait_s, weights
        )
        self.inflight = InFlight()
        self._requests: dict[str, _Request[P]] = {}
        self._resuming: dict[str, _Request[P]] = {}  # in hand-back order

    def waiting(self, request_id: str) -> bool:
        """Whether the request waits here for an endpoint (queued, or a resume)."""
        return request_id in self.queue or request_id in self._resuming

    @property
    def idle(self) -> bool:
        """Nothing waits here for an endpoint: a pump would read no snapshot."""
        return not (self._resuming or len(self.queue))

    def next_wakeup(self) -> float | None:
        """The next instant a wait ends or an avoided endpoint may be asked again: pump
        then."""
        expiry = self.queue.next_expiry()
        if not self._resuming:
            return expiry  # as a rule: it is asked at every report the router takes
        times = [expiry]
        for request in self._resuming.values():
            times.append(self._resume_expires_at(request))
            times.extend(request.avoided.values())
        return min((t for t in times if t is not None), default=None)

    # -- a request's life ----------------------------------------------------------------

    def arrive(
        self, route: RouteRequest, payload: P, now: float, snapshot: PoolSnapshot
    ) -> list[Event[P]]:
        """A request this router admitted (quota and credit taken)."""
        request = self._new(route, payload, now)
        events: list[Event[P]] = []
        if self.queue.waiting_at_or_above(route.priority):
            self._enqueue(request, now, events)
            self._pump(now, snapshot, events)
        else:
            decision = self._decide(request, now, snapshot)
            if decision.endpoint_id:
                self.queue.charge(route.tenant, self._charge(request, decision, now, snapshot))
                self._reserve(request, decision, now, events)
            elif decision.saturated:
                self._enqueue(request, now, events)
            else:
                message = (
                    f"no endpoint of pool {snapshot.pool!r} can serve model {route.model!r} "
                    f"now ({decision.refusal})"
                )
                self._drop(request, Refusal(503, decision.refusal, 1.0, message), events, now)
        return events

    def refused(
        self,
        request_id: str,
        now: float,
        snapshot: PoolSnapshot | None,
        retry_after_s: float = 0.0,
    ) -> list[Event[P]]:
        """The endpoint it was sent to did not take it (it refused, or could not be
        reached) and nothing of this attempt reached the client."""
        request = self._requests[request_id]
        endpoint = self._release(request)
        events: list[Event[P]] = []
        if request.resuming:
            backoff = RESUME_BACKOFF_S * 2**request.refusals
            request.avoided[endpoint] = now + min(RESUME_BACKOFF_MAX_S, backoff)
            request.refusals += 1
            request.waiting_since = now
            self._resuming[request_id] = request
        else:
            request.failed.add(endpoint)
            request.retry_after_s = max(request.retry_after_s, retry_after_s)
            assert request.decision is not None  # a new request is sent only once placed
            targets = [t for t in request.decision.fallbacks if t not in request.failed]
            if not targets or len(request.failed) >= self.policy.max_attempts:
                message = (
                    f"{len(request.failed)} endpoint(s) refused or failed before the first byte"
                )
                refusal = Refusal(429, ENDPOINTS_OVERLOADED, request.retry_after_s or 1.0, message)
                self._drop(request, refusal, events, now)
            else:
                self._reserve(request, request.decision, now, events, targets[0])
        self._pump(now, snapshot, events)
        return events

    def handed_back(
        self,
        request_id: str,
        generated_tokens: int,
        now: float,
        snapshot: PoolSnapshot | None,
        *,
        broken: bool,
        target: str = "",
    ) -> list[Event[P]]:
        """Its stream stopped after bytes reached the client (`generated_tokens` of them
        in all) and before the request ended: the endpoint broke it (`broken`: never
        offered it again) or migrated it away (avoided a while), perhaps to a `target`
        that holds room for it. It resumes elsewhere."""
        request = self._requests[request_id]
        request.target = target
        endpoint = self._release(request)
        if broken:
            request.failed.add(endpoint)
        else:
            request.avoided[endpoint] = now + RESUME_BACKOFF_S
        request.resuming = True
        request.refusals = 0
        request.generated = generated_tokens
        request.waiting_since = now
        request.waited_before_s = 0.0
        self._resuming[request_id] = request
        return self.pump(now, snapshot)

    def finished(
        self,
        request_id: str,
        generated_tokens: int,
        now: float,
        snapshot: PoolSnapshot | None,
    ) -> list[Event[P]]:
        """The request ended here (answered, failed, its client left, or handed to another
        pool): its reservation and any wait are given up, its charge settled with what it
        generated, and the room it leaves pumped. Unknown requests are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        if self.queue.remove(request_id) is None:
            self._resuming.pop(request_id, None)
        self._release(request)
        self._settle(request, generated_tokens, now)
        return self.pump(now, snapshot)

    def reached(self, route: RouteRequest, endpoint_id: str) -> None:
        """The request `route` reached `endpoint_id`, which has it now (the router: it
        answered without refusing it; the simulator: its sidecar was offered it): the
        profile's post-decision hooks learn where it went. Without a prefix index there
        is no state for them to keep."""
        if self.prefix_index is not None:
            self.decider.placed(route, endpoint_id, self.prefix_index)

    def reported(self, endpoint_id: str, taken_at: float) -> None:
        """The endpoint reported at `taken_at`: what was sent to it before is in the
        report (pump after the snapshot that carries it)."""
        self.inflight.reported(endpoint_id, taken_at)

    def pump(self, now: float, snapshot: PoolSnapshot | None) -> list[Event[P]]:
        """End the waits that are over, then place what waits where there is room."""
        events: list[Event[P]] = []
        self._pump(now, snapshot, events)
        return events

    # -- the steps -------------------------------------------------------------------------

    def _new(self, route: RouteRequest, payload: P, now: float) -> _Request[P]:
        rid = route.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid} is already being dispatched")
        request = self._requests[rid] = _Request(route, payload, now)
        return request

    def _pump(self, now: float, snapshot: PoolSnapshot | None, events: list[Event[P]]) -> None:
        self._expire(now, events)
        if snapshot is None or self.idle:
            return
        # Resumes by class, oldest first within one (sorted is stable); each goes ahead of
        # the new work of its class and below.
        resumes = sorted(self._resuming.values(), key=lambda r: -r.route.priority)
        i, blocked, queue = 0, False, self.queue
        while True:
            entry = None if blocked else queue.peek()
            resume = resumes[i] if i < len(resumes) else None
            if resume is None and entry is None:
                return
            if resume is not None and (entry is None or resume.route.priority >= entry.priority):
                i += 1
                self._place_resume(resume, now, snapshot, events)
                continue
            assert entry is not None
            request = entry.payload
            decision = self._decide(request, now, snapshot)
            if not decision.endpoint_id:
                blocked = True  # the head holds the line for new work
                continue
            queue.pop(self._charge(request, decision, now, snapshot))  # charges its tenant
            self._reserve(request, decision, now, events)

    def _expire(self, now: float, events: list[Event[P]]) -> None:
        queue = self.queue
        due = queue.next_expiry()
        if due is not None and due <= now:
            # Counted before the expired leave: a client refused now comes back when the
            # oldest of them would have been let go.
            retry_after_s = queue.retry_after_s(now)
            for entry in queue.expire(now):
                if entry.expires_at < entry.enqueued_at + queue.max_wait_s:
                    message = "the request's deadline passed while every endpoint was saturated"
                    refusal = Refusal(504, DEADLINE, None, message)
                else:
                    message = f"every endpoint stayed saturated for {queue.max_wait_s:g}s"
                    refusal = Refusal(429, QUEUE_TIMEOUT, retry_after_s, message)
                self._drop(entry.payload, refusal, events, now)
        if not self._resuming:
            return
        for request in list(self._resuming.values()):
            if self._resume_expires_at(request) <= now:
                del self._resuming[request.route.request_id]
                message = (
                    f"no endpoint could resume the stream within {self.policy.resume_wait_s:g}s"
                )
                self._drop(request, Refusal(503, RESUME_FAILED, 1.0, message), events, now)
            elif request.avoided:
                request.avoided = {e: t for e, t in request.avoided.items() if t > now}

    def _enqueue(self, request: _Request[P], now: float, events: list[Event[P]]) -> None:
        route = request.route
        try:
            self.queue.offer(
                route.request_id, route.tenant, route.priority, now, request,
                max_wait_s=self._deadline_left(request, now) or None,
            )  # fmt: skip
        except QueueFullError as exc:
            message = "every endpoint is saturated and the queue is full"
            self._drop(request, Refusal(429, QUEUE_FULL, exc.retry_after_s, message), events, now)

    def _place_resume(
        self, request: _Request[P], now: float, snapshot: PoolSnapshot, events: list[Event[P]]
    ) -> None:
        exclude = frozenset(request.failed.union(request.avoided))
        decision = None
        target, request.target = request.target, ""
        if target and target not in exclude and target in snapshot.by_id:
            # The target alone: it stands as the only owner, every other endpoint excluded.
            others = frozenset(snapshot.by_id).difference((target,))
            decision = self._decide(
                request, now, snapshot, resume=True, exclude=others, owners=(target,),
                reserved_target=target,
            )  # fmt: skip
        if decision is None or not decision.endpoint_id:
            decision = self._decide(request, now, snapshot, resume=True, exclude=exclude)
        if decision.endpoint_id:
            del self._resuming[request.route.request_id]
            request.waited_before_s += now - request.waiting_since
            self._reserve(request, decision, now, events)

    def _resume_expires_at(self, request: _Request[P]) -> float:
        """When a resume's wait here for an endpoint ends: `resume_wait_s` in all, over
        its spells here since its hand-back."""
        return request.waiting_since + self.policy.resume_wait_s - request.waited_before_s

    def _decide(
        self,
        request: _Request[P],
        now: float,
        snapshot: PoolSnapshot,
        *,
        resume: bool = False,
        exclude: frozenset[str] = frozenset(),
        owners: tuple[str, ...] | None = None,
        reserved_target: str = "",
    ) -> Decision:
        route = request.route
        if now != request.arrived_at or resume:  # a new arrival routes as it came
            generated = request.generated
            route = replace(
                route,
                prompt_tokens=route.prompt_tokens + generated,
                max_new_tokens=max(1, route.max_new_tokens - generated),
                deadline_s=self._deadline_left(request, now),
                waited_s=now - request.waiting_since,
                exclude=exclude,
                owners=route.owners if owners is None else owners,
                reserved_target=reserved_target,
            )
        inflight = self.inflight
        ctx = RoutingContext(snapshot, now, inflight.counts, inflight.total, self.prefix_index)
        decide = self.decider.decide_resume if resume else self.decider.decide
        return decide(route, ctx)

    def _charge(
        self, request: _Request[P], decision: Decision, now: float, snapshot: PoolSnapshot
    ) -> float:
        """The KV cost a new request is charged as it is placed, remembered for its end."""
        route, view = request.route, snapshot.by_id[decision.endpoint_id]
        request.charge = Charge.placed(
            route.tenant, route.prompt_tokens, route.max_new_tokens, now,
            ttft_s=view.predicted_ttft_s, tpot_s=view.predicted_tpot_s,
        )  # fmt: skip
        return request.charge.estimate

    def _settle(self, request: _Request[P], generated_tokens: int, now: float) -> None:
        """A request's life here is over: its tenant's charge becomes what it really cost."""
        if request.charge is not None:
            self.queue.counters.settle(request.charge, generated_tokens, now)
            request.charge = None

    def _deadline_left(self, request: _Request[P], now: float) -> float:
        """The request's time budget left (0: it has none)."""
        budget = request.route.deadline_s
        if not budget:
            return 0.0
        return max(_MIN_DEADLINE_S, budget - (now - request.arrived_at))

    def _reserve(
        self,
        request: _Request[P],
        decision: Decision,
        now: float,
        events: list[Event[P]],
        endpoint: str = "",
    ) -> None:
        endpoint = endpoint or decision.endpoint_id
        if request.decision is None:
            request.decision = decision
        request.endpoint = endpoint
        self.inflight.add(endpoint, request.route.request_id, now)
        events.append(Placed(request.payload, endpoint, request.route))

    def _release(self, request: _Request[P]) -> str:
        endpoint, request.endpoint = request.endpoint, ""
        if endpoint:
            self.inflight.remove(endpoint, request.route.request_id)
        return endpoint

    def _drop(
        self, request: _Request[P], refusal: Refusal, events: list[Event[P]], now: float
    ) -> None:
        self._requests.pop(request.route.request_id, None)
        self._settle(request, request.generated, now)
        events.append(Refused(request.payload, refusal))
