"""The engine model's scheduling held to SGLang's own rules, each from SGLang's source
(0.5.23 unless said): PrefillAdder's budget (sglang/srt/managers/schedule_policy.py,
mem_cache/prefill_budget.py), retraction (ScheduleBatch.retract_decode in
schedule_batch.py), the queue (Scheduler._add_request_to_queue, _abort_on_queued_limit)
and the new-token ratio (scheduler_components/new_token_ratio_tracker.py)."""

from __future__ import annotations

import math

import pytest

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, Phase, encode
from fleetsim.engine.config import SGLangVersion
from tests.fleetsim.conftest import drain, submit


@pytest.mark.parametrize(
    ("version", "fits", "refused"),
    # 0.5.23 charges the first request 112 (its 100 tokens, page-rounded) + 16 (a page) +
    # 300 (its whole output) and asks the second for 100 + X + 16 < 1024 − 428.
    # 0.5.5 charges no page: 100 + X < 1024 − 412.
    [("0.5.23", 479, 480), ("0.5.5", 511, 512)],
)
def test_one_pass_charges_each_admission_its_whole_output(
    version: SGLangVersion, fits: int, refused: int
) -> None:
    for max_new, admitted in ((fits, True), (refused, False)):
        config = EngineConfig(max_total_tokens=1024, page_size=16, sglang_version=version)
        model = EngineModel(config)
        submit(model, "first", "f" * 100, 300)
        second = submit(model, "second", "s" * 100, max_new)
        model.step(0.0)
        assert (second.phase is Phase.PREFILL or second.phase is Phase.DECODE) is admitted


def test_after_a_refusal_nothing_is_admitted_until_a_running_request_leaves() -> None:
    """`batch_is_full`: the second request would fit once the first decodes (its growth
    counts at the new-token ratio, not whole), but it waits for the first to finish."""
    model = EngineModel(EngineConfig(max_total_tokens=1024, page_size=16, eos_per_mille=0.0))
    first = submit(model, "first", "f" * 100, 300)
    second = submit(model, "second", "s" * 100, 480)
    now = model.step(0.0).duration
    assert model.batch_is_full
    waited = 0
    while first.finish is None:
        assert second in model.waiting
        now += model.step(now).duration
        waited += 1
    assert waited == 299  # every decode step of the first (its first token came in prefill)
    model.step(now)
    assert second.phase is Phase.DECODE


@pytest.mark.parametrize(("version", "ratio"), [("0.5.23", 1.0), ("0.5.5", 0.7)])
def test_ignore_eos_requests_reserve_their_whole_output_on_0523(
    version: SGLangVersion, ratio: float
) -> None:
    """A running request's growth counts at the new-token ratio, except an ignore_eos one
    on 0.5.23, which will surely produce all of it."""
    page = 1 if version == "0.5.23" else 0
    # After its prefill the running request holds 10 tokens and has 999 still to come.
    largest = math.ceil(4096 - 10 - 999 * ratio) - 10 - page - 1
    for max_new, admitted in ((largest, True), (largest + 1, False)):
        config = EngineConfig(max_total_tokens=4096, page_size=1, sglang_version=version)
        model = EngineModel(config)
        running = submit(model, "running", "r" * 10, 1000, ignore_eos=True)
        model.step(0.0)
        assert running.phase is Phase.DECODE
        late = submit(model, "late", "l" * 10, max_new, ignore_eos=True)
        model.step(0.0)
        assert (late.phase is Phase.WAITING) is not admitted


def test_a_retraction_frees_decoded_kv_requeues_at_the_tail_and_reestimates_the_ratio() -> None:
    config = EngineConfig(
        max_total_tokens=512, page_size=1, eos_per_mille=0.0, init_new_token_ratio=0.1
    )
    model = EngineModel(config)
    now = 0.0
    reqs = []
    for letter in "abc":
        reqs.append(submit(model, letter, letter * 50, 300, now=now))
        now += model.step(now).duration
    blocked = submit(model, "blocked", "d" * 200, 300, now=now)  # over the budget: waits
    while True:
        result = model.step(now)
        if result.retracted:
            break
        now += result.duration
    (victim,) = result.retracted
    kept = model.decoding
    assert victim is reqs[2]  # the fewest output tokens
    assert victim.retractions == 1
    assert model.waiting == [blocked, victim]  # the tail, not the head
    assert victim.queued_at == now
    decoded = sum(len(r.output_ids) - 1 for r in kept)  # before this step's token
    allowed = sum(r.max_new_tokens for r in kept)
    assert model.new_token_ratio == pytest.approx((decoded + 20 * len(kept)) / (allowed + 1))
    # Only its prompt stayed cached: what it decoded was freed, not cached.
    assert model.kv.evictable_pages == 50
    drain(model, now + result.duration)
    assert all(len(r.output_ids) == 300 for r in [*reqs, blocked])


