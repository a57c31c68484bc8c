"""The engine model in virtual time: determinism, retraction and recompute, invariants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetsim.engine import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    EngineRequestError,
    Phase,
    encode,
)
from fleetsim.engine.timing import TimingModel
from fleetsim.engine.tokens import EOS_ID, VOCAB_SIZE, extend_hash, prefix_hash


def run_alone(request: EngineRequest, **config: object) -> list[int]:
    """The tokens an uninterrupted run of the same request produces on a roomy engine."""
    model = EngineModel(EngineConfig(max_total_tokens=1 << 20).replace(**config))
    req = model.make_request(
        "solo", request.input_ids, request.max_new_tokens, ignore_eos=request.ignore_eos,
        min_new_tokens=request.min_new_tokens,
    )  # fmt: skip
    model.submit(req, 0.0)
    now = 0.0
    while model.has_work:
        now += model.step(now).duration
    return req.output_ids


def drain(model: EngineModel, now: float = 0.0, check: bool = True) -> tuple[float, int]:
    """Step until idle; returns the clock and the number of retractions seen."""
    retracted = 0
    while model.has_work:
        result = model.step(now)
        now += result.duration
        retracted += len(result.retracted)
        if check:
            model.check()
    return now, retracted


def test_flood_of_long_outputs_retracts_and_recomputes_exactly() -> None:
    """Requests arriving one by one are admitted against the running ones' discounted
    growth (new-token ratio 0.7): the pool overfills, decode retracts and recomputes,
    never crashes, and every request's tokens equal an uninterrupted run's."""
    config = EngineConfig(
        max_total_tokens=2048, page_size=4, chunked_prefill_size=256, eos_per_mille=0.0
    )
    model = EngineModel(config)
    rng = random.Random(7)
    arriving = []
    for i in range(24):
        prompt = encode(f"request {i} " + "lorem ipsum " * rng.randint(1, 12))
        arriving.append(model.make_request(f"r{i:03d}", prompt, rng.randint(200, 600)))
    reqs = list(arriving)
    now, retracted, steps = 0.0, 0, 0
    while arriving or model.has_work:
        if arriving and steps % 5 == 0:
            assert model.submit(arriving.pop(0), now)
        result = model.step(now)
        now += result.duration
        retracted += len(result.retracted)
        steps += 1
        model.check()
    assert retracted > 0
    assert sum(r.retractions for r in reqs) == retracted == model.retracted_total
    for req in reqs:
        assert req.finish is not None
        assert req.finish.kind == "length"
        assert len(req.output_ids) == req.max_new_tokens
        assert req.output_ids == run_alone(req, eos_per_mille=0.0)
    assert model.kv.used_pages == 0
    model.check()


def test_tokens_are_a_function_of_the_prefix() -> None:
    prompt = encode("The quick brown fox")
    model = EngineModel(EngineConfig(max_total_tokens=4096))
    whole = model.make_request("a", prompt, 50, ignore_eos=True)
    model.submit(whole, 0.0)
    drain(model)
    cont = model.make_request("b", prompt + whole.output_ids[:20], 30, ignore_eos=True)
    model.submit(cont, 0.0)
    drain(model)
    assert whole.output_ids[20:] == cont.output_ids
    # The continuation's prefix was cached by the first request.
    assert cont.cached_tokens >= len(prompt) + 20 - 1


@given(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=300), st.integers(0, 2**32 - 1))
def test_the_prefix_hash_of_many_tokens_is_one_token_at_a_time(ids: list[int], seed: int) -> None:
    # Byte ids take a fast path; a list with EOS (256) the general one.
    state = seed
    for token in ids:
        state = extend_hash(state, token)
    assert prefix_hash(ids, seed) == state


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, 99999])
def test_a_token_id_out_of_the_vocabulary_is_refused(bad: int) -> None:
    model = EngineModel(EngineConfig(max_total_tokens=4096))
    with pytest.raises(EngineRequestError, match=f"Token id {bad} is out of the vocabulary"):
        model.make_request("bad", [65, bad, EOS_ID], 5)
    assert model.make_request("eos", [65, EOS_ID], 5).input_ids == [65, EOS_ID]


def test_eos_min_tokens_and_stop_strings() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=1 << 16, eos_per_mille=200.0))
    free = model.make_request("free", encode("hi"), 500)
    forced = model.make_request("forced", encode("hi"), 500, min_new_tokens=100)
    for req in (free, forced):
        model.submit(req, 0.0)
    drain(model)
    assert free.finish is not None
    assert free.finish.kind == "stop"
    assert free.finish.to_json() == {"type": "stop", "matched": 256}
    assert len(free.output_ids) < 100
    assert forced.finish is not None
    assert forced.finish.kind == "stop"
    assert len(forced.output_ids) > 100
    # A stop string cuts the text before it.
    probe = model.make_request("probe", encode("hi"), 40, ignore_eos=True)
    model.submit(probe, 0.0)
    drain(model)
    text = probe.output_text()
    stop = text[20:22]
    stopping = model.make_request("stop", encode("hi"), 40, ignore_eos=True, stop=[stop])
    model.submit(stopping, 0.0)
    drain(model)
    assert stopping.finish is not None
    assert stopping.finish.to_json()["matched"] == stop
    assert stopping.output_text() == text[: text.find(stop)]


def test_abort_matches_rid_prefixes_and_returns_pages() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=4096, page_size=2))
    for rid in ("job-1", "job-10", "job-2", "other"):
        model.submit(model.make_request(rid, encode("hello " * 20), 300, ignore_eos=True), 0.0)
    for _ in range(5):
        model.step(0.0)
    assert model.abort("nothing-like-this") == []
    assert model.abort("") == []
    assert sorted(r.rid for r in model.abort("job-1")) == ["job-1", "job-10"]
    assert sorted(model.requests) == ["job-2", "other"]
    model.check()
    gone = model.abort(abort_all=True)
    assert {r.finish.kind for r in gone if r.finish} == {"abort"}
    assert model.kv.used_pages == 0
    assert not model.has_work
    model.check()


def test_queue_limit_refuses_with_503() -> None:
    model = EngineModel(EngineConfig(max_total_tokens=4096, max_queued_requests=2))
    accepted = [model.submit(model.make_request(f"q{i}", [65], 4), 0.0) for i in range(3)]
    assert accepted == [True, True, False]
    assert model.aborted_total == 1


@pytest.mark.parametrize(
    ("prompt", "max_new", "message"),
    [
        (0, 5, "must not be empty"),
        (100, 5, "longer than the model's context length"),
        (10, -1, "at least 0"),
        (10, 10**9, "exceeds the model's maximum context length"),
    ],
)
def test_bad_requests_are_refused(prompt: int, max_new: int, message: str) -> None:
    model = EngineModel(EngineConfig(max_total_tokens=4096, context_length=64))
    with pytest.raises(EngineRequestError, match=message):
        model.make_request("bad", [65] * prompt, max_new)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    page_size=st.sampled_from([1, 4, 16]),
    pages=st.integers(24, 160),
    chunk=st.sampled_from([16, 64, -1]),
    mixed=st.booleans(),
    yielding=st.booleans(),
)
def test_random_workloads_keep_invariants(
    seed: int, page_size: int, pages: int, chunk: int, mixed: bool, yielding: bool
) -> None:
    """Random arrivals, aborts, pauses and flushes: computed tokens never decrease except on
    retraction, the pool invariants hold after every step, and the pool ends at baseline."""
    rng = random.Random(seed)
    model = EngineModel(
        EngineConfig(
            max_total_tokens=pages * page_size, page_size=page_size, chunked_prefill_size=chunk,
            enable_mixed_chunk=mixed, prefill_yield=yielding, prefill_max_yields=2,
            max_running_requests=rng.choice([None, 3, 8]), eos_per_mille=20.0,
        )
    )  # fmt: skip
    vocab = [encode(w) for w in ("ab", "abc", "xyz", "hello ", "world ")]
    now = 0.0
    reqs: list[EngineRequest] = []
    seen: dict[str, tuple[int, int]] = {}
    for step in range(400):
        if rng.random() < 0.3 and len(reqs) < 60:
            prompt = [t for _ in range(rng.randint(1, 8)) for t in rng.choice(vocab)]
            prompt = prompt[: model.config.max_req_input_len - 1]
            req = model.make_request(f"r{len(reqs)}", prompt, rng.randint(0, 40))
            model.submit(req, now)
            reqs.append(req)
        roll = rng.random()
        if roll < 0.03 and reqs:
            model.abort(rng.choice(reqs).rid, now=now)
        elif roll < 0.04:
            model.pause(rng.choice(["abort", "retract", "in_place"]), now)
        elif roll < 0.08:
            model.resume()
        elif roll < 0.09:
            model.flush_cache()
        result = model.step(now)
        now += result.duration
        for req in model.requests.values():
            retractions, computed = seen.get(req.rid, (0, 0))
            if req.retractions == retractions:  # no recompute since last seen
                assert req.computed >= computed
            seen[req.rid] = (req.retractions, req.computed)
        model.check()
        if step > 300:
            model.resume()
    model.resume()
    drain(model, now)
    assert all(r.finish is not None and r.phase is Phase.FINISHED for r in reqs)
    assert model.kv.used_pages == 0
    assert not model.requests


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 60_000),
    tokens=st.integers(0, 8_000),
    context=st.integers(0, 200_000),
    budget_ms=st.floats(4.0, 400.0),
)
def test_the_prefill_stop_in_closed_form_is_the_roofline_within_a_token(
    start: int, tokens: int, context: int, budget_ms: float
) -> None:
    """`TimingModel.prefill_stop` (the time-budgeted prefill's guess at its chunk's end,
    no earlier than its start) lands within a token of the furthest end whose iteration
    `iteration_s` says fits."""
    timing, budget = TimingModel(), budget_ms / 1e3
    pairs = tokens * 1_000

    def fits(stop: int) -> bool:
        extra = (stop * (stop + 1) - start * (start + 1)) // 2
        took = timing.iteration_s(tokens + stop - start, pairs + extra, context + start, 0, 0)
        return took <= budget

    guess = max(start, math.floor(timing.prefill_stop(start, tokens, pairs, context, budget)))
    stop = start  # an empty chunk, when not a token fits
    while fits(stop + 1):
        stop += 1
    assert stop - 1 <= guess <= stop + 1
