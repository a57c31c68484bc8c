"""The sidecar's engine adapter (`engine_sidecar.engine.SGLangEngine`) against SGLang's own
server, 0.5.23 and 0.5.5: what it reads of the server, streams, aborts, pauses and resumes."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from engine_sidecar.engine import SGLangEngine
from tests.sglang.server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
async def engine(sglang: SGLangServer) -> AsyncIterator[SGLangEngine]:
    adapter = SGLangEngine(sglang.url, timeout_s=120)
    try:
        yield adapter
    finally:
        await adapter.close()


def generate(tokens: int, rid: str = "", stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": PROMPT,
        "stream": stream,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    if rid:
        body["rid"] = rid
    return body


def collect(events: list[dict[str, Any]], batch: list[Any]) -> bool:
    """A push callback that decodes every event into `events` and reads on."""
    events.extend(msgspec.json.decode(e.data) for e in batch if e.data != b"[DONE]")
    return False


async def stream_events(
    engine: SGLangEngine, body: dict[str, Any], path: str = "/generate"
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with engine.open(path, body) as stream:
        assert stream.status == 200
        await stream.push(lambda batch: collect(events, batch))
    return events


async def test_server_info_reads_what_the_sidecar_needs(
    engine: SGLangEngine, sglang: SGLangServer
) -> None:
    info = await engine.server_info()
    assert info.version == sglang.version
    assert info.kv_capacity_tokens == 4096  # --max-total-tokens, top level in server info
    assert info.page_size == (16 if sglang.version == "0.5.23" else 1)
    assert info.context_length == 0  # null in server info: the launch flag was not set
    assert info.max_req_input_len == 4090
    assert info.loads_api == ("v1_loads" if sglang.version == "0.5.23" else "get_load")
    assert info.model.endswith("tiny-llama")


async def test_a_stream_through_the_adapter_is_cumulative_and_ends_with_its_length(
    engine: SGLangEngine,
) -> None:
    events = await stream_events(engine, generate(12, rid="weiradapterstream000"))
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["meta_info"]["completion_tokens"] == 12
    assert last["meta_info"]["id"] == "weiradapterstream000"
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative


async def test_abort_ends_a_running_stream_and_frees_its_kv(engine: SGLangEngine) -> None:
    """The load report the sidecar reads (/v1/loads, /get_load) counts the abort at once.
    SGLang's /metrics gauges do not: they are set every `--decode-log-interval` decode
    steps, so one that was set while the request ran keeps its value once nothing runs
    (0.5.5 with priority scheduling read num_running_reqs 1 after the abort)."""
    rid = "weiradapterabort0001"
    events: list[dict[str, Any]] = []
    async with engine.open("/generate", generate(2000, rid=rid)) as stream:
        await stream.push(lambda batch: True)  # the first tokens: it runs
        await engine.abort(rid)
        await stream.push(lambda batch: collect(events, batch))
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 2000
    load = await engine.load()
    assert (load.running_requests, load.waiting_requests) == (0, 0)


async def test_pause_then_resume_leaves_the_engine_serving(
    engine: SGLangEngine, sglang: SGLangServer
) -> None:
    """The sidecar pauses an engine for relief or drain and resumes it: afterwards the
    engine must serve again (0.5.23 stayed paused when resumed with an empty body)."""
    await engine.server_info()
    await engine.pause()
    await engine.resume()
    events = await asyncio.wait_for(stream_events(engine, generate(4)), timeout=60)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_aborts_what_runs_and_resume_admits_again(engine: SGLangEngine) -> None:
    rid = "weiradapterpaused001"
    events: list[dict[str, Any]] = []
    async with engine.open("/generate", generate(2000, rid=rid)) as stream:
        await stream.push(lambda batch: True)  # the first tokens: it runs
        await engine.pause()
        await stream.push(lambda batch: collect(events, batch))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    await engine.resume()
    again = await asyncio.wait_for(stream_events(engine, generate(3)), timeout=60)
    assert again[-1]["meta_info"]["completion_tokens"] == 3


async def test_load_reports_a_running_request(engine: SGLangEngine) -> None:
    rid = "weiradapterload00001"
    seen: list[int] = []
    async with engine.open("/generate", generate(2000, rid=rid)) as stream:
        await stream.push(lambda batch: True)  # the first tokens: it runs
        for _ in range(100):
            load = await engine.load()
            if load.running_requests:
                seen.append(load.used_tokens)
                break
            await asyncio.sleep(0.05)
        await engine.abort(rid)
        await stream.push(lambda batch: False)
    assert seen, "the load report never showed the running request"
    assert seen[0] > 0


async def test_unary_generate_and_openai_usage(engine: SGLangEngine) -> None:
    async with engine.open("/generate", generate(5, stream=False)) as reply:
        body = json.loads(await reply.body())
    assert body["meta_info"]["completion_tokens"] == 5
    assert len(body["output_ids"]) == 5
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = await stream_events(engine, chat, "/v1/chat/completions")
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] <= 6
    assert usage["prompt_tokens"] > 0