def test_the_chunk_budget_cuts_one_request_at_a_page_and_chunks_one_at_a_time() -> None:
    config = EngineConfig(max_total_tokens=65536, page_size=16, chunked_prefill_size=256)
    model = EngineModel(config)
    short = submit(model, "short", "s" * 20, 1)  # charged 32 of the 256
    long = submit(model, "long", "l" * 1000, 1)
    other = submit(model, "other", "o" * 100, 1)
    model.step(0.0)
    assert long.computed == 224  # 256 − 32, a whole number of pages
    assert other.phase is Phase.WAITING  # the budget is spent
    assert short.finish is not None
    model.step(0.0)
    assert long.computed == 224 + 256  # the chunked request takes the whole next chunk
    assert other.phase is Phase.WAITING


def test_max_prefill_tokens_caps_a_batch_without_chunking() -> None:
    config = EngineConfig(
        max_total_tokens=65536, page_size=1, chunked_prefill_size=-1, max_prefill_tokens=300
    )
    model = EngineModel(config)
    first = submit(model, "first", "a" * 1000, 1)  # the first is admitted even above the cap
    second = submit(model, "second", "b" * 10, 1)
    result = model.step(0.0)
    assert result.prefill_tokens == 1000
    assert first.finish is not None
    assert second.phase is Phase.WAITING
    third = submit(model, "third", "c" * 250, 1)
    fourth = submit(model, "fourth", "d" * 100, 1)
    assert model.step(0.0).prefill_tokens == 10 + 250
    assert third.finish is not None
    assert fourth.phase is Phase.WAITING


def test_lpm_serves_the_queue_in_order_beyond_128_waiting() -> None:
    config = EngineConfig(
        max_total_tokens=1 << 16, page_size=1, schedule_policy="lpm", max_running_requests=1
    )
    cached = "a shared document to summarise " * 4
    for waiting, first in ((128, "warm"), (129, "cold")):
        model = EngineModel(config)
        submit(model, "seed", cached, 1)
        drain(model)
        submit(model, "blocker", "b", 3)
        model.step(0.0)
        submit(model, "cold", "an unrelated question " * 4, 1)
        for i in range(waiting - 2):
            submit(model, f"filler{i}", f"z{i:04d}", 1)
        submit(model, "warm", cached + "?", 1)
        finished: list[str] = []
        while len(finished) < 2:
            finished += [r.rid for r in model.step(0.0).finished]
        assert finished == ["blocker", first], waiting


def test_lpm_defers_a_request_whose_prefix_an_earlier_waiting_one_will_cache() -> None:
    """Of two uncached requests sharing their first 32 tokens, the second waits a pass,
    so that it finds the first's prompt cached."""
    shared = "the same long system prompt, " * 2
    for policy, twin_waits in (("fcfs", False), ("lpm", True)):
        config = EngineConfig(max_total_tokens=1 << 16, page_size=1, max_running_requests=2)
        model = EngineModel(config.replace(schedule_policy=policy))
        submit(model, "first", shared + "one", 1)
        twin = submit(model, "twin", shared + "two", 1)
        submit(model, "alone", "something else entirely " * 2, 1)
        model.step(0.0)
        assert (twin.phase is Phase.WAITING) is twin_waits, policy
        drain(model)
        assert twin.cached_tokens == (len(shared) if twin_waits else 0), policy


@pytest.mark.parametrize(("version", "clipped"), [("0.5.23", 47), ("0.5.5", 52)])
def test_max_new_tokens_is_clipped_so_a_request_alone_fits(
    version: SGLangVersion, clipped: int
) -> None:
    """0.5.5 clips to the context (max_req_len − input − 1, max_req_len = 63 here); 0.5.23
    also to an empty pool: 64 − 12 (the input, page-rounded) − 4 (a page) − 1."""
    model = EngineModel(
        EngineConfig(max_total_tokens=64, page_size=4, context_length=4096, sglang_version=version)
    )
    req = submit(model, "huge", "z" * 10, 500, ignore_eos=True)
    assert req.max_new_tokens == clipped
    drain(model)
    assert req.finish is not None
    assert req.finish.to_json() == {"type": "length", "length": clipped}
    assert model.kv.used_pages == 0


