"""Built-in pickers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.routing.framework import Cycle
from controlplane.routing.snapshot import EndpointView


@dataclass(frozen=True, slots=True)
class MaxScore:
    """The highest total score; ties go to the earlier candidate, and candidates list the
    owners first, so an owner wins any tie."""

    name: str = "max-score"

    def pick(
        self, cycle: Cycle, candidates: Sequence[EndpointView], scores: Sequence[float]
    ) -> int:
        best, best_score = 0, scores[0]
        for i in range(1, len(scores)):
            if scores[i] > best_score:
                best, best_score = i, scores[i]
        return best
