"""The bounded local admission queue: deadlines, aging and engine priority.

A request that does not fit right now waits here rather than being refused outright —
but only a bounded number of them, and only until its deadline or the policy's maximum
wait. Order is by effective priority, which rises with time waited (`aging_per_second`) so
that a low-priority request is delayed, never starved. A resume (a preempted request, or a
continuation migrated here) is work the fleet already accepted: it waits as if it were one
class higher (`RESUME_LEAD`), so it comes back before new arrivals of its class, and a full
queue does not refuse it (the streams already running bound how many there can be).
"""

from __future__ import annotations

from dataclasses import dataclass


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
                q.rid,
            ),
        )
    )


def expired(queue: tuple[QueuedRequest, ...], now: float) -> tuple[QueuedRequest, ...]:
    return tuple(q for q in queue if q.expires_at <= now)


def retry_after_s(queue_length: int, capacity: int, max_wait_s: float) -> int:
    """A Retry-After hint: longer as the queue fills, at least one second."""
    fullness = queue_length / capacity if capacity > 0 else 1.0
    return max(1, round(max_wait_s * min(1.0, fullness) / 4))
