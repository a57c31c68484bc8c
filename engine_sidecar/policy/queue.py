"""The bounded local admission queue: deadlines, aging and engine priority.

A request that does not fit right now waits here rather than being refused outright —
but only a bounded number of them, and only until its deadline or the policy's maximum
wait. Order is by effective priority, which rises with time waited (`aging_per_second`) so
that a low-priority request is delayed, never starved. A resume (a preempted request, or a
continuation migrated here) is work the fleet already accepted: it waits as if it were one
class higher (`RESUME_LEAD`), so it comes back before new arrivals of its class, and a full
queue does not refuse it (the streams already running bound how many there can be); it
waits as long as the pool lets a resume wait (`queue_wait_s`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from controlplane.contract import PoolPolicy
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


# How far ahead of new work of its class a resume waits, in priority classes.
RESUME_LEAD = 1.0


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
) -> QueuedRequest:
    """A request joining the queue at `now`. Its wait runs `max_wait_s` from now
    (`queue_wait_s`), cut short by its deadline: a continuation's from when it was
    handed back, not from its client's first arrival (it was streaming since). It ages from `arrived_at`: `now` for a request that just came, its first
    arrival for one preempted here, which keeps the place among its class that its time
    here earned."""
    expires_at = now + max_wait_s
    if deadline_at > 0:
        expires_at = min(expires_at, deadline_at)
    return QueuedRequest(rid, priority, arrived_at, expires_at, prompt_tokens, resumed)


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
    queue: tuple[QueuedRequest, ...], now: float, aging_per_second: float
) -> tuple[QueuedRequest, ...]:
    """Highest effective priority first (a resume `RESUME_LEAD` ahead); ties go to the
    earliest arrival."""
    return tuple(
        sorted(
            queue,
            key=lambda q: (
                -effective_priority(q.priority, now - q.enqueued_at, aging_per_second)
                - (RESUME_LEAD if q.resumed else 0.0),
                q.enqueued_at,
            ),
        )
    )


def expired(queue: tuple[QueuedRequest, ...], now: float) -> tuple[QueuedRequest, ...]:
    return tuple(q for q in queue if q.expires_at <= now)


def retry_after_s(queue_length: int, capacity: int, max_wait_s: float) -> int:
    """A Retry-After hint: longer as the queue fills, at least one second."""
    fullness = queue_length / capacity if capacity > 0 else 1.0
    return max(1, round(max_wait_s * min(1.0, fullness) / 4))


class AdmissionQueue(Generic[T]):
    """The local queue's discipline, the one the live ledger and the simulator both run:
    what may join (a full queue refuses new work, never a resume), the order
    (`queue_order`), who leaves when room frees (`pump`) and when a wait is over
    (`expire`). A request that fits may pass one ahead of it that waits for KV (a long
    prompt must not hold short ones back) — unless that one holds the line: a resume, or
    a request that has waited half its allowed wait. Then nothing passes it until it
    fits, so it cannot starve. Clock-free: every call is given `now`. Each entry carries
    the caller's payload (a waiter's future live, a flight in the simulator)."""

    def __init__(self, size: int, aging_per_second: float) -> None:
        self.size = size
        self.aging_per_second = aging_per_second
        self._entries: dict[str, tuple[QueuedRequest, T]] = {}

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
        self._entries[item.rid] = (item, payload)

    def remove(self, rid: str) -> T | None:
        entry = self._entries.pop(rid, None)
        return None if entry is None else entry[1]

    def expire(self, now: float) -> list[tuple[QueuedRequest, T]]:
        """Take out the entries whose wait is over."""
        gone = [entry for entry in self._entries.values() if entry[0].expires_at <= now]
        for item, _ in gone:
            del self._entries[item.rid]
        return gone

    def pump(
        self, now: float, decide: Callable[[QueuedRequest, T], AdmissionVerdict | None]
    ) -> Iterator[tuple[QueuedRequest, T, AdmissionVerdict]]:
        """The entries that leave now, in queue order: each one `decide` admits, and each
        one that can never fit (REFUSE); one that must wait is passed over, unless it
        holds the line, which ends the pump. `decide` may answer None for an entry to
        pass over (its waiter is already gone)."""
        ordered = queue_order(
            tuple(q for q, _ in self._entries.values()), now, self.aging_per_second
        )
        for item in ordered:
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
            del self._entries[item.rid]
            yield item, entry[1], verdict


def holds_line(queued: QueuedRequest, now: float) -> bool:
    """Whether a waiting request stops those behind it from passing: a resume does at
    once, any other once it has waited half its allowed wait."""
    return queued.resumed or now - queued.enqueued_at > (queued.expires_at - queued.enqueued_at) / 2
