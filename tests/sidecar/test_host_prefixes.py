"""What a sidecar publishes as held in its engine's host tier: bounded as the tier is."""

from __future__ import annotations

import pytest

from controlplane.contract import MAX_HOST_PREFIXES
from engine_sidecar.policy import HostPrefixes


def test_offloads_are_published_most_recent_first_until_they_load_back() -> None:
    held = HostPrefixes(capacity_tokens=1000)
    held.offloaded(0, 100)  # a request no router keyed: nothing to publish
    held.offloaded(1, 100)
    held.offloaded(2, 100)
    assert held.published() == (2, 1)
    held.offloaded(1, 200)  # offloaded again: the most recent, and counted once
    assert held.published() == (1, 2)
    held.loaded(1)
    held.loaded(7)  # never held: nothing changes
    assert held.published() == (2,)


def test_the_oldest_leave_first_beyond_the_tier_s_tokens_or_the_published_count() -> None:
    held = HostPrefixes(capacity_tokens=1000)
    for block in (1, 2, 3):
        held.offloaded(block, 400)
    assert held.published() == (3, 2)  # 1,200 tokens would not fit: the LRU one is out
    held.offloaded(4, 5000)  # larger than the tier: nothing of it, nor the rest, stays
    assert held.published() == ()
    many = HostPrefixes(capacity_tokens=10**9)
    for block in range(1, MAX_HOST_PREFIXES + 5):
        many.offloaded(block, 1)
    assert many.published() == tuple(range(MAX_HOST_PREFIXES + 4, 4, -1))
    with pytest.raises(ValueError, match="capacity_tokens"):
        HostPrefixes(-1)
