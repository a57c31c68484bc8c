"""KV watermark states with hysteresis, and the growth rate that feeds them.

Usage counts what the engine holds *and* the growth already reserved for running
sequences: a pool that is 80 % full with every sequence about to grow is in more danger
than the raw figure says. States rise as soon as usage crosses a threshold and step down
only once usage is `hysteresis` below it, so a pool hovering at a threshold does not flap
between admitting and refusing.

Thresholds come from `KVPolicy`: pressure at `low_watermark`, critical at
`high_watermark`, exhausted at `emergency_watermark`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.contract import KVPolicy, WatermarkState


@dataclass(slots=True)
class KVUsage:
    """The KV pool at one moment, in tokens: a value, never changed once made (not
    frozen, as `EngineLoad`: it is built at every admission and KV account)."""

    capacity_tokens: int
    used_tokens: int
    reserved_growth_tokens: int

    def __init__(self, capacity_tokens: int, used_tokens: int, reserved_growth_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = used_tokens
        self.reserved_growth_tokens = reserved_growth_tokens

    @property
    def committed_tokens(self) -> int:
        return self.used_tokens + self.reserved_growth_tokens

    @property
    def fraction(self) -> float:
        """Committed fraction of capacity; 1.0 while capacity is unknown (fail closed)."""
        if self.capacity_tokens <= 0:
            return 1.0
        return self.committed_tokens / self.capacity_tokens


def _level(fraction: float, policy: KVPolicy) -> WatermarkState:
    if fraction >= policy.emergency_watermark:
        return WatermarkState.EXHAUSTED
    if fraction >= policy.high_watermark:
        return WatermarkState.CRITICAL
    if fraction >= policy.low_watermark:
        return WatermarkState.PRESSURE
    return WatermarkState.NORMAL


def classify_watermark(
    usage: KVUsage, previous: WatermarkState, policy: KVPolicy
) -> WatermarkState:
    """The watermark state after `previous`, given `usage`: up at once, down with hysteresis."""
    rising = _level(usage.fraction, policy)
    if rising.rank >= previous.rank:
        return rising
    falling = _level(usage.fraction + policy.hysteresis, policy)
    return falling if falling.rank < previous.rank else previous


def steady_range(state: WatermarkState, capacity_tokens: int, policy: KVPolicy) -> tuple[int, int]:
    """The committed token counts `[low, high)` at which `classify_watermark` keeps `state`.

    A ledger that moves by a few tokens per streamed event need only compare its sum with
    this range, and classify when it leaves it. The range is found by bisection on
    `classify_watermark` itself (which never falls as the count rises), so it agrees with
    `classify_watermark` exactly, float rounding included."""

    def above(committed: int) -> bool:  # classify_watermark leaves `state` upwards
        usage = KVUsage(capacity_tokens, committed, 0)
        return classify_watermark(usage, state, policy).rank > state.rank

    def at_least(committed: int) -> bool:  # classify_watermark reaches `state` or more
        usage = KVUsage(capacity_tokens, committed, 0)
        return classify_watermark(usage, state, policy).rank >= state.rank

    top = 4 * max(capacity_tokens, 1)  # past any threshold (fractions are at most ~1)
    high = _first(above, top) if above(top) else sys.maxsize
    low = _first(at_least, top) if at_least(top) else high
    return low, max(low, high)


def _first(holds: Callable[[int], bool], top: int) -> int:
    """The least n in [0, top] at which `holds` (false, then true for good) holds."""
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def reconcile_used(
    own_tokens: int, engine_tokens: int | None, engine_sampled_at: float, last_release_at: float
) -> int:
    """KV in use, from the sidecar's own accounting checked against the engine's report.

    The engine's figure (loads or metrics) can lag by many decode steps; the sidecar's own
    count moves with every streamed token. The engine's figure wins only when it is larger
    and was sampled after the sidecar last released KV — otherwise a stale report would
    hide capacity a cancel just freed."""
    if engine_tokens is None or engine_sampled_at < last_release_at:
        return own_tokens
    return max(own_tokens, engine_tokens)


@dataclass(frozen=True, slots=True)
class GrowthRate:
    """An exponentially smoothed KV growth rate in tokens per second."""

    tokens_per_s: float = 0.0
    last_used_tokens: int = 0
    last_at: float | None = None
    half_life_s: float = 2.0

    def observe(self, used_tokens: int, now: float) -> GrowthRate:
        if self.last_at is None or now <= self.last_at:
            return GrowthRate(self.tokens_per_s, used_tokens, now, self.half_life_s)
        elapsed = now - self.last_at
        sample = (used_tokens - self.last_used_tokens) / elapsed
        keep = 0.5 ** (elapsed / self.half_life_s)
        rate = keep * self.tokens_per_s + (1.0 - keep) * sample
        return GrowthRate(rate, used_tokens, now, self.half_life_s)
