"""Per-request fields: priority and deadline from headers or body, and continuations."""

from __future__ import annotations

import pytest

from controlplane.contract import Continuation, EngineAPI
from controlplane.router import RequestLimits, RouterError
from controlplane.router.requests import ClientRequest, parse_client_request, resume_body

MODELS = frozenset({"m"})


def _parse(
    api: EngineAPI, body: dict[str, object], headers: dict[str, str] | None = None
) -> ClientRequest:
    return parse_client_request(
        api, body, headers or {}, models=MODELS, default_model="m", limits=RequestLimits(1000, 1.0)
    )


def test_headers_win_over_body_fields_and_weir_fields_stay_out_of_the_upstream_body() -> None:
    body = {"model": "m", "prompt": "hello", "priority": 3, "weir_deadline_ms": 9000,
            "stream": True, "rid": "client-rid"}  # fmt: skip
    request = _parse(
        EngineAPI.COMPLETIONS, body, {"x-weir-priority": "7", "x-weir-deadline-ms": "2500"}
    )
    assert request.priority == 7
    assert request.deadline_s == 2.5
    assert request.stream
    assert request.body == {"model": "m", "prompt": "hello", "priority": 7}
    from_body = _parse(EngineAPI.COMPLETIONS, {**body, "stream": False})
    assert (from_body.priority, from_body.deadline_s) == (3, 9.0)


def test_limits_default_per_api_and_to_the_context_left() -> None:
    assert _parse(EngineAPI.COMPLETIONS, {"model": "m", "prompt": "x"}).max_new_tokens == 16
    assert _parse(EngineAPI.GENERATE, {"text": "x"}).max_new_tokens == 128
    chat = _parse(EngineAPI.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.max_new_tokens == 1000 - chat.prompt_tokens
    with pytest.raises(RouterError, match="context length"):
        _parse(
            EngineAPI.GENERATE, {"input_ids": [1] * 900, "sampling_params": {"max_new_tokens": 200}}
        )


def test_prompts_by_token_ids_are_counted_exactly_and_a_batch_of_one_is_its_prompt() -> None:
    by_ids = _parse(EngineAPI.COMPLETIONS, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4.0})
    assert (by_ids.prompt_ids, by_ids.prompt_tokens, by_ids.max_new_tokens) == ((5, 6, 7), 3, 4)
    one = _parse(EngineAPI.COMPLETIONS, {"model": "m", "prompt": ["hello"]})
    assert (one.prompt_text, one.body["prompt"]) == ("hello", "hello")
    with pytest.raises(RouterError) as caught:
        _parse(EngineAPI.COMPLETIONS, {"model": "m", "prompt": [1] * 990, "max_tokens": 20})
    assert (caught.value.reason, caught.value.param) == ("context_length_exceeded", "prompt")


def test_a_header_is_checked_by_the_same_rule_as_its_body_field() -> None:
    for headers, param in (({"x-weir-priority": "5000"}, "x-weir-priority"),
                           ({"x-weir-deadline-ms": "-1"}, "x-weir-deadline-ms"),
                           ({"x-weir-deadline-ms": "soon"}, "x-weir-deadline-ms")):  # fmt: skip
        with pytest.raises(RouterError) as caught:
            _parse(EngineAPI.GENERATE, {"text": "x"}, headers)
        assert (caught.value.status, caught.value.param) == (400, param)
    # a valid header wins, and the body field it replaces is not read
    assert _parse(EngineAPI.GENERATE, {"text": "x", "priority": "?"}, {"x-weir-priority": "-3"}
                  ).body == {"text": "x", "priority": -3}  # fmt: skip


@pytest.mark.parametrize(
    ("api", "body", "expected"),
    [
        (EngineAPI.COMPLETIONS, {"model": "m", "prompt": "ab", "max_tokens": 10},
         {"model": "m", "prompt": "abXYZ", "max_tokens": 7}),
        (EngineAPI.CHAT, {"model": "m", "messages": [{"role": "user", "content": "q"}],
                          "max_completion_tokens": 10},
         {"model": "m", "max_tokens": 7, "continue_final_message": True,
          "add_generation_prompt": False,
          "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "XYZ"}]}),
        (EngineAPI.GENERATE, {"text": "ab", "sampling_params": {"max_new_tokens": 10}},
         {"text": "abXYZ", "sampling_params": {"max_new_tokens": 7}}),
    ],
)  # fmt: skip
def test_a_continuation_extends_the_prompt_by_what_the_client_received(
    api: EngineAPI, body: dict[str, object], expected: dict[str, object]
) -> None:
    continuation = Continuation(
        request_id="r", model="m", api=api, body=body, generated_text="XYZ",
        generated_tokens=3, max_new_tokens=10,
    )  # fmt: skip
    assert resume_body(continuation) == expected


def test_a_generate_continuation_by_ids_appends_the_generated_ids() -> None:
    continuation = Continuation(
        request_id="r", model="m", api=EngineAPI.GENERATE,
        body={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}},
        prompt_ids=(1, 2), generated_ids=(7, 8), generated_text="??", max_new_tokens=5,
    )  # fmt: skip
    assert resume_body(continuation) == {
        "input_ids": [1, 2, 7, 8],
        "sampling_params": {"max_new_tokens": 3},
    }


def test_a_completion_prompted_by_token_ids_is_not_resumed_from_its_text() -> None:
    request = _parse(EngineAPI.COMPLETIONS, {"model": "m", "prompt": [1, 2], "max_tokens": 5})
    continuation = Continuation(
        request_id="r", model="m", api=EngineAPI.COMPLETIONS, body=request.body,
        prompt_ids=request.prompt_ids, generated_text="ab", max_new_tokens=5,
    )  # fmt: skip
    with pytest.raises(RouterError) as caught:
        resume_body(continuation)
    assert (caught.value.status, caught.value.reason) == (503, "not_resumable")
