"""Watermark states with hysteresis, reconciliation with stale engine figures, growth rate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.contract import KVPolicy, WatermarkState
from engine_sidecar.policy import (
    GrowthRate,
    KVUsage,
    classify_watermark,
    reconcile_used,
    steady_range,
)

W = WatermarkState
POLICY = KVPolicy(low_watermark=0.7, high_watermark=0.85, emergency_watermark=0.95, hysteresis=0.05)


def _u(used: int, reserved: int = 0) -> KVUsage:
    return KVUsage(capacity_tokens=1000, used_tokens=used, reserved_growth_tokens=reserved)


@pytest.mark.parametrize(
    ("used", "state"),
    [(0, W.NORMAL), (699, W.NORMAL), (700, W.PRESSURE), (850, W.CRITICAL), (950, W.EXHAUSTED)],
)
def test_rises_at_once(used: int, state: WatermarkState) -> None:
    assert classify_watermark(_u(used), W.NORMAL, POLICY) is state


def test_reserved_growth_counts() -> None:
    assert classify_watermark(_u(600, 260), W.NORMAL, POLICY) is W.CRITICAL


def test_steps_down_only_past_hysteresis() -> None:
    assert classify_watermark(_u(830), W.CRITICAL, POLICY) is W.CRITICAL
    assert classify_watermark(_u(801), W.CRITICAL, POLICY) is W.CRITICAL
    assert classify_watermark(_u(790), W.CRITICAL, POLICY) is W.PRESSURE
    assert classify_watermark(_u(100), W.EXHAUSTED, POLICY) is W.NORMAL


def test_no_flapping_around_a_threshold() -> None:
    state = W.NORMAL
    seen = []
    for used in (700, 690, 705, 680, 702, 660, 640):
        state = classify_watermark(_u(used), state, POLICY)
        seen.append(state)
    assert seen == [W.PRESSURE] * 6 + [W.NORMAL]


def test_unknown_capacity_fails_closed() -> None:
    assert classify_watermark(KVUsage(0, 0, 0), W.NORMAL, POLICY) is W.EXHAUSTED


def test_reconcile_prefers_fresh_larger_engine_figure_only() -> None:
    assert reconcile_used(100, None, 0, 0) == 100
    assert reconcile_used(100, 300, engine_sampled_at=5, last_release_at=4) == 300
    assert reconcile_used(100, 300, engine_sampled_at=3, last_release_at=4) == 100
    assert reconcile_used(400, 300, engine_sampled_at=5, last_release_at=0) == 400


def test_growth_rate_tracks_steady_growth() -> None:
    rate = GrowthRate()
    for step in range(50):
        rate = rate.observe(used_tokens=100 * step, now=float(step))
    assert rate.tokens_per_s == pytest.approx(100, rel=0.01)
    same = rate.observe(used_tokens=rate.last_used_tokens, now=rate.last_at or 0.0)
    assert same.tokens_per_s == rate.tokens_per_s


@given(
    st.lists(st.floats(0.05, 0.99), min_size=3, max_size=3, unique=True),
    st.floats(0.0, 0.2),
    st.integers(0, 300_000),
    st.sampled_from(list(W)),
    st.lists(st.integers(0, 700_000), min_size=1, max_size=20),
)
def test_the_steady_range_is_where_classify_keeps_the_state(
    thresholds: list[float],
    hysteresis: float,
    capacity: int,
    state: WatermarkState,
    counts: list[int],
) -> None:
    low_w, high_w, emergency = sorted(thresholds)
    policy = KVPolicy(
        low_watermark=low_w,
        high_watermark=high_w,
        emergency_watermark=emergency,
        hysteresis=hysteresis,
    )
    low, high = steady_range(state, capacity, policy)
    edges = [low - 1, low, high - 1, high] if high > low else []
    for committed in [*counts, *(c for c in edges if 0 <= c < 10**7)]:
        kept = classify_watermark(KVUsage(capacity, committed, 0), state, policy) is state
        assert kept == (low <= committed < high), (committed, low, high)
