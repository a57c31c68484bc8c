"""Bad input is answered as SGLang answers it, with a clear message, and loses nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from fleetsim.server import RunningEngine, serve_engine

from .conftest import small_config

NATIVE = "/generate"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture
async def short_context() -> AsyncIterator[RunningEngine]:
    async with serve_engine(small_config(context_length=128)) as running:
        yield running


CASES = [
    (NATIVE, b"{not json", "json_invalid"),
    (NATIVE, b'{"text": ' + b"[" * 1000 + b"]" * 1000 + b"}", "json_invalid"),
    (NATIVE, b"", "Field required"),
    (NATIVE, b"[1, 2]", "JSON object"),
    (NATIVE, b'{"sampling_params": {}}', "Either text, input_ids"),
    (NATIVE, b'{"text": "a", "input_ids": [1]}', "Either text, input_ids"),
    (NATIVE, b'{"text": 5}', "text must be a string"),
    (NATIVE, b'{"text": ["a", "b"]}', "Batch requests"),
    (NATIVE, b'{"input_ids": [1, "x"]}', "integer token ids"),
    (NATIVE, b'{"input_ids": [1, 99999]}', "out of the vocabulary"),
    (NATIVE, b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', "at least 0"),
    (NATIVE, b'{"text": "a", "sampling_params": {"max_new_tokens": 1e30}}', "maximum context"),
    (NATIVE, b'{"text": "a", "sampling_params": {"max_new_tokens": "many"}}', "integer"),
    (NATIVE, b'{"text": "a", "sampling_params": {"max_new_tokens": NaN}}', "json_invalid"),
    (NATIVE, b'{"text": "a", "sampling_params": 3}', "sampling_params must be an object"),
    (NATIVE, b'{"text": "a", "stream": "yes"}', "stream must be a boolean"),
    (NATIVE, b'{"text": "a", "rid": 7}', "rid must be a non-empty string"),
    (NATIVE, b'{"text": "' + b"x" * 200 + b'"}', "longer than the model's context length"),
    (CHAT, b"{", "json_invalid"),
    (CHAT, b'{"model": "m"}', "Field required: messages"),
    (CHAT, b'{"messages": []}', "must not be empty"),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "x"}]}', "unknown message role"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', "at least 0"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', "maximum"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n=1"),
    (TEXT, b'{"model": "m"}', "Field required: prompt"),
    (TEXT, b'{"prompt": {"a": 1}}', "prompt must be"),
    (TEXT, b'{"prompt": "a", "stream_options": 1}', "stream_options must be an object"),
    (TEXT, b'{"prompt": "' + b"x" * 200 + b'"}', "longer than the model's context length"),
]


@pytest.mark.parametrize(("path", "body", "message"), CASES)
async def test_bad_requests_get_400_with_a_message(
    short_context: RunningEngine, path: str, body: bytes, message: str
) -> None:
    eng = short_context
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{eng.url}{path}", data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            payload = await resp.json()
        # A handler's ValueError on /generate is {"error": {"message"}}; what FastAPI's
        # validation refuses, and any OpenAI error, is SGLang's ErrorResponse.
        if "error" in payload:
            assert path == NATIVE
            text = payload["error"]["message"]
        else:
            text = payload["message"]
            assert (payload["object"], payload["code"]) == ("error", 400)
        assert message in text
        # Nothing was queued or leaked, and the engine still serves.
        assert not eng.engine.requests
        async with http.post(
            f"{eng.url}/generate",
            json={"text": "ok", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["meta_info"]["completion_tokens"] == 3
    assert eng.engine.kv.used_pages == 0


async def test_abort_unknown_rid_is_200_and_malformed_abort_is_400(engine: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{engine.url}/abort_request", json={"rid": "nobody"}) as resp:
            assert resp.status == 200
        async with http.post(f"{engine.url}/abort_request", data=b"{oops") as resp:
            assert resp.status == 400
        async with http.post(f"{engine.url}/abort_request", json={"rid": 5}) as resp:
            assert resp.status == 400
        async with http.get(f"{engine.url}/no_such_endpoint") as resp:
            assert resp.status == 404


async def test_duplicate_rid_is_refused(engine: RunningEngine) -> None:
    body = {"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 100000 - 10}}
    async with aiohttp.ClientSession() as http:
        first = await http.post(f"{engine.url}/generate", json={**body, "stream": True})
        await first.content.readline()
        async with http.post(f"{engine.url}/generate", json=body) as resp:
            assert resp.status == 400
            assert "Duplicate" in (await resp.json())["error"]["message"]
        first.close()
