"""The splicer, as router and sidecar both read a stream: a fresh `/generate` stream read
for its counts, OpenAI streams counted from the engine's own counts, what the client did
not ask for taken out, and a resumed stream's events continuing the first one's text, ids,
counts, id and timestamp (the framing's own tests are in tests/transport/test_sse.py; the
relay's, with real engines, in tests/router and tests/sidecar)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controlplane.contract import EngineAPI
from controlplane.stream import Asks, MalformedEventError, Splicer, ask_for_counts
from controlplane.stream.events import whole_answer, without_usage


def _read(splicer: Splicer, chunk: dict[str, Any]) -> dict[str, Any] | None:
    """What the client receives of one event (None: nothing)."""
    data = json.dumps(chunk, separators=(",", ":")).encode()
    raw = b"data: " + data + b"\n\n"
    out = splicer.read(raw, data)
    if out is None:
        return None
    assert out[:6] + out[-2:] == b"data: \n\n"
    return json.loads(out[6:])  # type: ignore[no-any-return]


def _generate(text: str, ids: list[int], **meta: Any) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": {"id": "rid-1", **meta}}


def test_a_fresh_generate_stream_is_read_for_its_counts_and_its_output_at_resume() -> None:
    splicer = Splicer(EngineAPI.GENERATE)
    for n in (1, 2, 3):
        event = _generate("abc"[:n], [97, 98, 99][:n], prompt_tokens=5, completion_tokens=n,
                          finish_reason={"type": "length"} if n == 3 else None)  # fmt: skip
        data = json.dumps(event).encode()
        assert splicer.read(b"raw", data) == b"raw"  # forwarded as it came
    assert (splicer.generated, splicer.prompt_tokens, splicer.client_id) == (3, 5, "rid-1")
    assert (splicer.finish, splicer.ids_delta, splicer.skims) == ("length", False, True)
    assert (splicer.generated_text(), splicer.exact_ids()) == ("abc", [97, 98, 99])


def test_a_resumed_generate_stream_continues_cumulative_fields() -> None:
    splicer = Splicer(EngineAPI.GENERATE)
    for n in (1, 2, 3):
        _read(splicer, _generate("abc"[:n], [97, 98, 99][:n], prompt_tokens=5,
                                 completion_tokens=n, cached_tokens=2))  # fmt: skip
    splicer.next_segment()
    second = _generate("d", [100], prompt_tokens=8, completion_tokens=1, cached_tokens=7,
                       finish_reason={"type": "length", "length": 1})  # fmt: skip
    second["meta_info"]["id"] = "rid-2"
    assert _read(splicer, second) == {
        "text": "abcd", "output_ids": [97, 98, 99, 100],
        "meta_info": {"id": "rid-1", "prompt_tokens": 5, "completion_tokens": 4,
                      "cached_tokens": 2, "finish_reason": {"type": "length", "length": 4}},
    }  # fmt: skip
    assert (splicer.generated_text(), splicer.generated, splicer.finish) == ("abcd", 4, "length")


def test_ids_sent_event_by_event_are_learnt_and_joined() -> None:
    """SGLang 0.5.5 sends each event's own ids: the client holds them all, and a resumed
    segment's events are not given the earlier ones again."""
    splicer = Splicer(EngineAPI.GENERATE)
    for n in (1, 2, 3):
        _read(splicer, _generate("abc"[:n], [96 + n], completion_tokens=n))
    assert (splicer.ids_delta, splicer.skims, splicer.exact_ids()) == (True, False, [97, 98, 99])
    splicer.next_segment()
    resumed = _read(splicer, _generate("d", [100], completion_tokens=1))
    assert resumed is not None
    assert (resumed["text"], resumed["output_ids"]) == ("abcd", [100])
    assert splicer.exact_ids() == [97, 98, 99, 100]


def test_a_generate_event_without_counts_is_counted_by_its_ids() -> None:
    splicer = Splicer(EngineAPI.GENERATE)
    assert _read(splicer, {"text": "ab", "output_ids": [97, 98], "meta_info": {}}) is not None
    assert (splicer.generated, splicer.generated_text(), splicer.exact_ids()) == (
        2, "ab", [97, 98],
    )  # fmt: skip


