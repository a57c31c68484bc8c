"""Online output-length prediction per tenant and model.

Completed requests calibrate it: each key keeps a bounded window of observed output
lengths (the most recent ones: workloads drift). A prediction for a running request is
conditional on what it has already generated — a request that is already 900 tokens long
is judged against the requests that got that far, not against the whole distribution —
and it is always bounded by the request's own `max_new_tokens`. With no history the
predictor falls back to the model's history across tenants, then to a prior.

Each completion also reports how far the admission-time prediction was off, which the
sidecar exports as `weir_sidecar_output_length_prediction_error_tokens`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LengthKey:
    tenant: str
    model: str

    def __hash__(self) -> int:
        # The generated one's value, written out: mypyc compiles only the methods written
        # out (the fleet simulator's `--compiled`), and a key is hashed at every
        # prediction, for every running request at every KV account.
        return hash((self.tenant, self.model))


@dataclass
class OutputLengthPredictor:
    """Quantiles of output length per (tenant, model), from a window of completions."""

    window: int = 512
    prior_tokens: int = 256
    _recent: dict[LengthKey, deque[int]] = field(default_factory=dict)
    _sorted: dict[LengthKey, list[int]] = field(default_factory=dict)

    def observe(self, key: LengthKey, output_tokens: int) -> None:
        """Record a completed request's output length (natural ends only: stop or length)."""
        for k in (key, LengthKey("", key.model)):
            recent = self._recent.setdefault(k, deque())
            ordered = self._sorted.setdefault(k, [])
            if len(recent) >= self.window:
                ordered.pop(bisect.bisect_left(ordered, recent.popleft()))
            recent.append(output_tokens)
            bisect.insort(ordered, output_tokens)

    def samples(self, key: LengthKey) -> int:
        return len(self._sorted.get(key, ()))

    def predict_total(
        self, key: LengthKey, quantile: float, generated: int, max_new_tokens: int
    ) -> int:
        """The `quantile` of total output length given `generated` tokens so far.

        Always more than `generated` while tokens remain (a running sequence never has zero
        predicted growth) and never more than `max_new_tokens`."""
        if generated >= max_new_tokens:
            return max_new_tokens
        ordered = self._sorted.get(key) or self._sorted.get(LengthKey("", key.model)) or []
        # The lengths longer than `generated` are ordered[first:] (indexed, not copied:
        # the sidecar asks for every running request at every relief pass).
        first = bisect.bisect_right(ordered, generated)
        longer = len(ordered) - first
        if longer:
            total = ordered[first + min(longer - 1, max(0, math.ceil(quantile * longer) - 1))]
        elif ordered:
            # Already longer than anything seen: expect it to run as long again.
            total = 2 * generated
        else:
            total = max(self.prior_tokens, 2 * generated)
        return max(generated + 1, min(max_new_tokens, total))
