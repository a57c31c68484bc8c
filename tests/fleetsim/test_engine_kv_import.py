"""KV import (the decode side of P/D): a request whose prompt KV arrives by transfer gets
pages for it without computing it, continues exactly as an uninterrupted run, and falls
back to a full recompute if it is retracted."""

from __future__ import annotations

import random

import pytest

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, EngineRequestError, Phase
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
    with pytest.raises(EngineRequestError, match="kv_imported"):
        model.make_request("x", [*PROMPT, 7], 4, kv_imported=bad)


# -- the decode side of SGLang's P/D protocol: prealloc, transfer, arrival --------------


def handoff(model: EngineModel, rid: str, ids: list[int], max_new: int) -> EngineRequest:
    req = model.make_request(rid, ids, max_new, ignore_eos=True)
    model.submit_handoff(req, 0.0)
    return req


def test_a_handoff_holds_its_prompts_pages_while_the_kv_travels_and_continues_exactly() -> None:
    decode = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = handoff(decode, "h", PROMPT, 32)
    assert req.phase is Phase.PREALLOC
    assert not decode.has_work
    assert decode.preallocate() == [req]
    # Pages for the whole prompt are taken before a byte of KV arrives.
    assert req.phase is Phase.TRANSFER
    assert decode.kv.used_pages == -(-len(PROMPT) // 16)
    assert decode.loads().num_transfer_reqs == 1
    decode.check()
    history, _ = prefilled()
    decode.kv_arrived(req, history[-1], cached_tokens=0, now=0.5)
    assert req.output_ids == history[-1:]
    assert req.first_token_at == 0.5
    first = decode.step(0.5)
    assert first.prefill_tokens == 1  # the handoff token, not the prompt
    drain(decode, first.duration)
    assert decode.imported_tokens_total == len(PROMPT)
    assert req.output_ids == run_alone(decode.make_request("solo", PROMPT, 32, ignore_eos=True))
    assert decode.kv.used_pages == 0


def test_preallocation_waits_for_room_first_come_first_served() -> None:
    """A pool whose free pages cannot take a prompt plus the decode reserve of every
    request there leaves the handoff waiting, and the one behind it too, until KV frees."""
    decode = EngineModel(EngineConfig(max_total_tokens=8192, page_size=16))
    running = decode.make_request("run", PROMPT[:3000], 400, ignore_eos=True)
    decode.submit(running, 0.0)
    now = 0.0
    while running.phase is not Phase.DECODE:
        now += decode.step(now).duration
    big = handoff(decode, "big", PROMPT[:4500], 64)
    small = handoff(decode, "small", PROMPT[:100], 8)
    assert decode.preallocate() == []
    assert decode.loads().num_prealloc_reqs == 2
    assert big.pages == []
    assert small.pages == []
    drain(decode, now)
    assert decode.preallocate() == [big, small]
    decode.check()


@pytest.mark.parametrize("phase", [Phase.PREALLOC, Phase.TRANSFER])
def test_an_abort_before_the_kv_lands_frees_what_the_handoff_held(phase: Phase) -> None:
    decode = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = handoff(decode, "gone", PROMPT, 32)
    if phase is Phase.TRANSFER:
        decode.preallocate()
    assert req.phase is phase
    assert decode.abort("gone") == [req]
    assert req.finish is not None
    assert req.finish.kind == "abort"
    assert decode.kv.used_pages == 0
    assert not decode.prealloc
    assert not decode.transferring
    decode.check()
    with pytest.raises(EngineRequestError, match="not waiting for its KV"):
        decode.kv_arrived(req, 5, 0, 1.0)


def test_a_handoff_token_that_ends_the_request_finishes_it_on_arrival() -> None:
    decode = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = handoff(decode, "one", PROMPT, 1)
    decode.preallocate()
    decode.kv_arrived(req, 42, cached_tokens=16, now=1.0)
    assert req.finish is not None
    assert req.finish.to_json() == {"type": "length", "length": 1}
    assert req.output_ids == [42]
    assert req.cached_tokens == 16
    assert decode.kv.used_pages == 0
    assert not decode.has_work


# -- the prefill side: bootstrap, prefill, inflight ------------------------------------


def test_an_export_waits_for_its_peer_then_holds_its_kv_until_the_transfer_is_done() -> None:
    prefill = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = prefill.make_request("p", PROMPT, 1)
    prefill.submit_prefill(req, 0.0)
    assert req.phase is Phase.BOOTSTRAP
    assert not prefill.has_work
    assert prefill.loads().num_bootstrap_reqs == 1
    assert prefill.kv.used_pages == 0
    assert prefill.peer_ready(req, 0.25)
    now, _ = drain(prefill, 0.25)
    # The first token is computed; the KV stays until the decode side has it.
    assert req.phase is Phase.INFLIGHT
    assert req.finish is None
    assert req.output_ids == prefilled()[0][len(PROMPT) :]
    assert prefill.kv.used_pages == -(-len(PROMPT) // 16)
    assert prefill.loads().num_inflight_reqs == 1
    assert req.arrival == 0.0
    prefill.check()
    prefill.transfer_done(req, now)
    assert req.finish is not None
    assert req.finish.to_json() == {"type": "length", "length": 0}
    # Its pages are the prefix cache's now, for the next prompt that shares them.
    assert prefill.kv.used_pages == 0
    assert prefill.kv.cached_pages == len(PROMPT) // 16
    prefill.check()


def test_a_step_reports_the_exports_whose_kv_ships() -> None:
    prefill = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = prefill.make_request("p", PROMPT[:100], 1)
    prefill.submit_prefill(req, 0.0)
    prefill.peer_ready(req, 0.0)
    result = prefill.step(0.0)
    assert result.exported == [req]
    assert result.emitted == [req]
    assert not result.finished


@pytest.mark.parametrize("phase", [Phase.BOOTSTRAP, Phase.INFLIGHT])
def test_an_abort_of_an_export_frees_its_kv(phase: Phase) -> None:
    prefill = EngineModel(EngineConfig(max_total_tokens=1 << 16, page_size=16))
    req = prefill.make_request("p", PROMPT, 1)
    prefill.submit_prefill(req, 0.0)
    if phase is Phase.INFLIGHT:
        prefill.peer_ready(req, 0.0)
        drain(prefill)
    assert req.phase is phase
    assert prefill.abort("p") == [req]
    assert prefill.kv.used_pages == 0
    assert not prefill.bootstrapping
    assert not prefill.inflight
    prefill.check()
    with pytest.raises(EngineRequestError, match="not transferring"):
        prefill.transfer_done(req, 1.0)
