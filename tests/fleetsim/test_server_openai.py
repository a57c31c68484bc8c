"""The `openai` client against the reference engine over real HTTP."""

from __future__ import annotations

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam

from fleetsim.engine import encode
from fleetsim.engine.chat_template import render
from fleetsim.server import RunningEngine

from .conftest import until


def client(engine: RunningEngine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


async def test_chat_stream_has_exact_usage_and_text(engine: RunningEngine) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say something long."}
    ]
    async with client(engine) as oai:
        stream = await oai.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, reasons, usage = "", [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        again = await oai.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
    prompt = len(encode(render(messages)))
    assert reasons == ["length"]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, 40)
    assert usage.total_tokens == prompt + 40
    assert len(text) == 40
    # Deterministic tokens: the same request gives the same text, streamed or not.
    assert again.choices[0].message.content == text
    assert again.usage is not None
    assert again.usage.completion_tokens == 40


async def test_completion_stream_without_usage_and_plain(engine: RunningEngine) -> None:
    async with client(engine) as oai:
        stream = await oai.completions.create(
            model="m", prompt="abc", max_tokens=9, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [chunk async for chunk in stream]
        plain = await oai.completions.create(
            model="m", prompt="abc", max_tokens=9, extra_body={"ignore_eos": True}
        )
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (3, 9)


async def test_continue_final_message_resumes_exactly(engine: RunningEngine) -> None:
    """A chat continuation (prompt + partial answer) yields what the full run did."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
    async with client(engine) as oai:
        full = await oai.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=30,
            extra_body={"ignore_eos": True},
        )
        whole = full.choices[0].message.content or ""
        rest = await oai.chat.completions.create(
            model="m",
            messages=[*messages, {"role": "assistant", "content": whole[:12]}],
            max_tokens=18,
            extra_body={
                "ignore_eos": True,
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        )
    assert whole[:12] + (rest.choices[0].message.content or "") == whole


async def test_abort_mid_stream_frees_pages_and_is_counted(engine: RunningEngine) -> None:
    model = engine.engine
    baseline = model.kv.used_pages
    async with client(engine) as oai, aiohttp.ClientSession() as http:
        stream = await oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "go on forever"}],
            max_tokens=5000,
            stream=True,
            extra_body={"ignore_eos": True, "rid": "victim-0001"},
        )
        received, reasons = 0, []
        async for chunk in stream:
            for choice in chunk.choices:
                received += len(choice.delta.content or "")
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
            if received >= 20 and not reasons:
                rid = {"rid": "victim-0001"}
                async with http.post(f"{engine.url}/abort_request", json=rid) as r:
                    assert r.status == 200
        assert reasons == ["abort"]
        assert model.kv.used_pages == baseline
        model.check()
        async with http.get(f"{engine.url}/v1/loads") as r:
            loads = (await r.json())["loads"][0]
        async with http.get(f"{engine.url}/metrics") as r:
            metrics = await r.text()
    assert loads["num_running_reqs"] == 0
    assert loads["num_used_tokens"] == 0
    assert (
        'sglang:num_aborted_requests_total{engine_type="unified",'
        'model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0' in metrics
    )
    assert "sglang:num_running_reqs{" in metrics


async def test_client_disconnect_aborts_the_request(engine: RunningEngine) -> None:
    model = engine.engine
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            f"{engine.url}/generate",
            json={"text": "x", "stream": True, "rid": "gone-1",
                  "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}},
        )  # fmt: skip
        await resp.content.readline()
        resp.close()
    await until(lambda: not model.requests)
    assert not model.requests
    assert model.kv.used_pages == 0
    model.check()


async def test_streamed_text_stops_exactly_before_a_stop_string(engine: RunningEngine) -> None:
    async with client(engine) as oai:
        probe = await oai.completions.create(
            model="m", prompt="stop here", max_tokens=40, extra_body={"ignore_eos": True}
        )
        text = probe.choices[0].text
        stop = text[20:23]
        stream = await oai.completions.create(
            model="m", prompt="stop here", max_tokens=40, stop=[stop], stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
