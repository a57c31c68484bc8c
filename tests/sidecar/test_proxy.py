"""The sidecar as a proxy in front of a real reference engine, over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import pytest

from controlplane.contract import Continuation, EngineAPI, encode_json
from controlplane.telemetry.catalog import SIDECAR
from engine_sidecar.policy import AdmissionVerdict
from engine_sidecar.policy.admission import ALONE
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine, serve_engine
from tests.polling import until
from tests.sidecar.conftest import MODEL, engine_config, pool_policy


async def sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """The JSON events of a stream (stops at [DONE])."""
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            events.append(msgspec.json.decode(data))
    return events


def generate_body(max_new: int = 40, text: str = "the quick brown fox") -> dict[str, Any]:
    return {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "stream": True,
    }


async def test_generate_stream_is_the_engines_own(
    engine: RunningEngine, sidecar: RunningSidecar
) -> None:
    async with aiohttp.ClientSession() as http:
        outputs = []
        for url in (engine.url, sidecar.url):
            async with http.post(url + "/generate", json=generate_body()) as resp:
                assert resp.status == 200
                events = await sse(resp)
            outputs.append((events[-1]["text"], events[-1]["meta_info"]["finish_reason"]))
        assert outputs[0] == outputs[1]
        assert outputs[1][1]["type"] == "length"
        async with http.get(sidecar.url + "/weir/v1/state") as resp:
            state = await resp.json()
    assert state["requests"] == {}
    assert state["own_used_tokens"] == 0
    assert state["reserved_growth_tokens"] == 0


async def test_a_client_that_reads_slowly_gets_every_token(
    engine: RunningEngine, sidecar: RunningSidecar
) -> None:
    """A client that stops reading fills the sidecar's socket buffers: the sidecar stops
    reading the engine meanwhile, and loses, repeats or reorders nothing."""
    body = generate_body(max_new=1500)
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + "/generate", json=body) as resp:
            direct = await sse(resp)
        async with (
            aiohttp.ClientSession(read_bufsize=1024) as slow,
            slow.post(sidecar.url + "/generate", json=body) as resp,
        ):
            assert resp.status == 200
            await asyncio.sleep(1.0)  # the engine finishes meanwhile: megabytes wait
            lines = (await resp.read()).split(b"\n\n")
    relayed = [msgspec.json.decode(line[6:]) for line in lines if line[6:7] == b"{"]
    assert lines[-2:] == [b"data: [DONE]", b""]
    counts = [e["meta_info"]["completion_tokens"] for e in relayed]
    assert counts == [e["meta_info"]["completion_tokens"] for e in direct]
    assert counts[-1] == 1500
    assert relayed[-1]["text"] == direct[-1]["text"]
    assert relayed[-1]["output_ids"] == direct[-1]["output_ids"]
    assert relayed[-1]["meta_info"]["finish_reason"]["type"] == "length"
    await sidecar.service.settled()
    assert sidecar.service.ledger.flights == {}


async def test_a_client_that_stops_reading_then_leaves_is_cancelled(
    engine: RunningEngine, sidecar: RunningSidecar
) -> None:
    """The sidecar waits on a stalled client without reading the engine; when the client
    goes, the request is aborted in the engine and its KV freed like any cancel."""
    idle_used = engine.engine.loads().num_used_tokens
    async with aiohttp.ClientSession(read_bufsize=1024) as slow:
        resp = await slow.post(sidecar.url + "/generate", json=generate_body(max_new=3500))
        assert resp.status == 200
        await asyncio.sleep(1.0)  # buffers fill: engine, sidecar and client all wait
        assert engine.engine.loads().num_running_reqs == 1
        resp.close()
    assert await sidecar.service.ledger.wait_idle(10.0)
    assert sidecar.service.ledger.own_used == 0
    loads = engine.engine.loads()
    assert (loads.num_running_reqs, loads.num_used_tokens) == (0, idle_used)


async def test_an_http_1_0_client_gets_the_stream_unchunked(sidecar: RunningSidecar) -> None:
    """No chunked coding for HTTP/1.0: the relay's own writes go out unframed, and the
    connection's end ends the body."""
    host, port = sidecar.url.removeprefix("http://").split(":")
    body = msgspec.json.encode(generate_body(max_new=30))
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /generate HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, stream = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    frames = stream.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    counts = [msgspec.json.decode(f[6:])["meta_info"]["completion_tokens"] for f in frames[:-2]]
    assert counts[-1] == 30
    assert counts == sorted(counts)


