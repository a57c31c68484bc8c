"""Bad input is refused with the right status and a reason, before any engine is reached,
and the router exports exactly the router's metric families."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.router import RequestLimits, RouterConfig, RunningRouter, TenantKeys, serve_router
from controlplane.telemetry.catalog import ROUTER

# Nothing listens here: every request in this file must be refused before routing.
NOWHERE = "http://127.0.0.1:9"


@pytest.fixture
async def router() -> AsyncIterator[RunningRouter]:
    running = await serve_router(
        RouterConfig(model="m", limits=RequestLimits(context_length=1000)),
        endpoints=[NOWHERE],
        keys=TenantKeys({"sk-a": "team-a"}),
    )
    yield running
    await running.close()


AUTH = {"Authorization": "Bearer sk-a"}
CHAT = "/v1/chat/completions"
OK_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "reason"),
    [
        (CHAT, b"{not json", AUTH, 400, "malformed_json"),
        (CHAT, b"[1, 2]", AUTH, 400, "malformed_json"),
        (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", AUTH, 400, "malformed_json"),
        (CHAT, b'{"model": "m"}', AUTH, 400, "missing_messages"),
        (CHAT, b'{"model": "m", "messages": []}', AUTH, 400, "missing_messages"),
        (CHAT, b'{"model": "m", "messages": [{"content": "x"}]}', AUTH, 400, "invalid_messages"),
        (CHAT, b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', AUTH,
         404, "unknown_model"),
        ("/v1/completions", b'{"model": "m"}', AUTH, 400, "missing_prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": ["a", "b"]}', AUTH, 400, "missing_prompt"),
        ("/generate", b'{"sampling_params": {}}', AUTH, 400, "missing_prompt"),
        ("/generate", b'{"input_ids": [1, -5]}', AUTH, 400, "invalid_prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 990 + b'", "max_tokens": 20}',
         AUTH, 400, "context_length_exceeded"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": -3}', AUTH, 400,
         "invalid_max_tokens"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": 1e9}', AUTH, 400,
         "invalid_max_tokens"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": 1e300}', AUTH, 400,
         "invalid_parameter"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "n": 4}', AUTH, 400,
         "invalid_parameter"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "stream": "yes"}', AUTH, 400,
         "invalid_stream"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "priority": 10000}', AUTH, 400,
         "invalid_priority"),
        ("/v1/completions", b'{"model": "m", "prompt": "x"}',
         {**AUTH, "x-weir-deadline-ms": "NaN"}, 400, "invalid_deadline"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "weir_deadline_ms": -1}', AUTH, 400,
         "invalid_deadline"),
        ("/v1/completions", b'{"model": "m", "prompt": [1, "a"]}', AUTH, 400, "invalid_prompt"),
        ("/generate", b'{"text": "x", "model": "other"}', AUTH, 404, "unknown_model"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
         AUTH, 400, "invalid_messages"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2}', AUTH,
         400, "invalid_parameter"),
        ("/generate", b'{"text": "x", "sampling_params": {"n": 2}}', AUTH, 400,
         "invalid_parameter"),
        ("/generate", b'{"text": "x", "lora_path": ["a"]}', AUTH, 400, "invalid_adapter"),
        ("/generate", b'{"text": "x", "lora_path": "no-such-lora"}', AUTH, 404, "unknown_adapter"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "lora_path": "x"}',
         AUTH, 404, "unknown_adapter"),
        (CHAT, b"{}", {}, 401, "missing_api_key"),
        (CHAT, b"{}", {"Authorization": "Bearer sk-wrong"}, 401, "invalid_api_key"),
    ],
)  # fmt: skip
async def test_bad_requests_are_refused_with_a_reason(
    router: RunningRouter,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    reason: str,
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + path, data=body, headers=headers) as reply,
    ):
        assert reply.status == status
        error = (await reply.json())["error"]
        assert error["reason"] == reason
        assert error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/generate", b'{"text": "x", "sampling_params": {"temperature": -1}}',
         "sampling_params.temperature"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": 1}',
         "stream"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', "model"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "lora_path": "nope"}', "lora_path"),
        ("/v1/completions", b"{not json", None),
    ],
)  # fmt: skip
async def test_a_refused_body_names_the_parameter_at_fault(
    router: RunningRouter, path: str, body: bytes, param: str | None
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + path, data=body, headers=AUTH) as reply,
    ):
        error = (await reply.json())["error"]
    assert error.get("param") == param
    if param is not None:
        assert param in error["message"]


async def test_an_unreachable_pool_is_an_overload_with_retry_after(
    router: RunningRouter,
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + CHAT, json=OK_CHAT, headers=AUTH) as reply,
    ):
        assert reply.status == 429
        assert int(reply.headers["Retry-After"]) >= 1
        assert (await reply.json())["error"]["type"] == "overload"


async def test_models_health_and_every_router_metric_family(router: RunningRouter) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(router.url + "/v1/models") as reply:
            assert [m["id"] for m in (await reply.json())["data"]] == ["m"]
        async with session.get(router.url + "/health") as reply:
            assert reply.status == 200
        async with session.get(router.url + "/ready") as reply:
            assert reply.status == 200
        async with session.post(router.url + CHAT, json=OK_CHAT, headers=AUTH) as reply:
            await reply.read()
        async with session.get(router.url + "/metrics") as reply:
            exposition = await reply.text()
    exported = {
        family.name
        for family in text_string_to_metric_families(exposition)
        if not family.name.endswith("_created")
    }
    assert exported == {spec.name.removesuffix("_total") for spec in ROUTER}
    assert 'weir_router_overloads_total{pool="default",reason="endpoints_overloaded"} 1.0' in (
        exposition
    )
