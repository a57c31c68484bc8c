"""One request, one story, at run time: the router's and the sidecars' records of a
request (its route and why, each attempt, a migration and the resume, the end), joined by
the request id the client gave, served by the router at `GET /weir/v1/requests/{id}`
behind the admin token; a refusal that names the sidecar's reason; and one trace of spans
across router and sidecars."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from controlplane.trace.trail import DECISIONS
from tests.router.live_fleet import Stream, live_fleet, read_stream, request_body
from tests.spans import recorded_spans

pytestmark = [pytest.mark.redis]
TOKEN = "trail-admin-token-router-0123"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def _story(session: aiohttp.ClientSession, url: str, request_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/weir/v1/requests/{request_id}", headers=ADMIN) as reply:
        assert reply.status == 200, await reply.text()
        story: dict[str, Any] = await reply.json()
        return story


def _events(story: dict[str, Any]) -> list[str]:
    return [e["event"] for e in story["events"]]


async def test_a_migrated_request_s_story_spans_the_router_and_both_sidecars(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        live_fleet(redis_url, kv_tokens=20_000, admin_token=TOKEN) as fleet,
        aiohttp.ClientSession() as session,
    ):
        caplog.set_level(logging.DEBUG, logger=DECISIONS.name)  # --log-decisions
        url = fleet.router.url
        with recorded_spans() as exporter:
            out = Stream()
            streaming = asyncio.create_task(
                read_stream(session, url, request_body(1, 400), out, {"x-request-id": "story-1"})
            )
            await asyncio.wait_for(out.progress.wait(), 30)
            first = fleet.sidecars[out.endpoint]
            (rid,) = list(first.service.ledger.flights)
            async with session.post(
                first.url + "/weir/v1/preempt", json={"rid": rid, "mode": "migrate"}, headers=ADMIN
            ) as ordered:
                assert ordered.status == 200
            await asyncio.wait_for(streaming, 60)
            spans = exporter.get_finished_spans()
        assert (out.error, out.finish, out.request_id) == (None, "length", "story-1")
        story = await _story(session, url, "story-1")
        async with session.get(url + "/weir/v1/requests/story-1") as unauthorized:
            assert unauthorized.status == 401

    # Which endpoint got it, and why; where it went after the migration, and why.
    router = story["events"]
    assert _events(story) == [
        "received", "route", "attempt", "resume", "route_resume", "attempt", "end",
    ]  # fmt: skip
    received, route, migrated, resume, rerouted, resumed, end = router
    assert received["tenant"] == "default"
    assert route["endpoint"] == out.endpoint
    assert route["reason"] in ("primary_owner", "secondary_owner", "least_cost")
    assert route["owner_hit"] == (route["endpoint"] in route["owners"])
    # With decision logs on, every candidate's total and each scorer's term of it.
    scorers = [ws.scorer.name for ws in fleet.router.router.profile.scorers]
    assert out.endpoint in route["candidates"]
    for candidate in route["candidates"].values():
        assert list(candidate["terms"]) == scorers
        assert sum(candidate["terms"].values()) == pytest.approx(candidate["total"], abs=1e-3)
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == DECISIONS.name]
    assert route in [{k: v for k, v in line.items() if k != "request_id"} for line in logged]
    assert (migrated["outcome"], resume["cause"]) == ("preempted", "preempted")
    second = rerouted["endpoint"]
    assert second not in (None, out.endpoint)
    assert (resumed["endpoint"], resumed["outcome"]) == (second, "done")
    assert (end["finish"], end["output_tokens"]) == ("length", 400)
    # Why it was preempted, from the sidecar that did it; and its resume at the other.
    sidecars = story["endpoints"]
    assert set(sidecars) == {out.endpoint, second}
    before = sidecars[out.endpoint]["events"]
    assert [e["event"] for e in before] == ["admitted", "preempt", "handed_back", "end"]
    # Ordered, and room held for it at the other first (as relief's migrations do).
    assert before[1]["mode"] == "migrate"
    assert before[1]["why"].startswith(f"ordered through /weir/v1/preempt; {second} holds ")
    after = sidecars[second]["events"]
    assert [e["event"] for e in after] == [
        "reservation_taken", "continuation", "reservation_consumed", "admitted", "end",
    ]  # fmt: skip
    assert rerouted["reason"] == "reserved_target"
    assert after[-1]["reason"] == "length"
    held = [e for e in after if e["event"].startswith("reservation_")]
    assert all(e["reservation"] and e["tokens"] > 0 for e in held)
    assert all(e["rid"].startswith("story-1@") for e in before + after if e not in held)
    # One trace: the router's request, its two attempts, each sidecar's request under one.
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (request,) = by_name["weir.router.request"]
    attempts = by_name["weir.router.attempt"]
    served = by_name["weir.sidecar.request"]
    assert len(attempts) == len(served) == 2
    assert request.attributes["weir.request_id"] == "story-1"
    assert {s.context.trace_id for s in spans if s.name.startswith("weir.")} == {
        request.context.trace_id
    }
    assert {a.parent.span_id for a in attempts} == {request.context.span_id}
    assert {s.parent.span_id for s in served} == {a.context.span_id for a in attempts}
    assert {a.attributes["weir.endpoint"] for a in attempts} == {out.endpoint, second}


async def test_a_refusal_names_the_request_and_the_sidecars_reason(redis_url: str) -> None:
    async with (
        live_fleet(redis_url, admin_token=TOKEN) as fleet,
        aiohttp.ClientSession() as session,
    ):
        for sidecar in fleet.sidecars.values():
            sidecar.service.draining = True  # refuses (429 draining), still routed to
        refused = await read_stream(session, fleet.router.url, request_body(2, 10))
        assert refused.error is not None
        assert refused.error["status"] == 429
        story = await _story(session, fleet.router.url, refused.request_id)
    error = json.loads(str(refused.error["body"]))["error"]
    assert error["reason"] == "endpoints_overloaded"
    assert error["request_id"] == refused.request_id
    assert error["upstream_reason"].endswith(": draining")
    assert _events(story)[-2:] == ["refused", "end"]
    attempts = [e for e in story["events"] if e["event"] == "attempt"]
    assert {a["outcome"] for a in attempts} == {"refused"}
    assert all(a["refusal"].endswith(": draining") for a in attempts)
