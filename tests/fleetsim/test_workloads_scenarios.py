"""The validation-matrix scenarios: seeded, jointly distributed, and shaped as named."""

from __future__ import annotations

import numpy as np
import pytest

from fleetsim.report.matrix import CellSpec, fleet_config
from fleetsim.workloads import (
    BLOCK_TOKENS,
    SCENARIOS,
    RequestSpec,
    length_bucket,
    mix_stats,
    prompt_token_bytes,
    scenario,
    with_output_hints,
)


def test_every_matrix_scenario_is_named() -> None:
    assert len(SCENARIOS) == 10
    titles = [s.title for s in SCENARIOS.values()]
    assert [t.split(".")[0] for t in titles] == [str(i) for i in range(1, 11)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_generation_is_deterministic_for_a_seed(name: str) -> None:
    s = scenario(name).with_duration(10.0)
    first = s.generate(20.0, seed=7)
    assert first == s.generate(20.0, seed=7)
    assert first != s.generate(20.0, seed=8)
    assert all(0.0 <= r.arrival_s <= 10.0 for r in first)
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)
    assert len({r.request_id for r in first}) == len(first)


def test_input_and_output_lengths_are_correlated_not_independent() -> None:
    specs = scenario("long_long").with_duration(400.0).generate(20.0, seed=1)
    longs = [r for r in specs if r.category == "long_long"]
    assert len(longs) > 300
    log_in = np.log([r.input_tokens for r in longs])
    log_out = np.log([r.output_tokens for r in longs])
    assert np.corrcoef(log_in, log_out)[0, 1] > 0.15


def test_long_requests_are_a_minority_in_the_few_long_mix() -> None:
    specs = scenario("few_long_many_short").with_duration(200.0).generate(20.0, seed=3)
    longs = sum(r.is_long for r in specs)
    assert 0.02 < longs / len(specs) < 0.11
    assert all(r.priority == 0 for r in specs if r.is_long)
    assert all(r.max_wait_s > 0 for r in specs if r.is_long)


def test_a_burst_concentrates_one_tenants_arrivals() -> None:
    s = scenario("tenant_long_burst")
    specs = s.generate(20.0, seed=2)
    bulk = [r for r in specs if r.tenant == "bulk"]
    assert bulk
    assert all(8.0 <= r.arrival_s < 11.0 for r in bulk)
    scaled = s.with_duration(60.0).generate(20.0, seed=2)
    assert all(16.0 <= r.arrival_s < 22.0 for r in scaled if r.tenant == "bulk")


def test_hot_prefix_requests_share_leading_blocks() -> None:
    specs = scenario("hot_prefix_high_water").generate(10.0, seed=4)
    heads = [r.block_ids[:16] for r in specs if len(r.block_ids) >= 16]
    assert len(heads) > len(specs) // 2
    most_common = max(heads.count(h) for h in set(heads))
    assert most_common > len(heads) // 3
    stats = mix_stats(specs)
    assert stats.mean_uncached_input < stats.mean_input / 2


def test_cancellations_deadlines_and_a_failure_are_in_scenario_10() -> None:
    s = scenario("cancel_deadline_failure")
    specs = s.generate(20.0, seed=5)
    assert any(r.cancel_after_s > 0 for r in specs)
    assert any(r.deadline_s > 0 for r in specs)
    assert s.failures
    assert s.failures[0].at_s < s.duration_s


def test_misprediction_scales_hints_and_rejects_nonsense() -> None:
    specs = scenario("preemption_crossing").generate(10.0, seed=6)
    assert all(r.output_hint_tokens == max(1, round(r.output_tokens * 0.25)) for r in specs)
    over = with_output_hints(specs, 2.0)
    assert all(r.output_hint_tokens == r.output_tokens * 2 for r in over)
    assert all(r.output_hint_tokens == 0 for r in with_output_hints(specs, 0.0))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bias"):
            with_output_hints(specs, bad)


def test_bad_requests_and_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="blocks"):
        RequestSpec("x", 0.0, "t", 0, BLOCK_TOKENS + 1, 1, 1, (1,))
    with pytest.raises(ValueError, match="positive"):
        RequestSpec("x", 0.0, "t", 0, 0, 1, 1, ())
    with pytest.raises(ValueError, match="rate"):
        scenario("short_short").generate(0.0, seed=1)
    with pytest.raises(KeyError, match="unknown scenario"):
        scenario("nope")


def test_shared_blocks_expand_to_shared_token_prefixes() -> None:
    a = RequestSpec("a", 0.0, "t", 0, 2 * BLOCK_TOKENS, 1, 1, (5, 6))
    b = RequestSpec("b", 0.0, "t", 0, BLOCK_TOKENS + 10, 1, 1, (5, 9))
    ta, tb = prompt_token_bytes(a), prompt_token_bytes(b)
    assert len(ta) == 2 * BLOCK_TOKENS
    assert len(tb) == BLOCK_TOKENS + 10
    assert ta[:BLOCK_TOKENS] == tb[:BLOCK_TOKENS]
    assert ta[BLOCK_TOKENS:][:10] != tb[BLOCK_TOKENS:]


def test_length_buckets() -> None:
    assert [length_bucket(n) for n in (1, 1024, 1025, 5000, 20000, 40000)] == [
        "<=1k",
        "<=1k",
        "1k-4k",
        "4k-16k",
        "16k-32k",
        ">32k",
    ]


def test_the_bulk_tenant_s_quota_is_sized_to_the_fleet_s_kv() -> None:
    def bulk(kv_scale: float) -> int:
        spec = CellSpec("tenant_long_burst", "weir", 1.0, 0, 16, 10.0, kv_scale=kv_scale)
        (quota,) = [t for t in fleet_config(spec).policy.tenants if t.name == "bulk"]
        return quota.max_concurrency

    # 0.6 of 16 engines' KV in 10.9K-token requests: 37.7K tokens each, then 151K.
    assert (bulk(0.25), bulk(1.0)) == (33, 132)
    assert all(q.max_concurrency == 0 for q in scenario("tenant_long_burst").quotas_for(1)[1:])
