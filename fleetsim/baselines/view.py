"""What a baseline router can see of the fleet, and the one method every baseline has.

Each baseline sees only what the system it is named after sees: SGLang's router counts
the requests it has in flight per worker (no engine metrics); llm-d's endpoint picker
scrapes each engine's waiting queue and KV utilization on an interval (stale by up to that
interval); round robin sees nothing but liveness. The simulator fills in `WorkerView`s
with exactly those figures and the staleness its configuration asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetsim.workloads import RequestSpec


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One engine as a baseline router sees it.

    `outstanding` is the router's own count of requests it sent there that have not
    finished (exact, no staleness); `waiting_requests` and `kv_utilization` are the
    engine's scraped metrics as of `scraped_at`.
    """

    index: int
    healthy: bool
    outstanding: int
    waiting_requests: int
    kv_utilization: float
    scraped_at: float = 0.0


class BaselineRouter(Protocol):
    """Picks one healthy worker per request; may keep state across calls."""

    name: str

    def route(self, request: RequestSpec, workers: Sequence[WorkerView], now: float) -> int:
        """The chosen worker's index; raises `NoHealthyWorkerError` when none is healthy."""
        ...

    def forget(self, worker: int) -> None:
        """The worker left the fleet (failure): drop whatever the router remembers of it."""
        ...


class NoHealthyWorkerError(RuntimeError):
    pass


def healthy(workers: Sequence[WorkerView]) -> list[WorkerView]:
    alive = [w for w in workers if w.healthy]
    if not alive:
        raise NoHealthyWorkerError("no healthy worker")
    return alive
