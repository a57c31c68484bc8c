"""The bounded local admission queue: deadlines, aging, tenant fairness, engine priority.

A request that does not fit right now waits here rather than being refused outright —
but only a bounded number of them, and only until its deadline or the policy's maximum
wait. Classes go by effective priority, which rises with time waited
(`aging_per_second`) so that a low-priority request is delayed, never starved. A resume
(a preempted request, or a continuation migrated here) is work the fleet already
accepted: it waits as if it were one class higher (`RESUME_LEAD`), so it comes back
before new arrivals of its class, and a full queue does not refuse it (the streams
already running bound how many there can be); it waits as long as the pool lets a
resume wait (`queue_wait_s`).

Inside a class, tenants share by KV cost with their weights, by the rule of the router's
fair queue (`controlplane.rules.fairness`): here is where it binds. The router holds
requests only while every endpoint is saturated and lets them all go when one is not;
which of them the engine runs is decided here, so this queue orders them by the same
virtual counters. The sidecar charges every request it admits, queued or not, the KV it
is expected to pin here (`AdmissionQueue.charge`) and settles that when the request's KV
is released (`AdmissionQueue.settle`): each stay in the engine is one charge.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from controlplane.contract import PoolPolicy
from controlplane.rules.fairness import Charge, VirtualCounters
from engine_sidecar.policy.admission import RESERVED, AdmissionDecision, AdmissionVerdict

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    rid: str
    priority: int
    enqueued_at: float
    expires_at: float
    prompt_tokens: int
    resumed: bool = False
    tenant: str = "default"
    cost: float = 0.0  # the KV cost its tenant is charged when it is admitted


# How far ahead of new work of its class a resume waits, in priority classes.
RESUME_LEAD: Final = 1.0


def queue_wait_s(policy: PoolPolicy, resumed: bool) -> float:
    """How long a request may wait in the local queue: new work the pool's local wait
    (`scheduling.local_queue_max_wait_s`); a resume, work the fleet already accepted and
    holding the line here, as long as the pool lets a resume wait anywhere
    (`routing.resume_wait_s`, the router's bound too)."""
    if resumed:
        return policy.routing.resume_wait_s
    return policy.scheduling.local_queue_max_wait_s


def queued_request(
    rid: str,
    priority: int,
    prompt_tokens: int,
    *,
    arrived_at: float,
    now: float,
    max_wait_s: float,
    deadline_at: float = 0.0,
    resumed: bool = False,
    charge: Charge | None = None,
) -> QueuedRequest:
    """A request joining the queue at `now`. Its wait runs `max_wait_s` from now
    (`queue_wait_s`), cut short by its deadline: a continuation's from when it was
    handed back, not from its client's first arrival (it was streaming since). It ages
    from `arrived_at`: `now` for a request that just came, its first arrival for one
    preempted here, which keeps the place among its class that its time here earned.
    `charge` is what its admission would charge its tenant (`Charge.placed`; none: the
    default tenant, charged nothing)."""
    expires_at = now + max_wait_s
    if deadline_at > 0:
        expires_at = min(expires_at, deadline_at)
    tenant, cost = ("default", 0.0) if charge is None else (charge.tenant, charge.estimate)
    return QueuedRequest(
        rid, priority, arrived_at, expires_at, prompt_tokens, resumed, tenant, cost
    )


def admits_now(decision: AdmissionDecision, waiting: int) -> bool:
    """Whether a request that fits goes in at once rather than through the queue: when
    nothing waits, or when the room was held for it (`RESERVED`: never anyone else's)."""
    return decision.verdict is AdmissionVerdict.ADMIT and (
        not waiting or decision.reason == RESERVED
    )


def effective_priority(priority: int, waited_s: float, aging_per_second: float) -> float:
    return priority + max(0.0, waited_s) * aging_per_second


def engine_priority(
    priority: int, waited_s: float, deadline_slack_s: float | None, aging_per_second: float
) -> int:
    """The integer priority sent to the engine (higher runs first): the request's class,
    plus aging, plus urgency as its deadline approaches (within ten seconds)."""
    urgency = 0.0 if deadline_slack_s is None else max(0.0, 10.0 - max(0.0, deadline_slack_s))
    return int(effective_priority(priority, waited_s, aging_per_second) + urgency)


def queue_order(
    queue: tuple[QueuedRequest, ...],
    now: float,
    aging_per_second: float,
    counters: VirtualCounters,
) -> tuple[QueuedRequest, ...]:
    """Class by class by aged priority; inside a class, tenant by tenant by KV cost.

    A request's class is its priority, a resume's `RESUME_LEAD` above. Inside a class,
    tenants take turns by their virtual counters (`counters`): a request ranks at its
    tenant's counter plus what its tenant's requests ahead of it in the class will be
    charged (start-time fair queueing: the order the fair queue's pick serves them in,
    were each admitted as it comes up), each tenant's own in arrival order; ties go to
    the earliest arrival, then to the order they came in. Across classes the next one is
    the head of the class whose head has the highest effective priority (ties: the
    higher class): a head that waited long goes ahead of younger work of a higher
    class, so a class is delayed, never starved, while aging never reorders tenants
    inside one."""
    return tuple(merge_classes(class_lines(queue, counters), now, aging_per_second))


def class_lines(
    queue: tuple[QueuedRequest, ...], counters: VirtualCounters
) -> dict[float, tuple[QueuedRequest, ...]]:
    """Each class's requests in `queue_order`'s order inside a class: a function of the
    requests and the tenants' counters only (not of the clock)."""
    classes: dict[float, list[tuple[float, int, QueuedRequest]]] = {}
    for i, q in enumerate(queue):
        lead = RESUME_LEAD if q.resumed else 0.0
        classes.setdefault(q.priority + lead, []).append((q.enqueued_at, i, q))
    lines: dict[float, tuple[QueuedRequest, ...]] = {}
    for klass, members in classes.items():
        members.sort()
        ahead: dict[str, float] = {}
        ranked = []
        for enqueued_at, i, q in members:
            start = ahead.get(q.tenant)
            if start is None:
                start = counters.counter(q.tenant)
            ahead[q.tenant] = start + counters.share(q.tenant, q.cost)
            ranked.append((start, enqueued_at, i, q))
        ranked.sort()
        lines[klass] = tuple(r[-1] for r in ranked)
    return lines


def merge_classes(
    lines: Mapping[float, tuple[QueuedRequest, ...]], now: float, aging_per_second: float
) -> Iterator[QueuedRequest]:
    """`queue_order` across classes at `now`, lazily: a pump that stops at its first
    request orders no more."""
    if len(lines) == 1:
        (line,) = lines.values()
        yield from line
        return
    at = dict.fromkeys(lines, 0)

    def aged(klass: float) -> tuple[float, float, float]:
        head = lines[klass][at[klass]]
        waited = now - head.enqueued_at
        lead = klass - head.priority
        return (-effective_priority(head.priority, waited, aging_per_second) - lead, -klass, klass)

    heads = [aged(klass) for klass in lines]
    heapq.heapify(heads)
    while heads:
        klass = heapq.heappop(heads)[-1]
        line, i = lines[klass], at[klass]
        yield line[i]
        at[klass] = i + 1
        if i + 1 < len(line):
            heapq.heappush(heads, aged(klass))


def expired(queue: tuple[QueuedRequest, ...], now: float) -> tuple[QueuedRequest, ...]:
    return tuple(q for q in queue if q.expires_at <= now)


def retry_after_s(queue_length: int, capacity: int, max_wait_s: float) -> int:
    """A Retry-After hint: longer as the queue fills, at least one second."""
    fullness = queue_length / capacity if capacity > 0 else 1.0
    return max(1, round(max_wait_s * min(1.0, fullness) / 4))


class AdmissionQueue(Generic[T]):
    """The local queue's discipline, the one the live ledger and the simulator both run:
    what may join (a full queue refuses new work, never a resume), the order
    (`queue_order`, with the tenants' counters kept here), who leaves when room frees
    (`pump`) and when a wait is over (`expire`). A request that fits may pass one ahead
    of it that waits for KV (a long prompt must not hold short ones back) — unless that
    one holds the line: a resume, or a request that has waited half its allowed wait.
    Then nothing passes it until it fits, so it cannot starve. Clock-free: every call is
    given `now`. Each entry carries the caller's payload (a waiter's future live, a
    flight in the simulator). `weights` are the tenants' fair-share weights
    (`tenant_weights` of the pool policy's tenants; 1 for any other)."""

    def __init__(
        self, size: int, aging_per_second: float, weights: Mapping[str, float] | None = None
    ) -> None:
        self.size = size
        self.aging_per_second = aging_per_second
        self.counters = VirtualCounters(weights)
        self._entries: dict[str, tuple[QueuedRequest, T]] = {}
        self._waiting: Counter[str] = Counter()  # entries per tenant
        # Each class's line as the last pump ordered it, kept while neither the entries
        # nor the counters change (an engine's every iteration pumps a waiting queue;
        # the clock alone only moves classes against each other).
        self._lines: dict[float, tuple[QueuedRequest, ...]] = {}
        self._lines_for: tuple[int, VirtualCounters | None, int] = (-1, None, -1)
        self._changes = 0
        # The entries' prompt tokens, summed as they come and go: every latency forecast
        # counts them among the prefill ahead.
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def entries(self) -> list[tuple[QueuedRequest, T]]:
        return list(self._entries.values())

    def refuses(self, resumed: bool) -> bool:
        """Whether a request must be refused for a full queue (a resume never is)."""
        return not resumed and len(self._entries) >= self.size

    def offer(self, item: QueuedRequest, payload: T) -> None:
        """Queue `item`; a tenant with nothing waiting here is lifted to the least
        counter of those waiting (idle time is not banked)."""
        if not self._waiting[item.tenant]:
            self.counters.join(item.tenant, +self._waiting)
        self._entries[item.rid] = (item, payload)
        self._waiting[item.tenant] += 1
        self._changes += 1
        self.prompt_tokens += item.prompt_tokens

    def remove(self, rid: str) -> T | None:
        entry = self._entries.get(rid)
        if entry is None:
            return None
        self._take(entry[0])
        return entry[1]

    def expire(self, now: float) -> list[tuple[QueuedRequest, T]]:
        """Take out the entries whose wait is over."""
        gone = [entry for entry in self._entries.values() if entry[0].expires_at <= now]
        for item, _ in gone:
            self._take(item)
        return gone

    def charge(self, charge: Charge) -> Charge:
        """A request of `charge`'s tenant was admitted, from the queue or not: its tenant
        is charged the KV it is expected to pin here until `settle`."""
        self.counters.charge(charge.tenant, charge.estimate)
        return charge

    def settle(self, charge: Charge, output_tokens: int, now: float) -> None:
        """The KV the request was admitted with is released (it ended, was preempted or
        left), `output_tokens` generated since: the charge becomes what it really cost."""
        self.counters.settle(charge, output_tokens, now)

    def pump(
        self, now: float, decide: Callable[[QueuedRequest, T], AdmissionVerdict | None]
    ) -> Iterator[tuple[QueuedRequest, T, AdmissionVerdict]]:
        """The entries that leave now, in queue order: each one `decide` admits, and each
        one that can never fit (REFUSE); one that must wait is passed over, unless it
        holds the line, which ends the pump. `decide` may answer None for an entry to
        pass over (its waiter is already gone)."""
        for item in merge_classes(self._class_lines(), now, self.aging_per_second):
            entry = self._entries.get(item.rid)
            if entry is None:
                continue
            verdict = decide(item, entry[1])
            if verdict is None:
                continue
            if verdict is AdmissionVerdict.WAIT:
                if holds_line(item, now):
                    return
                continue
            self._take(item)
            yield item, entry[1], verdict

    def settled_until(self) -> float:
        """Right after a pump that let nothing out: until when every pump would let
        nothing out either, as long as the entries, the counters and what `decide`
        answers for each stay as they are. With one class that is until the first entry
        expires: the order inside a class does not move with the clock, and a line held
        only holds longer, so no pump decides an entry the last one did not. With
        several, -inf: which class's head goes first is decided in floating point at
        each pump, and heads whose aged priorities tie may compare either way at another
        time, putting first an entry the last pump never reached."""
        lines = self._class_lines()
        if len(lines) != 1:
            return -math.inf
        return min(q.expires_at for q, _ in self._entries.values())

    def _class_lines(self) -> dict[float, tuple[QueuedRequest, ...]]:
        state = (self._changes, self.counters, self.counters.changes)  # counters replaced too
        if state != self._lines_for:
            entries = tuple(q for q, _ in self._entries.values())
            self._lines, self._lines_for = class_lines(entries, self.counters), state
        return self._lines

    def _take(self, item: QueuedRequest) -> None:
        del self._entries[item.rid]
        self._waiting[item.tenant] -= 1
        self._changes += 1
        self.prompt_tokens -= item.prompt_tokens


def holds_line(queued: QueuedRequest, now: float) -> bool:
    """Whether a waiting request stops those behind it from passing: a resume does at
    once, any other once it has waited half its allowed wait."""
    return queued.resumed or now - queued.enqueued_at > (queued.expires_at - queued.enqueued_at) / 2
