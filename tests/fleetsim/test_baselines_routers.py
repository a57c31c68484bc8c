"""Each baseline router behaves as the system it is named after."""

from __future__ import annotations

import pytest

from fleetsim.baselines import (
    LeastOutstanding,
    LlmdWeighted,
    NoHealthyWorkerError,
    RoundRobin,
    SGLangCacheAware,
    WorkerView,
)
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec


def _req(rid: str, blocks: tuple[int, ...]) -> RequestSpec:
    return RequestSpec(rid, 0.0, "t", 1, len(blocks) * BLOCK_TOKENS, 10, 10, blocks)


def _views(
    outstanding: list[int], waiting: list[int] | None = None, kv: list[float] | None = None
) -> list[WorkerView]:
    n = len(outstanding)
    waiting = waiting or [0] * n
    kv = kv or [0.0] * n
    return [WorkerView(i, True, outstanding[i], waiting[i], kv[i]) for i in range(n)]


def test_round_robin_cycles_over_healthy_workers() -> None:
    rr = RoundRobin()
    views = _views([0, 0, 0])
    views[1] = WorkerView(1, False, 0, 0, 0.0)
    assert [rr.route(_req(str(i), (i,)), views, 0.0) for i in range(4)] == [0, 2, 0, 2]
    with pytest.raises(NoHealthyWorkerError):
        rr.route(_req("x", (1,)), [WorkerView(0, False, 0, 0, 0.0)], 0.0)


def test_least_outstanding_picks_the_emptiest() -> None:
    lo = LeastOutstanding(seed=1)
    assert lo.route(_req("a", (1,)), _views([3, 1, 2]), 0.0) == 1
    picks = {lo.route(_req("b", (1,)), _views([1, 1, 5]), 0.0) for _ in range(30)}
    assert picks == {0, 1}


def test_sglang_cache_aware_follows_prefix_then_balances() -> None:
    router = SGLangCacheAware()
    views = _views([0, 0, 0, 0])
    first = router.route(_req("a", (1, 2, 3, 4)), views, 0.0)
    # 3 of 4 blocks matched (> 0.3): same worker.
    assert router.route(_req("b", (1, 2, 3, 9)), views, 1.0) == first
    # 1 of 4 matched (0.25 <= 0.3): the worker with the smallest tree instead.
    other = router.route(_req("c", (1, 7, 8, 9)), views, 2.0)
    assert other != first
    # Imbalance: max - min > 64 and max > 1.5 x min -> least loaded wins, prefix or not.
    loads = [100, 0, 0, 0]
    loads[first] = 100
    loads[0 if first else 1] = 10
    skewed = _views(loads)
    chosen = router.route(_req("d", (1, 2, 3, 4)), skewed, 3.0)
    assert chosen != first
    assert router.balancing_events == 1
    router.forget(first)
    assert router.tree.prefix_match((1, 2, 3, 4), {first}) == (0, None)


def test_llmd_scores_queue_kv_and_prefix_with_weights_2_2_3() -> None:
    router = LlmdWeighted(seed=0)
    # Worker 1 has the shortest queue and the emptiest KV: 2 + 2 beats worker 0's 0 + 0.
    views = _views([0, 0], waiting=[4, 0], kv=[0.9, 0.1])
    assert router.route(_req("a", (1, 2)), views, 0.0) == 1
    # Prefix (x3) now on worker 1; worker 0 is better on queue and KV by less than 3.
    views = _views([0, 0], waiting=[0, 1], kv=[0.0, 0.5])
    assert router.route(_req("b", (1, 2)), views, 0.0) == 1
    # A busy, nearly full holder (0 + 0.1 + 3) loses to an idle empty worker (2 + 2 + 0).
    views = _views([0, 0], waiting=[0, 10], kv=[0.0, 0.95])
    assert router.route(_req("c", (1, 2)), views, 0.0) == 0
