"""Every rule of the shared request checks, on each entry API: what is refused (status,
reason, parameter) and what passes (the body forwarded, the prompt, the output limit)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.contract import EngineAPI
from controlplane.rules.request_checks import (
    CheckedBody,
    RequestCheckError,
    check,
    deadline_s,
    decode_body,
    priority,
)

GEN, CMP, CHAT = EngineAPI.GENERATE, EngineAPI.COMPLETIONS, EngineAPI.CHAT
CONTEXT = 1000
USER = [{"role": "user", "content": "hi"}]
# A minimal valid body of each API, that a case adds its fields to.
BASE: dict[EngineAPI, dict[str, Any]] = {
    GEN: {"text": "hi"},
    CMP: {"model": "m", "prompt": "hi"},
    CHAT: {"model": "m", "messages": USER},
}


def _check(api: EngineAPI, body: dict[str, Any]) -> CheckedBody:
    return check(api, body, models=("m", "n"), default_model="m", context_length=CONTEXT)


def _sampling(api: EngineAPI, **fields: object) -> dict[str, Any]:
    """`fields` where `api` takes sampling parameters."""
    if api is GEN:
        return {**BASE[GEN], "sampling_params": fields}
    return {**BASE[api], **fields}


def _param(api: EngineAPI, name: str) -> str:
    return f"sampling_params.{name}" if api is GEN else name


ALL = (GEN, CMP, CHAT)
OPENAI = (CMP, CHAT)
LIMIT = {GEN: "max_new_tokens", CMP: "max_tokens", CHAT: "max_completion_tokens"}

# (api, body, status, reason, param)
REFUSED: list[tuple[EngineAPI, dict[str, Any], int, str, str | None]] = [
    # stream
    *((api, {**BASE[api], "stream": "yes"}, 400, "invalid_stream", "stream") for api in ALL),
    *((api, {**BASE[api], "stream": 1}, 400, "invalid_stream", "stream") for api in ALL),
    # model
    *((api, {**BASE[api], "model": None}, 400, "missing_model", "model") for api in OPENAI),
    *((api, {**BASE[api], "model": ""}, 400, "missing_model", "model") for api in ALL),
    *((api, {**BASE[api], "model": 7}, 400, "missing_model", "model") for api in ALL),
    *((api, {**BASE[api], "model": "other"}, 404, "unknown_model", "model") for api in ALL),
    # prompts: /generate
    (GEN, {}, 400, "missing_prompt", "text"),
    (GEN, {"text": ""}, 400, "missing_prompt", "text"),
    (GEN, {"text": ["a"]}, 400, "missing_prompt", "text"),
    (GEN, {"input_ids": []}, 400, "missing_prompt", "input_ids"),
    (GEN, {"input_ids": "1 2"}, 400, "missing_prompt", "input_ids"),
    (GEN, {"input_ids": [1, -5]}, 400, "invalid_prompt", "input_ids"),
    (GEN, {"input_ids": [1, 2**31]}, 400, "invalid_prompt", "input_ids"),
    (GEN, {"input_ids": [1, True]}, 400, "invalid_prompt", "input_ids"),
    (GEN, {"input_ids": [1, 2.0]}, 400, "invalid_prompt", "input_ids"),
    (GEN, {"text": "x", "sampling_params": [1]}, 400, "invalid_parameter", "sampling_params"),
    # prompts: completions
    (CMP, {"model": "m"}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": ""}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": []}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": ["a", "b"]}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": [[1], [2]]}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": {"text": "a"}}, 400, "missing_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": [1, "a"]}, 400, "invalid_prompt", "prompt"),
    (CMP, {"model": "m", "prompt": [[1, -1]]}, 400, "invalid_prompt", "prompt"),
    # prompts: chat
    (CHAT, {"model": "m"}, 400, "missing_messages", "messages"),
    (CHAT, {"model": "m", "messages": []}, 400, "missing_messages", "messages"),
    (CHAT, {"model": "m", "messages": "hi"}, 400, "missing_messages", "messages"),
    (CHAT, {"model": "m", "messages": [{"content": "x"}]}, 400, "invalid_messages", "messages"),
    (CHAT, {"model": "m", "messages": ["x"]}, 400, "invalid_messages", "messages"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_messages", "messages"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url",
     "image_url": {"url": "http://x"}}]}]}, 400, "invalid_messages", "messages"),
    # output limits
    *((api, _sampling(api, **{LIMIT[api]: v}), 400, "invalid_max_tokens", _param(api, LIMIT[api]))
      for api in ALL for v in (0, -3, CONTEXT + 1, 1e9, 2.5, "9", True, float("nan"))),
    (CHAT, {**BASE[CHAT], "max_tokens": 0}, 400, "invalid_max_tokens", "max_tokens"),
    # sampling parameters
    *((api, _sampling(api, **{name: v}), 400, "invalid_parameter", _param(api, name))
      for api in ALL
      for name, v in (("temperature", -0.1), ("temperature", 2.5), ("temperature", 1e300),
                      ("temperature", float("nan")), ("temperature", "hot"),
                      ("temperature", False), ("top_p", 1.5), ("top_p", -1),
                      ("presence_penalty", 3), ("frequency_penalty", float("-inf")),
                      ("n", 4), ("n", 0), ("n", "1"), ("n", True))),
    # adapter
    *((api, {**BASE[api], "lora_path": 3}, 400, "invalid_adapter", "lora_path") for api in ALL),
]  # fmt: skip


@pytest.mark.parametrize(("api", "body", "status", "reason", "param"), REFUSED)
def test_each_rule_refuses_with_its_status_reason_and_parameter(
    api: EngineAPI, body: dict[str, Any], status: int, reason: str, param: str | None
) -> None:
    with pytest.raises(RequestCheckError) as caught:
        _check(api, body)
    assert (caught.value.status, caught.value.reason, caught.value.param) == (
        status,
        reason,
        param,
    )
    if param is not None:
        assert param.rsplit(".", 1)[-1] in caught.value.message


@pytest.mark.parametrize(
    ("raw", "reason"),
    [(b"{not json", "malformed_json"), (b"[1, 2]", "malformed_json"), (b'"x"', "malformed_json"),
     (b"", "malformed_json")],
)  # fmt: skip
def test_a_body_must_be_a_json_object(raw: bytes, reason: str) -> None:
    with pytest.raises(RequestCheckError) as caught:
        decode_body(raw)
    assert (caught.value.status, caught.value.reason, caught.value.param) == (400, reason, None)
    assert decode_body(b'{"a": 1}') == {"a": 1}


@pytest.mark.parametrize(
    ("api", "body", "prompt_text", "prompt_ids", "max_new"),
    [
        (GEN, {"text": "hi"}, "hi", (), 128),
        (GEN, {"input_ids": [5, 6], "text": "ignored"}, "", (5, 6), 128),
        (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 7.0}}, "hi", (), 7),
        (CMP, {"model": "m", "prompt": "hi"}, "hi", (), 16),
        (CMP, {"model": "m", "prompt": [3, 4], "max_tokens": 5}, "", (3, 4), 5),
        (CMP, {"model": "m", "prompt": "hi", "max_tokens": None}, "hi", (), 16),
        (CHAT, {"model": "n", "messages": USER}, "user\nhi\n", (), 0),
        (CHAT, {"model": "m", "messages": USER, "max_completion_tokens": 9, "max_tokens": 3},
         "user\nhi\n", (), 9),
        (CHAT, {"model": "m", "messages": USER, "max_completion_tokens": None, "max_tokens": 3},
         "user\nhi\n", (), 3),
        (CHAT, {"model": "m", "messages": [{"role": "system", "content": None},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]},
         "system\n\nuser\nab\n", (), 0),
    ],
)  # fmt: skip
def test_what_passes_its_prompt_and_its_limit_or_the_apis_default(
    api: EngineAPI,
    body: dict[str, Any],
    prompt_text: str,
    prompt_ids: tuple[int, ...],
    max_new: int,
) -> None:
    checked = _check(api, body)
    assert (checked.prompt_text, checked.prompt_ids, checked.max_new_tokens) == (
        prompt_text,
        prompt_ids,
        max_new,
    )


def test_stream_and_rid_are_the_edges_own_and_a_batch_of_one_is_its_prompt() -> None:
    body = {"model": "m", "prompt": ["hello"], "stream": True, "rid": "x", "priority": 2}
    checked = _check(CMP, body)
    assert checked.stream
    assert checked.body == {"model": "m", "prompt": "hello", "priority": 2}
    assert body["prompt"] == ["hello"]  # the caller's body is left as it was
    ids = _check(CMP, {"model": "m", "prompt": [[1, 2]]})
    assert (ids.prompt_ids, ids.body["prompt"]) == ((1, 2), [1, 2])
    assert _check(GEN, {"text": "x"}).model == "m"
    assert _check(GEN, {"text": "x", "model": "n"}).model == "n"


def test_values_at_the_edges_of_each_range_pass() -> None:
    for api in ALL:
        edges = {"temperature": 2, "top_p": 0.0, "presence_penalty": -2.0, "n": 1.0}
        checked = _check(api, _sampling(api, **{LIMIT[api]: CONTEXT}, **edges))
        assert checked.max_new_tokens == CONTEXT
        assert _check(api, _sampling(api, temperature=None, n=None, top_p=None)).stream is False


def test_the_output_limit_fits_the_context_beside_the_prompt() -> None:
    chat = _check(CHAT, BASE[CHAT])
    assert chat.output_limit(400, CONTEXT) == 600  # chat without a limit: what is left
    assert chat.output_limit(CONTEXT + 50, CONTEXT, enforce=False) == 1
    gen = _check(GEN, {"input_ids": [1], "sampling_params": {"max_new_tokens": 200}})
    assert gen.output_limit(800, CONTEXT) == 200
    assert gen.output_limit(900, CONTEXT, enforce=False) == 200
    for prompt_tokens, checked in ((801, gen), (CONTEXT, chat)):
        with pytest.raises(RequestCheckError) as caught:
            checked.output_limit(prompt_tokens, CONTEXT)
        error = caught.value
        assert (error.status, error.reason) == (400, "context_length_exceeded")
        assert error.param == checked.prompt_param


def test_priority_and_deadline() -> None:
    assert (priority(None), priority(-1000), priority(1000.0), priority(7, "x-weir-priority")) == (
        0,
        -1000,
        1000,
        7,
    )
    for value in (1001, -1001, "high", True, 0.5, float("inf")):
        with pytest.raises(RequestCheckError) as caught:
            priority(value)
        assert (caught.value.reason, caught.value.param) == ("invalid_priority", "priority")
    assert (deadline_s(None, "d"), deadline_s(2500, "d"), deadline_s(0.5, "d")) == (
        0.0,
        2.5,
        0.0005,
    )
    for value in (0, -1, float("nan"), float("inf"), 86_400_001, "10", True):
        with pytest.raises(RequestCheckError) as caught:
            deadline_s(value, "weir_deadline_ms")
        assert (caught.value.reason, caught.value.param) == ("invalid_deadline", "weir_deadline_ms")
