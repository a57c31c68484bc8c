"""Sidecars of a P/D pair: each checks its engine serves its pool's half, a prefill
endpoint reserves the one token its engine computes, and a decode endpoint never resumes
a request in place (its engine takes one only with a prefill half)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from controlplane.contract import PoolPolicy, Role
from engine_sidecar.engine import EngineError
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.engine.config import DisaggregationMode
from fleetsim.server import RunningEngine, serve_engine
from tests.sidecar.conftest import MODEL, engine_config

PROMPT = "the river rises against the weir " * 8


def policy(role: Role) -> PoolPolicy:
    decode_pool = "d" if role is Role.PREFILL else ""
    return PoolPolicy(pool=role.value, model=MODEL, context_length=4096, role=role,
                      decode_pool=decode_pool)  # fmt: skip


@contextlib.asynccontextmanager
async def endpoint(
    role: Role, mode: DisaggregationMode
) -> AsyncIterator[tuple[RunningEngine, RunningSidecar]]:
    config = engine_config(disaggregation_mode=mode, disaggregation_bootstrap_port=0,
                           speed_factor=20.0)  # fmt: skip
    async with (
        serve_engine(config) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool=role.value, policy=policy(role)))
        as sidecar,
    ):  # fmt: skip
        yield engine, sidecar


@pytest.mark.parametrize(
    ("role", "mode"),
    [(Role.PREFILL, "null"), (Role.DECODE, "prefill"), (Role.MIXED, "decode")],
)
async def test_a_sidecar_refuses_an_engine_that_does_not_serve_its_pools_half(
    role: Role, mode: DisaggregationMode
) -> None:
    with pytest.raises(EngineError, match=f"runs --disaggregation-mode {mode}"):
        async with endpoint(role, mode):
            pass


async def test_a_pair_through_the_sidecars_reserves_one_token_and_resumes_nothing_in_place() -> (
    None
):
    async with (
        endpoint(Role.PREFILL, "prefill") as (p_engine, p_sidecar),
        endpoint(Role.DECODE, "decode") as (d_engine, d_sidecar),
        aiohttp.ClientSession() as http,
    ):
        bootstrap = {"bootstrap_host": "127.0.0.1",
                     "bootstrap_port": p_engine.server.bootstrap_port, "bootstrap_room": 11}  # fmt: skip
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                **bootstrap}  # fmt: skip
        named = {"x-request-id": "pd-1"}
        prefill = asyncio.create_task(
            http.post(p_sidecar.url + "/v1/completions", json={**body, "stream": False},
                      headers=named)
        )  # fmt: skip
        async with http.post(
            d_sidecar.url + "/v1/completions", json={**body, "stream": True}, headers=named
        ) as reply:
            assert reply.status == 200
            await reply.content.readline()  # the first token: the handoff landed
            (prefill_reply := await prefill).release()
            assert prefill_reply.status == 200
            (rid,) = d_sidecar.service.ledger.flights
            async with http.post(
                d_sidecar.url + "/weir/v1/preempt", json={"rid": rid, "mode": "recompute"}
            ) as refused:
                assert refused.status == 409
                assert await refused.json() == {"preempted": False}
            chunks = [line async for line in reply.content if line.startswith(b"data: {")]
        # The prefill endpoint reserved growth for the one token its engine computes, the
        # decode endpoint for the answer.
        prefill_needs, decode_needs = [await _needed(http, s) for s in (p_sidecar, d_sidecar)]
    last = json.loads(chunks[-1][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert d_engine.engine.imported_tokens_total == len(PROMPT)
    assert p_engine.engine.prompt_tokens_total == len(PROMPT)
    assert prefill_needs <= len(PROMPT) + 1 < decode_needs


async def _needed(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> int:
    """The KV tokens the sidecar's admission needed for request pd-1."""
    async with http.get(f"{sidecar.url}/weir/v1/requests/pd-1") as reply:
        story = await reply.json()
    needed: int = next(e["needed_tokens"] for e in story["events"] if e["event"] == "admitted")
    return needed
