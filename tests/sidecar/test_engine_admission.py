"""The engine admission's wait, replayed from what the sidecar knows: running requests
whose reservations free at known times give a known wait; requests ahead are admitted
first unless the newcomer outranks them; SGLang's new-token ratio schedule; the predicted
end of a request the output-length predictor knows little about; and the latency model
taking the wait as its TTFT term."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_sidecar.policy import (
    MIN_OUTLIVED,
    EngineBacklog,
    EngineLoad,
    LatencyPredictor,
    PendingRequest,
    RunningRequest,
    admission_wait_s,
    new_token_ratio,
    predicted_left,
)

TPOT = 0.01


def _ignoring_eos(kv: int, left: int, ends_in: int) -> RunningRequest:
    """A running request the engine reserves all its remaining output for."""
    return RunningRequest(kv, left, ends_in, reserves_all=True)


def test_a_request_that_fits_does_not_wait() -> None:
    backlog = EngineBacklog(10_000, (_ignoring_eos(2_000, 1_000, 100),))
    assert admission_wait_s(backlog, PendingRequest(1_000, 1_000, 100), TPOT) == 0.0


def test_the_wait_ends_when_enough_reservations_are_freed() -> None:
    # Three requests each hold 2,000 tokens of KV and reserve 1,000 more (+1 each for
    # mixed-chunk decoding): 997 of 10,000 free. They end after 100, 200 and 300 tokens.
    running = tuple(_ignoring_eos(2_000, 1_000, n) for n in (300, 100, 200))
    backlog = EngineBacklog(10_000, running)
    # 4,000 needed: 3,998 free after the first end is not enough, 6,999 after the second.
    assert admission_wait_s(backlog, PendingRequest(2_000, 2_000, 50), TPOT) == 2.0
    assert admission_wait_s(backlog, PendingRequest(2_000, 1_000, 50), TPOT) == 1.0
    # One too large for the whole pool waits for everything tracked to end.
    assert admission_wait_s(backlog, PendingRequest(9_000, 4_000, 50), TPOT) == 3.0


def test_a_running_request_s_growth_uses_up_the_budget() -> None:
    # At the ratio's floor, `slow` reserves under a tenth of what it may still write, and
    # each token it writes costs the rest of a token: 90 tokens a second here. `quick`
    # (all its output reserved) ends after 1 s, `slow` after 10 s.
    slow = RunningRequest(4_000, 1_000, 1_000)
    quick = _ignoring_eos(4_000, 1_000, 100)
    backlog = EngineBacklog(10_000, (slow, quick), busy_s=1e6)
    free_at_1s = 10_000 - (4_000 + new_token_ratio(1e6) * 1_000 + 1) - 0.902 * 100
    assert free_at_1s == pytest.approx(5_810.8)
    assert admission_wait_s(backlog, PendingRequest(5_800, 0, 10), TPOT) == 1.0
    # Without the growth 5,850 would fit then too.
    assert admission_wait_s(backlog, PendingRequest(5_850, 0, 10), TPOT) == 10.0


def test_requests_ahead_go_first_unless_the_newcomer_outranks_them() -> None:
    running = (_ignoring_eos(4_000, 1_000, 100), _ignoring_eos(4_000, 1_000, 200))
    ahead = PendingRequest(4_000, 1_000, 500, priority=1)
    backlog = EngineBacklog(12_000, running, (ahead,))
    # Alone it would enter at the first end; behind `ahead`, which takes that room, at
    # the second.
    assert (
        admission_wait_s(
            EngineBacklog(12_000, running), PendingRequest(4_000, 1_000, 10, priority=1), TPOT
        )
        == 1.0
    )
    assert admission_wait_s(backlog, PendingRequest(4_000, 1_000, 10, priority=1), TPOT) == 2.0
    # A higher priority is admitted before it.
    assert admission_wait_s(backlog, PendingRequest(4_000, 1_000, 10, priority=2), TPOT) == 1.0


def test_the_new_token_ratio_follows_sglang_s_default_schedule() -> None:
    assert new_token_ratio(0) == pytest.approx(0.7)
    assert new_token_ratio(300) == pytest.approx((0.7 + 0.098) / 2)
    assert new_token_ratio(600) == pytest.approx(0.098)
    assert new_token_ratio(1e9) == pytest.approx(0.098)


def test_a_request_past_what_the_predictor_has_seen_runs_as_long_again() -> None:
    # Backed by enough completions: the predictor's own estimate.
    assert predicted_left(300, 200, 1_000, MIN_OUTLIVED) == 100
    # Outliving nearly all it learnt from: at least as long again, within its limit.
    assert predicted_left(300, 200, 1_000, MIN_OUTLIVED - 1) == 200
    assert predicted_left(300, 200, 350, 0) == 150


def test_the_latency_model_takes_the_wait_as_its_ttft_term() -> None:
    predictor = LatencyPredictor(tpot_s=TPOT)
    load = EngineLoad(0, 3, 0.9)
    running = tuple(_ignoring_eos(2_000, 1_000, n) for n in (300, 100, 200))
    stalled = predictor.forecast(
        load, EngineBacklog(10_000, running), PendingRequest(2_000, 2_000, 50)
    )
    free = predictor.forecast(
        load, EngineBacklog(100_000, running), PendingRequest(2_000, 2_000, 50)
    )
    assert stalled.load.admission_wait_s == pytest.approx(2.0)
    assert free.load.admission_wait_s == 0.0
    # The prior's weight on the wait is 1: the forecast moves by the wait.
    assert stalled.wait_s - free.wait_s == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: EngineBacklog(-1), "capacity"),
        (lambda: EngineBacklog(10, busy_s=-1.0), "busy_s"),
        (lambda: EngineBacklog(10, (RunningRequest(-1, 0, 0),)), "negative"),
        (lambda: EngineBacklog(10, (), (PendingRequest(1, -1, 0),)), "negative"),
        (lambda: admission_wait_s(EngineBacklog(10), PendingRequest(1, 1, 1), 0.0), "tpot_s"),
        (lambda: new_token_ratio(-1.0), "decode_steps"),
        (lambda: EngineLoad(0, 0, 0.0, admission_wait_s=float("nan")), "admission_wait_s"),
    ],
)
def test_bad_input_is_refused(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()