def test_the_default_running_limit_follows_the_pool() -> None:
    # An 8B model on an H200: 793,609 KV tokens, 512 requests per 131,072-token context.
    assert EngineConfig().running_limit == 3100
    assert EngineConfig(max_total_tokens=4096, context_length=4096).running_limit == 2048
    assert EngineConfig(max_total_tokens=1000).running_limit == 500  # half the pool
    assert EngineConfig(max_total_tokens=4096, max_running_requests=8).running_limit == 8
    assert EngineConfig(max_total_tokens=4096, context_length=4096).max_req_input_len == 4090


def priority_config(**changes: object) -> EngineConfig:
    return EngineConfig(
        max_total_tokens=1 << 16, enable_priority_scheduling=True, eos_per_mille=0.0
    ).replace(**changes)


def test_a_far_higher_priority_preempts_at_the_running_limit() -> None:
    model = EngineModel(priority_config(max_running_requests=2))
    low = submit(model, "low", "l", 100, priority=0)
    mid = submit(model, "mid", "m", 100, priority=5)
    model.step(0.0)
    close = submit(model, "close", "c", 5, priority=10, now=1.0)  # only 10 above low: waits
    model.step(1.0)
    assert close.phase is Phase.WAITING
    urgent = submit(model, "urgent", "u", 5, priority=11, now=2.0)  # 11 above low: preempts
    result = model.step(2.0)
    assert result.retracted == [low]
    assert urgent.phase is Phase.DECODE
    assert low.retractions == 1
    assert model.waiting == [close, low]  # requeued at the tail, restamped
    assert low.queued_at == 2.0
    assert mid.phase is Phase.DECODE


def test_without_preemption_the_running_limit_holds() -> None:
    model = EngineModel(priority_config(max_running_requests=1, disable_priority_preemption=True))
    low = submit(model, "low", "l", 100, priority=0)
    model.step(0.0)
    urgent = submit(model, "urgent", "u", 5, priority=100)
    model.step(0.0)
    assert (low.phase, urgent.phase) == (Phase.DECODE, Phase.WAITING)


def test_a_full_queue_drops_its_least_preferred_request_for_a_better_one() -> None:
    model = EngineModel(priority_config(max_running_requests=1, max_queued_requests=2))
    submit(model, "running", "r", 100)
    model.step(0.0)
    older = submit(model, "older", "o", 5, priority=1, now=1.0)
    newer = submit(model, "newer", "n", 5, priority=1, now=2.0)
    # Not preferred to the least preferred waiting one: the newcomer is refused.
    equal = model.make_request("equal", encode("e"), 5, priority=1)
    assert not model.submit(equal, 3.0)
    assert equal.finish is not None
    assert equal.finish.to_json()["status_code"] == 503
    better = submit(model, "better", "b", 5, priority=2, now=4.0)
    assert model.waiting == [older, better]
    # The newest among the least preferred went; the next step reports it.
    assert newer.finish is not None
    assert newer.finish.message == "The request is aborted by a higher priority request."
    assert newer in model.step(5.0).finished


def test_retraction_policy_priority_retracts_the_least_preferred_first() -> None:
    for policy, victim in (("length", "important"), ("priority", "casual")):
        config = priority_config(
            max_total_tokens=400, page_size=1, init_new_token_ratio=0.1, retraction_policy=policy
        )
        model = EngineModel(config)
        casual = submit(model, "casual", "c" * 50, 170, priority=0)
        now = 0.0
        for _ in range(5):  # a head start: more output tokens than the other
            now += model.step(now).duration
        important = submit(model, "important", "i" * 50, 170, priority=5, now=now)
        retracted: list[EngineRequest] = []
        while not retracted and model.has_work:
            result = model.step(now)
            now += result.duration
            retracted = result.retracted
        assert [r.rid for r in retracted] == [victim], policy
        assert len(casual.output_ids) > len(important.output_ids)