async def test_openai_routes_stream_and_answer(sidecar: RunningSidecar) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    completion = {"model": MODEL, "prompt": "once upon", "max_tokens": 12}
    async with aiohttp.ClientSession() as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            headers = {"x-request-id": f"client-{len(path)}"}
            async with http.post(
                sidecar.url + path, json=body | {"stream": True}, headers=headers
            ) as resp:
                assert resp.status == 200
                # Its rid starts with the client's request id, which it answers with.
                assert resp.headers["x-request-id"] == headers["x-request-id"]
                assert resp.headers["x-weir-request-id"].startswith(headers["x-request-id"] + "@")
                events = await sse(resp)
            streamed = "".join(
                (e["choices"][0].get("delta") or {}).get("content")
                or e["choices"][0].get("text")
                or ""
                for e in events
                if e.get("choices")
            )
            async with http.post(sidecar.url + path, json=body) as resp:
                assert resp.status == 200
                whole = await resp.json()
            choice = whole["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert streamed == text
            assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
        async with http.get(sidecar.url + "/v1/models") as resp:
            models = await resp.json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert sidecar.service.ledger.own_used == 0


@pytest.mark.parametrize(
    ("path", "raw", "status", "kind"),
    [
        ("/generate", b"{not json", 400, "invalid_request"),
        ("/generate", b"[1, 2]", 400, "invalid_request"),
        ("/generate", b'{"sampling_params": {"max_new_tokens": 5}}', 400, "invalid_request"),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}',
            400,
            "invalid_request",
        ),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"max_new_tokens": 1e30}}',
            400,
            "invalid_request",
        ),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"temperature": 1e999}}',
            400,
            "invalid_request",
        ),
        ("/generate", b'{"input_ids": [1, -3]}', 400, "invalid_request"),
        (
            "/generate",
            b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4095}}',
            400,
            "invalid_request",
        ),
        ("/generate", b'{"text": "x", "priority": "high"}', 400, "invalid_request"),
        (
            "/v1/chat/completions",
            b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "weir/test-model", "messages": []}',
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "weir/test-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            400,
            "invalid_request",
        ),
        (
            "/v1/completions",
            b'{"model": "weir/test-model", "prompt": "x", "n": 3}',
            400,
            "invalid_request",
        ),
        ("/v1/completions", b'{"prompt": "x"}', 400, "invalid_request"),
        ("/weir/v1/continue", b'{"request_id": "r"}', 400, "invalid_request"),
    ],
)
async def test_bad_input_is_refused_and_nothing_is_reserved(
    engine: RunningEngine, sidecar: RunningSidecar, path: str, raw: bytes, status: int, kind: str
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            sidecar.url + path, data=raw, headers={"content-type": "application/json"}
        ) as resp,
    ):
        assert resp.status == status
        body = await resp.json()
    assert body["error"]["type"] == kind
    assert body["error"]["message"]
    ledger = sidecar.service.ledger
    assert (ledger.flights, ledger.own_used, ledger.reserved, ledger.queued) == ({}, 0, 0, 0)
    assert engine.engine.loads().num_running_reqs == 0


async def test_hostile_tenant_header_is_refused(sidecar: RunningSidecar) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            sidecar.url + "/generate", json=generate_body(), headers={"x-weir-tenant": "a b/../c"}
        ) as resp,
    ):
        assert resp.status == 400
    assert sidecar.service.ledger.flights == {}


async def test_every_catalogued_family_is_exported(sidecar: RunningSidecar) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(sidecar.url + "/generate", json=generate_body(8)) as resp:
            await sse(resp)
        async with http.get(sidecar.url + "/metrics") as resp:
            text = await resp.text()
    for spec in SIDECAR:
        declared = (f"# TYPE {spec.name} {spec.kind}", f"# TYPE {spec.name[:-6]} {spec.kind}")
        assert any(d in text for d in declared), spec.name
    assert "weir_sidecar_requests_finished_total{endpoint=" in text
    assert 'reason="length"' in text


