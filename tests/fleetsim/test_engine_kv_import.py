"""KV import (the decode side of P/D): a request whose prompt KV arrives by transfer gets
pages for it without computing it, continues exactly as an uninterrupted run, and falls
back to a full recompute if it is retracted."""

from __future__ import annotations

import random

import pytest

from fleetsim.engine import EngineConfig, EngineModel, RequestError
from tests.fleetsim.test_engine_model import drain, run_alone


def prompt(seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(6000)]


PROMPT = prompt()


def prefilled(ids: list[int] = PROMPT) -> tuple[list[int], int]:
    """What a prefill engine hands off: the prompt plus its first token."""
    model = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = model.make_request("p", ids, 1, ignore_eos=True)
    model.submit(req, 0.0)
    drain(model)
    return ids + req.output_ids, len(ids)


def test_an_imported_prompt_is_not_computed_again() -> None:
    history, imported = prefilled()
    plain = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    decode = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    full = plain.make_request("full", history, 31, ignore_eos=True)
    moved = decode.make_request("moved", history, 31, ignore_eos=True, kv_imported=imported)
    plain.submit(full, 0.0)
    decode.submit(moved, 0.0)
    first_full = plain.step(0.0)
    first_moved = decode.step(0.0)
    # The decode engine computes one token where the other prefills a chunk of 6001.
    assert first_moved.prefill_tokens == 1 < first_full.prefill_tokens
    assert first_moved.duration < first_full.duration / 10
    assert decode.imported_tokens_total == imported
    # It holds pages for its whole history, as if it had computed it.
    assert decode.kv.used_pages * 16 >= len(history)
    decode.check()
    drain(plain, first_full.duration)
    drain(decode, first_moved.duration)
    assert moved.output_ids == full.output_ids
    uninterrupted = run_alone(plain.make_request("solo", PROMPT, 32, ignore_eos=True))
    assert history[len(PROMPT) :] + moved.output_ids == uninterrupted


def test_a_retracted_import_recomputes_its_whole_history() -> None:
    """The second imported request arrives while the first decodes: admission counts the
    first's growth at the new-token ratio, so both run, and as they grow the pool runs
    out: decode retracts the second, which then prefills everything it had imported, and
    both still continue exactly."""
    decode = EngineModel(EngineConfig(max_total_tokens=12_960, page_size=16, eos_per_mille=0.0))
    reqs, histories = [], []
    now = 0.0
    retracted = 0
    for i in range(2):
        history, imported = prefilled(prompt(10 + i))
        req = decode.make_request(f"m{i}", history, 500, kv_imported=imported)
        decode.submit(req, now)
        reqs.append(req)
        histories.append(history)
        result = decode.step(now)
        now += result.duration
        retracted += len(result.retracted)
    assert all(r in decode.decoding for r in reqs)
    now, more = drain(decode, now)
    retracted += more
    assert retracted >= 1
    victim = next(r for r in reqs if r.retractions)
    assert victim is reqs[1]
    assert victim.kv_imported == 0
    assert decode.imported_tokens_total == 2 * 6000
    assert decode.prompt_tokens_total == 2 * 6001
    for req, history in zip(reqs, histories, strict=True):
        assert req.finish is not None
        assert req.finish.kind == "length"
        alone = run_alone(decode.make_request("solo", history[:-1], 501), eos_per_mille=0.0)
        assert history[-1:] + req.output_ids == alone


@pytest.mark.parametrize("bad", [-1, len(PROMPT) + 1])
def test_an_import_must_leave_a_token_to_compute(bad: int) -> None:
    model = EngineModel(EngineConfig(max_total_tokens=1 << 16))
    with pytest.raises(RequestError, match="kv_imported"):
        model.make_request("x", [*PROMPT, 7], 4, kv_imported=bad)
