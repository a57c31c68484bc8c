"""The sidecar's intake: its own reading of a checked body (prompt bound, output limit,
priority, what can be recomputed), and the same refusals as the router's for the same bad
bodies, in process over every rule and over real HTTP through a router, a sidecar and a
reference engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from controlplane.contract import Continuation, EngineAPI
from controlplane.router import (
    RequestLimits,
    RouterConfig,
    RouterError,
    RunningRouter,
    serve_router,
)
from controlplane.router.requests import parse_client_request
from engine_sidecar.intake import (
    IntakeLimits,
    RequestError,
    from_continuation,
    parse_intake,
    parse_json,
)
from engine_sidecar.server import RunningSidecar
from fleetsim.server import RunningEngine
from tests.controlplane.test_request_checks import CONTEXT, REFUSED
from tests.sidecar.conftest import MODEL

GEN, CMP, CHAT = EngineAPI.GENERATE, EngineAPI.COMPLETIONS, EngineAPI.CHAT
LIMITS = IntakeLimits("m", CONTEXT)


def _refusal(api: EngineAPI, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_intake(api, body, LIMITS)
    return caught.value


@pytest.mark.parametrize(("api", "body", "status", "reason", "param"), REFUSED)
def test_sidecar_and_router_refuse_every_rule_alike(
    api: EngineAPI, body: dict[str, Any], status: int, reason: str, param: str | None
) -> None:
    sidecar = _refusal(api, body)
    with pytest.raises(RouterError) as caught:
        parse_client_request(
            api, body, {}, models=frozenset({"m"}), default_model="m",
            limits=RequestLimits(CONTEXT, 1.0),
        )  # fmt: skip
    router = caught.value
    assert (sidecar.status, sidecar.reason, sidecar.param) == (status, reason, param)
    assert (router.status, router.reason, router.param) == (status, reason, param)
    assert str(sidecar) == router.message
    assert sidecar.kind == ("model_not_found" if status == 404 else "invalid_request")
    assert router.error_type == ("not_found_error" if status == 404 else "invalid_request_error")


def test_a_body_that_is_not_a_json_object_is_refused() -> None:
    for raw in (b"{not json", b"[1]", b"null", b"[" * 1000 + b"]" * 1000):
        with pytest.raises(RequestError) as caught:
            parse_json(raw)
        assert (caught.value.status, caught.value.reason) == (400, "malformed_json")


def test_the_prompt_bound_the_output_limit_and_the_fields_the_sidecar_sets_itself() -> None:
    chat = parse_intake(
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "priority": 5,
         "rid": "client", "stream": True},
        LIMITS,
    )  # fmt: skip
    # "user\nhéllo\n" is 12 bytes, and each message adds its template tokens.
    assert (chat.prompt_tokens, chat.max_new_tokens) == (12 + 8, CONTEXT - 20)
    assert (chat.priority, chat.stream) == (5, True)
    assert chat.body == {"model": "m", "messages": [{"role": "user", "content": "héllo"}]}
    assert parse_intake(GEN, {"text": "abc"}, LIMITS).max_new_tokens == 128
    assert parse_intake(CMP, {"model": "m", "prompt": ["abc"]}, LIMITS).body["prompt"] == "abc"
    by_ids = parse_intake(CMP, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}, LIMITS)
    assert (by_ids.prompt_tokens, by_ids.prompt_ids, by_ids.recomputable) == (3, (1, 2, 3), False)
    assert parse_intake(GEN, {"input_ids": [1, 2]}, LIMITS).recomputable


def test_only_an_exact_prompt_count_is_held_against_the_context() -> None:
    # Bytes bound the tokens of a text prompt from above: the engine decides.
    text = parse_intake(
        GEN, {"text": "x" * CONTEXT, "sampling_params": {"max_new_tokens": 5}}, LIMITS
    )
    assert (text.prompt_tokens, text.max_new_tokens) == (CONTEXT, 5)
    refused = _refusal(
        GEN, {"input_ids": [1] * (CONTEXT - 4), "sampling_params": {"max_new_tokens": 5}}
    )
    assert (refused.status, refused.reason, refused.param) == (
        400,
        "context_length_exceeded",
        "input_ids",
    )


def test_a_continuation_for_another_model_or_with_nothing_left_is_refused() -> None:
    body: dict[str, object] = {"text": "ab", "sampling_params": {"max_new_tokens": 4}}
    elsewhere = Continuation(request_id="r", model="other", api=GEN, body=body, max_new_tokens=4)
    done = Continuation(
        request_id="r", model="m", api=GEN, body=body, generated_ids=(1, 2, 3, 4),
        max_new_tokens=4,
    )  # fmt: skip
    for cont, status, reason in (
        (elsewhere, 404, "unknown_model"),
        (done, 400, "invalid_continuation"),
    ):
        with pytest.raises(RequestError) as caught:
            from_continuation(cont, LIMITS)
        assert (caught.value.status, caught.value.reason) == (status, reason)
    resumed = from_continuation(
        Continuation(request_id="r", model="m", api=GEN, body=body, generated_ids=(7,),
                     max_new_tokens=4),
        LIMITS,
    )  # fmt: skip
    assert (resumed.prompt_tokens, resumed.max_new_tokens, resumed.stream) == (3, 3, True)


# -- over real HTTP: a router in front of a sidecar in front of a reference engine -------

CONTEXT_LENGTH = 4096  # the sidecar fixture's pool policy and engine
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
PROMPT_BODY = {"model": MODEL, "prompt": "x"}
# Bad bodies per path, as raw bytes or as an object to encode: (body, status, reason).
BAD_BODIES: dict[str, list[tuple[bytes | dict[str, Any], int, str]]] = {
    "/generate": [
        (b"{not json", 400, "malformed_json"),
        (b"[1, 2]", 400, "malformed_json"),
        (b'{"text": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "malformed_json"),
        ({"sampling_params": {"max_new_tokens": 5}}, 400, "missing_prompt"),
        ({"text": "x", "stream": "yes"}, 400, "invalid_stream"),
        ({"text": "x", "model": "other"}, 404, "unknown_model"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 1e30}}, 400, "invalid_max_tokens"),
        ({"text": "x", "sampling_params": {"temperature": 3}}, 400, "invalid_parameter"),
        ({"text": "x", "sampling_params": {"n": 2}}, 400, "invalid_parameter"),
        ({"input_ids": [1, -3]}, 400, "invalid_prompt"),
        ({"input_ids": [1, 2**31]}, 400, "invalid_prompt"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT_LENGTH - 1}}, 400,
         "context_length_exceeded"),
        ({"text": "x", "priority": "high"}, 400, "invalid_priority"),
        ({"text": "x", "priority": 5000}, 400, "invalid_priority"),
        ({"text": "x", "lora_path": 1}, 400, "invalid_adapter"),
    ],
    "/v1/chat/completions": [
        ({**CHAT_BODY, "model": "other"}, 404, "unknown_model"),
        ({**CHAT_BODY, "messages": []}, 400, "missing_messages"),
        ({**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "invalid_messages"),
        ({**CHAT_BODY, "max_tokens": "9"}, 400, "invalid_max_tokens"),
        (msgspec.json.encode(CHAT_BODY)[:-1] + b', "top_p": NaN}', 400, "malformed_json"),
    ],
    "/v1/completions": [
        ({"prompt": "x"}, 400, "missing_model"),
        ({**PROMPT_BODY, "prompt": ["a", "b"]}, 400, "missing_prompt"),
        ({**PROMPT_BODY, "n": 3}, 400, "invalid_parameter"),
        ({**PROMPT_BODY, "presence_penalty": -9}, 400, "invalid_parameter"),
        ({**PROMPT_BODY, "prompt": [5, 6], "max_tokens": CONTEXT_LENGTH - 1}, 400,
         "context_length_exceeded"),
    ],
}  # fmt: skip


@pytest.fixture
async def router(sidecar: RunningSidecar) -> AsyncIterator[RunningRouter]:
    running = await serve_router(
        RouterConfig(model=MODEL, limits=RequestLimits(CONTEXT_LENGTH, 1.0)),
        endpoints=[sidecar.url],
    )
    yield running
    await running.close()


async def _post(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=raw, headers={"content-type": "application/json"}) as resp:
        return resp.status, msgspec.json.decode(await resp.read())


async def test_router_and_sidecar_answer_the_same_bad_bodies_alike_and_admit_nothing(
    engine: RunningEngine, sidecar: RunningSidecar, router: RunningRouter
) -> None:
    async with aiohttp.ClientSession() as http:
        for path, body, status, reason in (
            (path, *case) for path, cases in BAD_BODIES.items() for case in cases
        ):
            raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
            router_status, router_body = await _post(http, router.url + path, raw)
            sidecar_status, sidecar_body = await _post(http, sidecar.url + path, raw)
            at_router, at_sidecar = router_body["error"], sidecar_body["error"]
            case = (path, body)
            assert (router_status, at_router["reason"]) == (status, reason), case
            assert sidecar_status == status, case
            # One checker wrote both: the same rule fired, naming the same parameter.
            assert at_sidecar["message"] == at_router["message"], case
            assert at_sidecar["type"] == ("model_not_found" if status == 404 else "invalid_request")
            assert at_sidecar["reason"] == reason, case
            assert at_sidecar.get("param") == at_router.get("param"), case
        ledger = sidecar.service.ledger
        assert (ledger.flights, ledger.own_used, ledger.reserved, ledger.queued) == ({}, 0, 0, 0)
        assert engine.engine.requests_total == 0
        # The same path serves a good body, so the refusals above were the checks' own.
        status, body = await _post(
            http,
            router.url + "/v1/chat/completions",
            msgspec.json.encode({**CHAT_BODY, "max_tokens": 3}),
        )
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length"
    assert engine.engine.requests_total == 1