async def test_event_series_exist_before_their_first_event(sidecar: RunningSidecar) -> None:
    """Dashboards show zero, not "no data": refusal and preemption series start at zero,
    and a tenant's active-sequence series stays (at zero) after its request ended."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            sidecar.url + "/generate", json=generate_body(4), headers={"x-weir-tenant": "quiet"}
        ) as resp:
            await sse(resp)
        async with http.get(sidecar.url + "/metrics") as resp:
            text = await resp.text()
    lines = text.splitlines()

    def value(name: str, label: str) -> float:
        [line] = [x for x in lines if x.startswith(name + "{") and label in x]
        return float(line.rsplit(" ", 1)[1])

    assert value("weir_sidecar_admission_rejections_total", 'reason="queue_full"') == 0
    assert value("weir_sidecar_preemptions_total", 'mode="migrate"') == 0
    assert value("weir_sidecar_active_sequences", 'tenant="quiet"') == 0


async def test_a_prompt_that_can_never_fit_is_a_client_error_a_continuation_stays_overload() -> (
    None
):
    """A prompt larger than the engine's whole KV (here 1,000 tokens, under a 4,096-token
    context) is refused with 400 and the sizes, without Retry-After: retrying cannot help.
    The same prompt arriving as a continuation of an accepted stream keeps the retryable
    429, for the router to place elsewhere."""
    prompt = [7] * 2000
    cont = Continuation(
        request_id="r-too-large", model=MODEL, api=EngineAPI.GENERATE,
        body={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}},
        prompt_ids=tuple(prompt), generated_ids=(8, 9), max_new_tokens=8,
    )  # fmt: skip
    async with (
        serve_engine(engine_config(max_total_tokens=1000)) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy())) as sc,
        aiohttp.ClientSession() as http,
    ):
        for stream in (True, False):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}, "stream": stream}
            async with http.post(sc.url + "/generate", json=body) as resp:
                assert resp.status == 400
                assert "Retry-After" not in resp.headers
                error = (await resp.json())["error"]
            assert (error["type"], error["reason"]) == ("invalid_request", "too_large")
            assert "2000 tokens" in error["message"]
            assert "1000" in error["message"]  # the endpoint's capacity
        async with http.post(sc.url + "/weir/v1/continue", data=encode_json(cont)) as resp:
            assert resp.status == 429
            assert int(resp.headers["Retry-After"]) >= 1
            error = (await resp.json())["error"]
        assert (error["type"], error["reason"]) == ("overload", "too_large")
        metrics = sc.service.metrics
        labels = {"pool": "p", "endpoint": metrics.endpoint}
        finished = metrics.registry.get_sample_value
        assert finished("weir_sidecar_requests_finished_total", {**labels, "reason": "error"}) == 2
        assert (
            finished("weir_sidecar_requests_finished_total", {**labels, "reason": "overload"}) == 1
        )
        ledger = sc.service.ledger
        assert (ledger.flights, ledger.own_used, ledger.reserved) == ({}, 0, 0)
        assert engine.engine.loads().num_running_reqs == 0


async def test_a_prompt_past_the_margin_that_the_kv_holds_runs_alone_with_exact_tokens() -> None:
    """A 950-token prompt on a 1,000-token KV: past capacity minus the emergency band
    (950), within the whole KV with its 8-token limit and a page. The sidecar does not
    refuse it as too_large: it waits while another request runs, is admitted once that
    one has left, and streams exactly what the engine answers it directly."""
    big = {
        "input_ids": [7] * 950,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
        "stream": True,
    }
    small = {
        "input_ids": [5] * 100,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        "stream": True,
    }
    # At 4x real time the small request decodes for a second or so: the big one comes
    # while it runs.
    async with (
        serve_engine(engine_config(max_total_tokens=1000, speed_factor=4.0)) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy())) as sc,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(engine.url + "/generate", json=big) as resp:
            assert resp.status == 200
            direct = (await sse(resp))[-1]
        ledger, order = sc.service.ledger, []

        async def send(name: str, body: dict[str, Any]) -> dict[str, Any]:
            async with http.post(sc.url + "/generate", json=body) as resp:
                assert resp.status == 200
                events = await sse(resp)
            order.append(name)
            return events[-1]

        def waits_alone() -> bool:
            return any(
                f.admission is not None
                and (f.admission.verdict, f.admission.reason) == (AdmissionVerdict.WAIT, ALONE)
                for f in ledger.flights.values()
            )

        ahead = asyncio.create_task(send("small", small))
        await until(lambda: ledger.flights, "the small request admitted", every_s=0.001)
        behind = asyncio.create_task(send("big", big))
        await until(waits_alone, "the big request waiting to run alone", every_s=0.001)
        alone = await behind
        await ahead
        assert order == ["small", "big"]
        assert alone["output_ids"] == direct["output_ids"]
        assert len(alone["output_ids"]) == 8
        assert alone["meta_info"]["finish_reason"]["type"] == "length"
        assert (ledger.flights, ledger.own_used, ledger.reserved) == ({}, 0, 0)