def _completion(text: str, completion_tokens: int | None, **extra: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    if completion_tokens is not None:
        chunk["usage"] = {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                          "total_tokens": 9 + completion_tokens}  # fmt: skip
    return chunk | extra


def test_openai_tokens_are_the_engines_count_not_the_texts_bytes() -> None:
    """One chunk may carry several tokens, and one token several bytes: the usage the
    splicer asked for counts, and a client that did not ask for it does not see it."""
    splicer = Splicer(EngineAPI.COMPLETIONS, Asks.of({}), prompt_tokens=3)
    pieces = (("wéir", 1), (" flows over", 3))
    for text, tokens in pieces:
        assert _read(splicer, _completion(text, tokens)) == _completion(text, None)
    assert (splicer.generated, splicer.prompt_tokens) == (3, 9)  # the estimate replaced
    assert splicer.generated_text() == "wéir flows over"


def test_usage_reaches_a_client_that_asked_for_it() -> None:
    body = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    splicer = Splicer(EngineAPI.COMPLETIONS, Asks.of(body))
    data = json.dumps(_completion("weir", 1)).encode()
    assert splicer.read(b"raw", data) == b"raw"
    final = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    assert splicer.read(b"raw", json.dumps(final).encode()) == b"raw"


def test_without_cumulative_usage_each_content_chunk_counts_one_token() -> None:
    """An upstream that ignores continuous_usage_stats: the chunk count stands in, and the
    usage chunk after the last corrects it."""
    splicer = Splicer(EngineAPI.COMPLETIONS, Asks.of({}))
    for text in ("a", "bc", ""):
        _read(splicer, _completion(text, None))
    assert splicer.generated == 2
    final = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    assert _read(splicer, final) is None  # the client did not ask for it
    assert splicer.generated == 3


def test_usage_is_taken_out_however_the_chunk_is_laid_out() -> None:
    chunk = _completion("x", 1)
    first = {"usage": chunk.pop("usage"), **chunk}
    for layout in (_completion("x", 1), first, {**chunk, "usage": None}):
        data = json.dumps(layout).encode()
        assert json.loads(without_usage(data)) == chunk


def test_a_resumed_chat_stream_keeps_its_id_and_timestamp_and_announces_the_role_once() -> None:
    splicer = Splicer(EngineAPI.CHAT, Asks.of({"stream_options": {"include_usage": True}}))

    def chunk(id_: str, created: int, delta: dict[str, Any], done: int) -> dict[str, Any]:
        return {
            "id": id_, "object": "chat.completion.chunk", "created": created,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            "usage": {"prompt_tokens": 12, "completion_tokens": done, "total_tokens": 12 + done},
        }  # fmt: skip

    _read(splicer, chunk("chat-1", 100, {"role": "assistant", "content": ""}, 0))
    for done, piece in enumerate(("He", "llo"), start=1):
        _read(splicer, chunk("chat-1", 100, {"content": piece}, done))
    splicer.next_segment()
    assert _read(splicer, chunk("chat-2", 200, {"role": "assistant", "content": ""}, 0)) is None
    assert _read(splicer, chunk("chat-2", 200, {"content": "!"}, 1)) == {
        "id": "chat-1", "object": "chat.completion.chunk", "created": 100,
        "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": None}],
    }  # fmt: skip
    usage = {"id": "chat-2", "created": 200, "choices": [],
             "usage": {"prompt_tokens": 15, "completion_tokens": 1, "total_tokens": 16}}  # fmt: skip
    assert _read(splicer, usage) == {
        "id": "chat-1", "created": 100, "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }  # fmt: skip
    assert splicer.generated_text() == "Hello!"


def test_an_error_event_reaches_the_client_and_marks_the_stream_failed() -> None:
    for api in EngineAPI:
        splicer = Splicer(api, Asks.of({}))
        assert _read(splicer, {"error": {"message": "engine failed"}}) is not None
        assert splicer.failed


def test_an_unreadable_event_is_malformed() -> None:
    for api in EngineAPI:
        with pytest.raises(MalformedEventError):
            Splicer(api).read(b"data: {\n\n", b"{")


def test_a_hop_asks_its_upstream_for_counts_and_ids_only_where_it_can_say_them() -> None:
    body: dict[str, Any] = {"stream_options": {"include_usage": False}}
    ask_for_counts(EngineAPI.CHAT, body, token_ids=False)
    assert body == {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    generate: dict[str, Any] = {}
    ask_for_counts(EngineAPI.GENERATE, generate, token_ids=True)
    assert generate == {}
    completions: dict[str, Any] = {}
    ask_for_counts(EngineAPI.COMPLETIONS, completions, token_ids=True)
    assert completions["return_token_ids"] is True


def test_a_whole_answer_is_read_in_either_shape() -> None:
    generate = {"text": "ab", "meta_info": {"finish_reason": {"type": "length"},
                                            "prompt_tokens": 4, "completion_tokens": 2}}  # fmt: skip
    openai = {"choices": [{"text": "ab", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 2}}  # fmt: skip
    assert whole_answer(json.dumps(generate).encode()) == ("length", 2, 4)
    assert whole_answer(json.dumps(openai).encode()) == ("stop", 2, 4)
    assert whole_answer(b"not json") == ("", 0, 0)


def test_token_ids_reach_a_client_that_asked_for_them_and_usage_only_if_asked() -> None:
    splicer = Splicer(EngineAPI.COMPLETIONS, Asks.of({"return_token_ids": True}))
    chunk = _completion("weir", 1)
    chunk["choices"][0]["token_ids"] = [7]
    assert _read(splicer, chunk) == {
        **_completion("weir", None), "choices": [{**chunk["choices"][0]}],
    }  # fmt: skip
    assert splicer.exact_ids() == [7]
