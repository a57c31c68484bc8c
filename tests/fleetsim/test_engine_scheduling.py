"""Scheduling policies of the engine model: prefix cache, chunked prefill budgets and
yielding, the new-token ratio, priorities with aging (SGLang's own admission and
retraction rules are in test_engine_sglang_rules.py)."""

from __future__ import annotations

import pytest

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, encode
from tests.fleetsim.conftest import drain, submit


def make(model: EngineModel, rid: str, text: str, max_new: int, **kw: object) -> EngineRequest:
    return submit(model, rid, text, max_new, ignore_eos=True, **kw)


def test_cache_salt_separates_prefix_caches() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=4096, page_size=4))
    text = "a long shared system prompt " * 4
    make(model, "a", text, 4, cache_salt="tenant-a")
    drain(model)
    other = make(model, "b", text, 4, cache_salt="tenant-b")
    drain(model)
    same = make(model, "c", text, 4, cache_salt="tenant-a")
    drain(model)
    assert other.cached_tokens == 0
    assert same.cached_tokens == (len(encode(text)) - 1) // 4 * 4


def test_lru_evicts_least_recently_used_prefix_first() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=256, page_size=4))
    old, recent = "o" * 100, "r" * 100
    for rid, text in (("old", old), ("recent", recent)):
        make(model, rid, text, 1)
        drain(model)
    assert model.kv.evictable_pages == 50
    make(model, "big", "b" * 120, 1)  # needs 31 pages: 14 free, so 17 are evicted
    drain(model)
    again_recent = make(model, "recent-2", recent, 1)
    drain(model)
    again_old = make(model, "old-2", old, 1)
    drain(model)
    assert again_recent.cached_tokens == 96
    assert again_old.cached_tokens < 96


def test_chunked_prefill_respects_the_token_budget() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=8192, chunked_prefill_size=256))
    req = make(model, "long", "x" * 2000, 2)
    computed = []
    while req.computed < 2000 and not req.finished:
        result = model.step(0.0)
        assert result.prefill_tokens <= 256
        computed.append(req.computed)
    assert computed == sorted(computed)
    assert len(computed) == 8  # ceil(2000 / 256) iterations


def test_prefill_time_budget_caps_iteration_length() -> None:
    budget = 0.05
    model = EngineModel(
        EngineConfig(max_total_tokens=65536, chunked_prefill_size=-1, prefill_time_budget_s=budget)
    )
    make(model, "long", "y" * 30000, 1)
    durations = []
    while model.has_work:
        result = model.step(0.0)
        if result.prefill_tokens:
            durations.append(result.duration)
    assert len(durations) > 1
    assert max(durations) <= budget


def test_long_prefill_yields_to_short_ones_but_never_starves() -> None:
    config = EngineConfig(
        max_total_tokens=65536, chunked_prefill_size=128, prefill_yield=True, prefill_max_yields=2
    )
    model = EngineModel(config)
    long = make(model, "long", "L" * 4000, 1)
    model.step(0.0)
    waits, last, i = [], long.computed, 0
    while long.computed < 4000:
        make(model, f"short{i}", f"{i:04d}" * 32, 1)  # a whole chunk each step
        i += 1
        model.step(0.0)
        waits.append(long.computed == last)
        last = long.computed
    # The long prompt waited while shorter ones ran, but never more than twice in a row.
    assert any(waits)
    assert "TTT" not in "".join("T" if w else "F" for w in waits)


def test_without_yield_the_chunked_prefill_goes_first() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=65536, chunked_prefill_size=128))
    long = make(model, "long", "L" * 1000, 1)
    model.step(0.0)
    for i in range(5):
        before = long.computed
        make(model, f"s{i}", "s" * 100, 1)
        model.step(0.0)
        assert long.computed == before + 128


def test_the_new_token_ratio_decays_per_decode_step_and_resets_when_idle() -> None:
    config = EngineConfig(max_total_tokens=4096, page_size=1, new_token_ratio_decay_steps=50)
    model = EngineModel(config)
    make(model, "only", "a" * 10, 100)
    ratios = []
    while model.has_work:
        model.step(0.0)
        ratios.append(model.new_token_ratio)
    floor = config.init_new_token_ratio * config.min_new_token_ratio_factor
    assert ratios[0] == config.init_new_token_ratio  # the prefill step does not decay it
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[50] == pytest.approx(floor)
    assert ratios[-1] == pytest.approx(floor)
    model.step(0.0)  # idle
    assert model.new_token_ratio == config.init_new_token_ratio


def test_priority_aging_lets_old_low_priority_requests_through() -> None:
    config = EngineConfig(
        max_total_tokens=65536, max_running_requests=1, enable_priority_scheduling=True,
        priority_aging_s=0.05,
    )  # fmt: skip
    model = EngineModel(config)
    now = 0.0
    low = model.make_request("low", [65], 1, ignore_eos=True, priority=0)
    model.submit(low, now)
    blocker = model.make_request("blocker", [66], 30, ignore_eos=True, priority=100)
    model.submit(blocker, now)
    order: list[str] = []
    i = 0
    while model.has_work and len(order) < 12:
        if model.waiting and len(model.waiting) < 3:
            req = model.make_request(f"high{i}", [67, i % 200], 3, ignore_eos=True, priority=5)
            model.submit(req, now)
            i += 1
        result = model.step(now)
        now += result.duration
        order += [r.rid for r in result.finished]
    assert "low" in order  # aged past the stream of priority-5 arrivals


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    for policy, expected in (("fcfs", ["cold", "warm"]), ("lpm", ["warm", "cold"])):
        config = EngineConfig(max_total_tokens=8192, max_running_requests=1, page_size=4)
        model = EngineModel(config.replace(schedule_policy=policy))
        cached = "a shared document to summarise " * 8
        make(model, "seed", cached, 1)
        drain(model)
        make(model, "blocker", "b", 5)
        model.step(0.0)
        make(model, "cold", "an unrelated question " * 8, 1)
        make(model, "warm", cached + "?", 1)
        order: list[str] = []
        while model.has_work:
            order += [r.rid for r in model.step(0.0).finished if r.rid != "blocker"]
        assert order == expected, policy


def test_radix_tree_holds_runs_and_splits_where_histories_diverge() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=1))
    shared = "a long shared system prompt, " * 30 + "question "
    reqs = []
    for i in range(8):
        reqs.append(make(model, f"q{i}", shared + f"{i}?", 5))
        drain(model)
    # One node for the shared prefix, one per diverging tail: not one per token.
    (trunk,) = model.kv.root().children.values()
    assert trunk.key == encode(shared)
    assert len(trunk.children) == 8
    assert all(not child.children for child in trunk.children.values())
    assert all(r.cached_tokens == len(encode(shared)) for r in reqs[1:])
    assert model.kv.cached_pages == model.kv.evictable_pages == len(encode(shared)) + 8 * 6
