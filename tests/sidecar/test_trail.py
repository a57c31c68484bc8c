"""One request's story at a sidecar: its id taken from the router (or the client), carried
in its rid and answered with, and what the sidecar decided about it — admission and its
arithmetic, a preemption and why, the resumed admission, the end — served at
`/weir/v1/requests/{id}` behind the admin token, and logged as JSON when asked."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from opentelemetry import trace

from controlplane.trace.spans import outgoing
from controlplane.trace.trail import DECISIONS, Trail, carried_request_id, sidecar_rid
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import serve_engine
from tests.sidecar.conftest import engine_config, pool_policy
from tests.sidecar.streams import read_sse
from tests.spans import recorded_spans

TOKEN = "trail-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
LONG = {"text": "a long story", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}


@pytest.fixture
async def sidecar(request: pytest.FixtureRequest) -> AsyncIterator[RunningSidecar]:
    kv_tokens = getattr(request, "param", 8192)
    async with (
        serve_engine(engine_config(speed_factor=4.0, max_total_tokens=kv_tokens)) as engine,
        serve_sidecar(
            SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy(), admin_token=TOKEN)
        ) as running,
    ):
        yield running


async def _story(http: aiohttp.ClientSession, url: str, request_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/weir/v1/requests/{request_id}", headers=ADMIN) as reply:
        assert reply.status == 200, await reply.text()
        story: dict[str, Any] = await reply.json()
        return story


async def test_a_preempted_request_s_story_names_each_decision_and_why(
    sidecar: RunningSidecar,
) -> None:
    url = sidecar.url
    async with aiohttp.ClientSession() as http:
        headers = {"x-weir-request-id": "chat-42"}
        async with http.post(url + "/generate", json=LONG | {"stream": True}, headers=headers) as r:
            assert r.headers["x-request-id"] == "chat-42"
            rid = r.headers["x-weir-request-id"]
            assert rid.startswith("chat-42@")
            await read_sse(r, stop_after=10)
            async with http.post(
                url + "/weir/v1/preempt", json={"rid": rid, "mode": "recompute"}, headers=ADMIN
            ) as answer:
                assert answer.status == 200
            rest = await read_sse(r)
        assert rest.done
        story = await _story(http, url, "chat-42")
        async with http.get(url + "/weir/v1/requests/chat-42") as unauthorized:
            assert unauthorized.status == 401
        async with http.get(url + "/weir/v1/requests/nobody", headers=ADMIN) as unknown:
            assert unknown.status == 404
    assert story["request_id"] == "chat-42"
    events = story["events"]
    assert [e["event"] for e in events] == ["admitted", "preempt", "admitted", "end"]
    first, preempt, again, end = events
    assert first["first_verdict"] == "admit"
    assert first["needed_tokens"] <= first["available_tokens"]
    assert (preempt["mode"], preempt["why"]) == ("recompute", "ordered through /weir/v1/preempt")
    assert 0 < preempt["generated_tokens"] < 200
    assert again["first_verdict"] == "admit"
    assert (end["reason"], end["generated_tokens"], end["preemptions"]) == ("length", 200, 1)
    assert {e["rid"] for e in events} == {rid}
    assert all(e["hop"] == f"sidecar/{sidecar.service.metrics.endpoint}" for e in events)


@pytest.mark.parametrize("sidecar", [1024], indirect=True)  # KV smaller than the context
async def test_a_refusal_is_recorded_with_its_arithmetic(sidecar: RunningSidecar) -> None:
    huge = {"text": "x" * 2000, "sampling_params": {"max_new_tokens": 100}}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            sidecar.url + "/generate", json=huge, headers={"x-request-id": "too big"}
        ) as r:
            assert r.status == 400
            request_id = r.headers["x-request-id"]  # not one Weir carries: a fresh one
        assert request_id != "too big"
        story = await _story(http, sidecar.url, request_id)
    refused, end = story["events"]
    assert (refused["event"], refused["reason"]) == ("refused", "too_large")
    assert refused["needed_tokens"] > refused["available_tokens"]
    assert (end["event"], end["state"]) == ("end", "rejected")


def test_decisions_log_as_json_lines_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    trail = Trail("router", clock=lambda: 12.5)
    trail.record("quiet", "routed", endpoint="e1")  # the logger is off: nothing logged
    assert caplog.records == []
    with caplog.at_level(logging.DEBUG, logger=DECISIONS.name):
        assert trail.detailed
        trail.record("r1", "routed", endpoint="e1", scores={"e1": 0.5})
    (line,) = [json.loads(r.getMessage()) for r in caplog.records]
    assert line == {"request_id": "r1", "at": 12.5, "hop": "router", "event": "routed",
                    "endpoint": "e1", "scores": {"e1": 0.5}}  # fmt: skip


def test_the_trail_is_bounded() -> None:
    trail = Trail("sidecar/e0", max_requests=2, max_events=2)
    for request_id in ("a", "b", "c"):
        for n in range(3):
            trail.record(request_id, "step", n=n)
    assert trail.story("a") is None  # the oldest request is forgotten
    story = trail.story("c")
    assert story is not None
    assert [e["n"] for e in story["events"]] == [0, 1]
    assert story["events_dropped"] == 1


@pytest.mark.parametrize(
    ("given", "kept"),
    [("abc-123", True), ("A.b:c_d-9", True), ("x" * 64, True), ("x" * 65, False),
     ("has space", False), ("a@b", False), ("", False), (None, False), ("é", False)],
)  # fmt: skip
def test_a_request_id_is_kept_only_when_it_can_be_carried(given: str | None, kept: bool) -> None:
    carried = carried_request_id(given)
    assert (carried == given) == kept
    assert len(carried) <= 64


def test_no_sidecar_rid_is_a_prefix_of_another() -> None:
    """SGLang aborts by rid prefix: ids that prefix one another must not give rids that do."""
    rids = [sidecar_rid(i) for i in ("a", "ab", "a.b", "a@", "a") if i == carried_request_id(i)]
    engine_rids = [f"{r}s{n:03d}" for r in rids for n in (0, 1)]
    for one in engine_rids:
        assert [other for other in engine_rids if other.startswith(one)] == [one]


async def test_spans_follow_a_request_from_its_caller_to_each_engine_segment(
    sidecar: RunningSidecar,
) -> None:
    """The caller's trace continues at the sidecar: a server span for the request, one
    client span per engine segment (two here: preempted and recomputed in place)."""
    tracer = trace.get_tracer("test")
    with recorded_spans() as exporter:
        with tracer.start_as_current_span("caller") as caller:
            headers = outgoing({"x-weir-request-id": "traced-1"})
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                sidecar.url + "/generate", json=LONG | {"stream": True}, headers=headers
            ) as r,
        ):
            rid = r.headers["x-weir-request-id"]
            await read_sse(r, stop_after=10)
            async with http.post(
                sidecar.url + "/weir/v1/preempt",
                json={"rid": rid, "mode": "recompute"},
                headers=ADMIN,
            ) as answer:
                assert answer.status == 200
            assert (await read_sse(r)).done
        spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "caller"}
        segments = [s for s in exporter.get_finished_spans() if s.name == "weir.sidecar.engine"]
    request = spans["weir.sidecar.request"]
    trace_id = caller.get_span_context().trace_id
    assert request.context.trace_id == trace_id
    assert request.parent.span_id == caller.get_span_context().span_id
    assert request.attributes["weir.request_id"] == "traced-1"
    assert [s.attributes["weir.engine_rid"] for s in segments] == [f"{rid}s000", f"{rid}s001"]
    assert all(s.parent.span_id == request.context.span_id for s in segments)
