"""The sidecar's admin routes behind its admin token, against a real served sidecar."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest

from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.server import RunningEngine
from tests.sidecar.conftest import pool_policy

TOKEN = "s3cret-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture
async def guarded(engine: RunningEngine) -> AsyncIterator[RunningSidecar]:
    config = SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy(), admin_token=TOKEN)
    async with serve_sidecar(config) as running:
        yield running


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing_admin_token"),
        ({"Authorization": "Bearer wrong-token"}, "invalid_admin_token"),
        ({"Authorization": f"Bearer {TOKEN}x"}, "invalid_admin_token"),
        ({"Authorization": f"Basic {TOKEN}"}, "invalid_admin_token"),
        ({"Authorization": "Bearer"}, "invalid_admin_token"),
    ],
)
async def test_admin_routes_refuse_without_the_token(
    guarded: RunningSidecar, headers: dict[str, str], reason: str
) -> None:
    async with aiohttp.ClientSession() as http:
        for method, path, body in (
            ("GET", "/weir/v1/state", None),
            ("GET", "/weir/v1/requests/r1", None),
            ("POST", "/weir/v1/preempt", {"rid": "weirx", "mode": "terminate"}),
            ("POST", "/weir/v1/drain", {"deadline_s": 0}),
            ("POST", "/weir/v1/reserve", {"request_id": "r1", "tokens": 10, "ttl_s": 1}),
        ):
            async with http.request(method, guarded.url + path, json=body, headers=headers) as r:
                assert r.status == 401, path
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                error = (await r.json())["error"]
            assert (error["type"], error["reason"]) == ("unauthorized", reason)
            assert TOKEN not in error["message"]
    assert not guarded.service.draining  # the refused drain did nothing
    assert guarded.service.ledger.held_tokens == 0  # nor the refused reservation


async def test_admin_routes_answer_with_the_token_and_the_rest_stays_open(
    guarded: RunningSidecar,
) -> None:
    url = guarded.url
    async with aiohttp.ClientSession() as http:
        # The routes clients, probes, scrapers and routers use need no token.
        async with http.post(url + "/generate", json=GENERATE) as r:
            assert r.status == 200
        for path in ("/health", "/metrics", "/v1/models"):
            async with http.get(url + path) as r:
                assert r.status == 200, path
        async with http.post(url + "/abort_request", json={"rid": "nothing"}) as r:
            assert r.status == 200
        async with http.post(url + "/weir/v1/continue", json={"request_id": "r"}) as r:
            assert r.status == 400  # reached its handler: a malformed continuation
        # The admin routes with it.
        async with http.get(url + "/weir/v1/state", headers=ADMIN) as r:
            assert r.status == 200
            assert (await r.json())["requests"] == {}
        lowercase = {"Authorization": f"bearer {TOKEN}"}
        async with http.post(
            url + "/weir/v1/preempt", json={"rid": "weirx"}, headers=lowercase
        ) as r:
            assert r.status == 404  # authorized; no such request
        async with http.post(url + "/weir/v1/drain", json={"deadline_s": 0}, headers=ADMIN) as r:
            assert r.status == 200
            assert (await r.json())["in_flight"] == 0
    assert guarded.service.draining


async def test_without_a_token_the_admin_routes_stay_open_and_the_sidecar_warns(
    engine: RunningEngine, caplog: pytest.LogCaptureFixture
) -> None:
    config = SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy())
    with caplog.at_level(logging.WARNING, logger="weir.sidecar"):
        async with (
            serve_sidecar(config) as running,
            aiohttp.ClientSession() as http,
            http.get(running.url + "/weir/v1/state") as r,
        ):
            assert r.status == 200
    assert any("no admin token" in rec.getMessage() for rec in caplog.records)
