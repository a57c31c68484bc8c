"""The request state machine: every legal path, illegal moves raise, per-state data."""

from __future__ import annotations

import pytest

from controlplane.contract import FinishReason
from engine_sidecar.policy import TRANSITIONS, IllegalTransitionError, RequestRecord, RequestState

S = RequestState


def _record(**kw: object) -> RequestRecord:
    fields: dict[str, object] = {
        "rid": "r" * 32,
        "tenant": "t",
        "model": "m",
        "prompt_tokens": 10,
        "max_new_tokens": 20,
        "arrived_at": 0.0,
    }
    fields.update(kw)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def test_happy_path_with_preemption_and_resume() -> None:
    r = _record()
    assert r.kv_held_tokens == 0
    r = r.transition(S.PREFILL_READY, 1.0).transition(S.PREFILL_RUNNING, 1.0)
    assert r.kv_held_tokens == 10
    r = r.transition(S.DECODE_READY, 2.0).transition(S.DECODING, 2.0).with_generated(5)
    assert (r.kv_held_tokens, r.remaining_tokens, r.remaining_prompt_tokens) == (15, 15, 0)
    r = r.transition(S.DECODE_PREEMPTED, 4.0)
    assert (r.preemptions, r.kv_held_tokens, r.service_s) == (1, 0, 3.0)
    r = r.transition(S.DECODE_READY, 5.0).transition(S.DECODING, 5.0)
    r = r.with_generated(20).transition(S.FINISHED, 7.0, FinishReason.LENGTH)
    assert r.state.is_final
    assert r.finish_reason is FinishReason.LENGTH
    assert r.kv_held_tokens == 0
    assert r.service_s == 5.0


def test_prefill_pauses_and_resumes() -> None:
    r = _record().transition(S.PREFILL_READY, 0).transition(S.PREFILL_RUNNING, 0)
    r = r.transition(S.PREFILL_PAUSED, 1).transition(S.PREFILL_RUNNING, 2)
    assert r.preemptions == 0  # a yield is not a preemption
    assert r.state is S.PREFILL_RUNNING


@pytest.mark.parametrize("final", [s for s in S if s.is_final])
def test_final_states_are_dead_ends(final: RequestState) -> None:
    assert TRANSITIONS[final] == frozenset()


def test_every_non_final_state_can_be_cancelled_or_rejected() -> None:
    for state, targets in TRANSITIONS.items():
        if not state.is_final:
            assert S.CANCELLED in targets, state
            assert targets & {S.ABORTED, S.REJECTED}, state


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], S.DECODING),
        ([S.PREFILL_READY], S.DECODING),
        ([S.PREFILL_READY, S.PREFILL_RUNNING], S.DECODE_PREEMPTED),
        ([S.PREFILL_READY, S.PREFILL_RUNNING, S.DECODE_READY], S.PREFILL_RUNNING),
    ],
)
def test_illegal_transitions_raise_and_leave_record(
    path: list[RequestState], illegal: RequestState
) -> None:
    r = _record()
    for step in path:
        r = r.transition(step, 0)
    with pytest.raises(IllegalTransitionError):
        r.transition(illegal, 1)
    assert r.state is (path[-1] if path else S.WAITING_ADMISSION)


def test_final_states_need_a_matching_reason() -> None:
    r = _record()
    with pytest.raises(IllegalTransitionError):
        r.transition(S.CANCELLED, 0)
    with pytest.raises(IllegalTransitionError):
        r.transition(S.REJECTED, 0, FinishReason.STOP)
    with pytest.raises(IllegalTransitionError):
        r.transition(S.PREFILL_READY, 0, FinishReason.STOP)
    cancelled = r.transition(S.CANCELLED, 0, FinishReason.CANCELLED)
    with pytest.raises(IllegalTransitionError):
        cancelled.transition(S.FINISHED, 1, FinishReason.STOP)


def test_generated_tokens_never_shrink() -> None:
    r = _record().with_generated(3)
    with pytest.raises(ValueError, match="shrink"):
        r.with_generated(2)


def test_a_transition_keeps_every_field_it_does_not_change() -> None:
    values = {
        "rid": "r-keep",
        "tenant": "t",
        "model": "m",
        "prompt_tokens": 11,
        "max_new_tokens": 22,
        "arrived_at": 3.0,
        "state": RequestState.DECODING,
        "state_since": 4.0,
        "computed_prompt_tokens": 11,
        "generated_tokens": 5,
        "deadline_at": 9.0,
        "priority": 2,
        "preemptions": 1,
        "service_s": 0.5,
        "recomputable": False,
        "migratable": True,
        "client_connected": False,
        "finish_reason": None,
    }
    assert set(values) == set(RequestRecord.__dataclass_fields__)
    record = RequestRecord(**values)  # type: ignore[arg-type]
    moved = record.transition(RequestState.DECODE_PREEMPTED, 6.0).with_generated(7)
    changed = {"state", "state_since", "service_s", "preemptions", "generated_tokens"}
    for name, value in values.items():
        if name not in changed:
            assert getattr(moved, name) == value, name
    assert (moved.state, moved.state_since, moved.preemptions) == (
        RequestState.DECODE_PREEMPTED,
        6.0,
        2,
    )
    assert (moved.service_s, moved.generated_tokens) == (2.5, 7)
