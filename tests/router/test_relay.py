"""The relay's reading of events: a fresh /generate stream read for its counts, and a
resumed stream's events continuing the first one's text, ids and counts (the framing's own
tests are in tests/transport/test_sse.py)."""

from __future__ import annotations

import json

from controlplane.contract import EngineAPI
from controlplane.gateway.relay import Received, Splicer


def test_a_resumed_generate_stream_continues_cumulative_fields() -> None:
    received = Received(EngineAPI.GENERATE)
    splicer = Splicer(received)
    first = {"text": "abc", "output_ids": [97, 98, 99],
             "meta_info": {"id": "rid-1", "prompt_tokens": 5, "completion_tokens": 3}}  # fmt: skip
    assert splicer.take(json.dumps(first).encode()) is None  # forwarded untouched
    splicer.resumed()
    second = {"text": "d", "output_ids": [100],
              "meta_info": {"id": "rid-2", "prompt_tokens": 8, "completion_tokens": 1,
                            "finish_reason": {"type": "length", "length": 4}}}  # fmt: skip
    rewritten = json.loads(splicer.take(json.dumps(second).encode()) or b"")
    assert rewritten["text"] == "abcd"
    assert rewritten["output_ids"] == [97, 98, 99, 100]
    assert rewritten["meta_info"] == {
        "id": "rid-1", "prompt_tokens": 5, "completion_tokens": 4,
        "finish_reason": {"type": "length", "length": 4},
    }  # fmt: skip
    assert (received.text, received.tokens, received.finish_reason) == ("abcd", 4, "length")


def test_a_resumed_chat_stream_keeps_its_id_and_announces_the_role_once() -> None:
    received = Received(EngineAPI.CHAT, prompt_tokens=12)  # the gateway's estimate
    splicer = Splicer(received)
    for piece in ("He", "llo"):
        chunk = {"id": "chat-1", "choices": [{"index": 0, "delta": {"content": piece}}]}
        assert splicer.take(json.dumps(chunk).encode()) is None
    splicer.resumed()
    role = {
        "id": "chat-2",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    assert json.loads(splicer.take(json.dumps(role).encode()) or b"") == {
        "id": "chat-1", "choices": [{"index": 0, "delta": {"content": ""}}],
    }  # fmt: skip
    usage = {"id": "chat-2", "choices": [],
             "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}}  # fmt: skip
    assert json.loads(splicer.take(json.dumps(usage).encode()) or b"")["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
    }  # fmt: skip


def test_a_fresh_generate_stream_is_read_for_its_counts_and_its_output_at_resume() -> None:
    received = Received(EngineAPI.GENERATE)
    splicer = Splicer(received)
    for n in (1, 2, 3):
        event = {"text": "abc"[:n], "output_ids": [97, 98, 99][:n],
                 "meta_info": {"id": "rid-1", "prompt_tokens": 5, "completion_tokens": n,
                               "finish_reason": {"type": "length"} if n == 3 else None}}  # fmt: skip
        assert splicer.take(json.dumps(event, separators=(",", ":")).encode()) is None
    assert (received.tokens, received.prompt_tokens, received.response_id) == (3, 5, "rid-1")
    assert received.finish_reason == "length"
    received.settle()  # what a resume reads: the latest event's cumulative output
    assert (received.text, received.ids) == ("abc", [97, 98, 99])


def test_a_generate_event_without_counts_is_read_whole() -> None:
    received = Received(EngineAPI.GENERATE)
    splicer = Splicer(received)
    assert splicer.take(b'{"text": "ab", "output_ids": [97, 98], "meta_info": {}}') is None
    assert (received.tokens, received.text, received.ids) == (2, "ab", [97, 98])
    splicer.resumed()
    assert splicer.base is not None
    assert (splicer.base.text, splicer.base.ids) == ("ab", [97, 98])
