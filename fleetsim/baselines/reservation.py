"""Admission that reserves every request's full `max_tokens` up front.

What a conservative server does when it wants to never run out of KV: a request is let
into the engine only if its prompt plus its whole `max_tokens` still fits beside the
prompts and full `max_tokens` of everything already admitted; otherwise it waits in a FIFO
queue. Hugging Face text-generation-inference's v2 batching queue works this way (github
huggingface/text-generation-inference, `router/src/infer/v2/queue.rs`, `next_batch`: a
request enters the batch only while `prefill_tokens + decode_tokens` — its input plus its
`max_new_tokens` — stays within `max_batch_total_tokens`), as do servers that size
batches by `max_tokens`. It never exhausts KV and admits far too little: most answers end
long before `max_tokens`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class MaxTokensReservation(Generic[T]):
    """One engine's reservation ledger and FIFO queue; `cost` is prompt + max_tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.reserved_tokens = 0
        self.queue: deque[tuple[T, int]] = deque()
        self._held: dict[int, int] = {}

    def fits_ever(self, cost: int) -> bool:
        return cost <= self.capacity_tokens

    def offer(self, item: T, cost: int) -> None:
        self.queue.append((item, cost))

    def admit(self, send: Callable[[T], bool]) -> int:
        """Admit queued items head first while they fit (head-of-line blocking, as a
        FIFO does); `send` returns False for an item that vanished. Returns how many."""
        admitted = 0
        while self.queue:
            item, cost = self.queue[0]
            if self.reserved_tokens + cost > self.capacity_tokens:
                break
            self.queue.popleft()
            if send(item):
                self.reserved_tokens += cost
                self._held[id(item)] = cost
                admitted += 1
        return admitted

    def release(self, item: T) -> None:
        cost = self._held.pop(id(item), 0)
        self.reserved_tokens -= cost

    def discard(self, item: T) -> None:
        """Drop a queued item (its client left) or release an admitted one."""
        self.release(item)
        self.queue = deque((i, c) for i, c in self.queue if i is not item)
