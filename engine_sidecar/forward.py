"""What the sidecar adds to the relay of an engine segment (`controlplane.stream.relay`):
the request's deadline, its preemption, and the ledger told of every read's tokens."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.stream import Splicer
from controlplane.stream.relay import SegmentWatch
from engine_sidecar.ledger import Flight, Ledger


class LedgerWatch(SegmentWatch):
    """One segment of one streamed request, as the ledger sees it."""

    guarded = True

    def __init__(
        self,
        splicer: Splicer,
        flight: Flight,
        ledger: Ledger,
        note_tokens: Callable[[Flight, int, int], None],
        base: int,
    ) -> None:
        self._splicer = splicer
        self._flight = flight
        self._ledger = ledger
        self._note_tokens = note_tokens
        self._base = base  # tokens the request had before this endpoint took it over
        self._deadline = flight.record.deadline_at
        self._prompt = 0  # the engine's prompt size, once the ledger has it

    def deadline_passed(self) -> bool:
        return bool(self._deadline) and self._ledger.clock() >= self._deadline

    def preempting(self) -> bool:
        return bool(self._flight.preempt_mode)

    def delivered(self) -> None:
        """The events of one read arrived together: the ledger takes their total (and the
        engine's prompt size, when it first shows) once, after the client has them."""
        prompt = self._splicer.engine_prompt_tokens
        if prompt != self._prompt:
            self._prompt = prompt
            self._ledger.set_prompt_tokens(self._flight, prompt)
        splicer = self._splicer
        self._note_tokens(self._flight, splicer.generated - self._base, splicer.cached_tokens or 0)
