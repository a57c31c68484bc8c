"""Offload live: a sidecar in front of a reference engine with a host tier (SGLang's
hierarchical cache) aborts a long request, its pages go to host memory as other work
evicts them, and the continuation resumes from them in place with exactly the tokens an
uninterrupted run gives."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.contract import KVPolicy, PoolPolicy, PreemptionMode, SchedulingPolicy
from controlplane.contract import headers as wire
from engine_sidecar.policy import H200_LLAMA_8B
from engine_sidecar.server import SidecarConfig, read_host_bandwidth, serve_sidecar
from fleetsim.engine.timing import H200, LLAMA_8B, TimingModel
from fleetsim.server import serve_engine
from tests.sidecar.conftest import MODEL, engine_config
from tests.sidecar.streams import Received, read_sse
from tests.sidecar.test_preemption import uninterrupted

PROMPT = 1500
KV_BYTES = 2 * 80 * 8 * 128 * 2  # Llama-3.1-70B's: 80 layers of 8 KV heads, bf16
KEY = 0xFEEDFACE0000CAFE  # the router's key of the prompt: its last block hash
MAX_NEW = 240


def generate(seed: int, max_new: int) -> dict[str, object]:
    rng = random.Random(seed)
    return {
        "input_ids": [rng.randrange(1, 200) for _ in range(PROMPT)],
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
    }


POLICY = PoolPolicy(
    pool="p",
    model=MODEL,
    context_length=4096,
    scheduling=SchedulingPolicy(
        preemption_modes=(PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD)
    ),
)


async def test_an_offloaded_request_resumes_from_the_host_tier_exactly() -> None:
    """On an engine whose figures are not the defaults (a 70B model's KV a token, host
    memory behind 8 GB/s, pages of 16): relief's costs take them from its server info
    and, once it has timed copies, from its metrics."""
    timing = TimingModel(
        model=replace(LLAMA_8B, kv_bytes_per_token=KV_BYTES),
        hardware=replace(H200, host_bytes_per_s=8e9),
    )
    tiered = engine_config(
        max_total_tokens=4096, page_size=16, speed_factor=4.0, enable_hierarchical_cache=True,
        timing=timing,
    )  # fmt: skip
    policy = POLICY
    async with (
        serve_engine(engine_config()) as plain,
        serve_engine(tiered) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool="p", policy=policy)) as sidecar,
        aiohttp.ClientSession() as http,
    ):
        service, host = sidecar.service, engine.engine.host
        assert host is not None
        assert service.host_tier_tokens == 8192  # --hicache-ratio 2 of 4,096, from server info
        assert service.costs.kv_bytes_per_token == pytest.approx(KV_BYTES, rel=1e-3)
        assert service.costs.page_tokens == 16
        await read_host_bandwidth(service)  # no copy timed yet: the default stands
        assert service.costs.host_bytes_per_s == H200_LLAMA_8B.host_bytes_per_s
        expected = await uninterrupted(http, plain.url, "/generate", generate(1, MAX_NEW))
        async with http.post(
            sidecar.url + "/generate",
            json=generate(1, MAX_NEW) | {"stream": True},
            headers={wire.PREFIX_BLOCK: f"{KEY:016x}"},
        ) as resp:
            rid = resp.headers["x-weir-request-id"]
            first = await read_sse(resp, stop_after=20)
            assert service.host_prefixes.published() == ()
            # Relief's second rung holds the continuation back while other work runs.
            service.ledger.set_admission(False)
            async with http.post(
                sidecar.url + "/weir/v1/preempt", json={"rid": rid, "mode": "offload"}
            ) as answer:
                assert answer.status == 200, await answer.text()
            for seed in (2, 3, 4):  # push the victim's pages out of the device pool
                async with http.post(engine.url + "/generate", json=generate(seed, 1)) as done:
                    assert done.status == 200
            offloaded = service.ledger.flights[rid].offloaded
            assert offloaded >= PROMPT + 20
            assert service.relief_costs().host_room_tokens == 8192 - offloaded
            # Its heartbeat tells routers where its pages are, by the router's key.
            assert service.host_prefixes.published() == (KEY,)
            loaded = host.load_back_tokens_total
            service.ledger.set_admission(True)
            rest = await read_sse(resp)
        async with http.get(sidecar.url + "/metrics") as scraped:
            metrics = await scraped.text()
        await read_host_bandwidth(service)  # the engine has timed its copies now
    got = Received(first.events + rest.events, rest.done)
    assert got.done
    assert got.text() == expected.text()
    assert len(got.text()) == MAX_NEW
    # The continuation's history came back from the host tier, whole pages of it.
    assert host.load_back_tokens_total - loaded >= PROMPT // 16 * 16
    assert service.relief_costs().host_room_tokens == 8192
    assert service.host_prefixes.published() == ()  # back on the device
    assert service.costs.host_bytes_per_s == pytest.approx(8e9)
    samples = {
        (s.name, s.labels.get("mode", "")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples["weir_sidecar_preemptions_total", "offload"] == 1
    assert samples["weir_sidecar_preemptions_total", "recompute"] == 0
    assert samples["weir_sidecar_offloaded_tokens_total", ""] == offloaded
    assert samples["weir_sidecar_recomputed_tokens_total", ""] == 0
    assert service.ledger.own_used == 0


async def test_an_engine_without_a_host_tier_refuses_offload() -> None:
    async with (
        serve_engine(engine_config(speed_factor=4.0)) as engine,
        serve_sidecar(SidecarConfig(engine_url=engine.url, pool="p", policy=POLICY)) as sidecar,
        aiohttp.ClientSession() as http,
    ):
        assert sidecar.service.host_tier_tokens == 0
        assert sidecar.service.relief_costs().offload_s(1000) is None
        for bad in ("12", "0x0000000000000a", "FEEDFACE0000CAFE"):
            async with http.post(
                sidecar.url + "/generate", json=generate(1, 1), headers={wire.PREFIX_BLOCK: bad}
            ) as refused:
                assert refused.status == 400
                assert wire.PREFIX_BLOCK in (await refused.json())["error"]["message"]
        async with http.post(
            sidecar.url + "/generate", json=generate(1, MAX_NEW) | {"stream": True}
        ) as resp:
            rid = resp.headers["x-weir-request-id"]
            await read_sse(resp, stop_after=5)
            for mode, status in (("offload", 409), ("recompute", 200)):
                async with http.post(
                    sidecar.url + "/weir/v1/preempt", json={"rid": rid, "mode": mode}
                ) as answer:
                    assert answer.status == status
            assert (await read_sse(resp)).done


BURST_POLICY = PoolPolicy(
    pool="p",
    model=MODEL,
    context_length=4096,
    # A 15 % emergency band: room for relief to act before the engine itself runs out.
    kv=KVPolicy(low_watermark=0.6, high_watermark=0.75, emergency_watermark=0.85),
    scheduling=SchedulingPolicy(
        preemption_modes=(PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD)
    ),
)
LONG = 3000  # the victim's prompt: the burst's one long context, and its lowest priority


def burst_body(seed: int) -> dict[str, object]:
    """The long context (seed 0), or one of the short prompts that grow past their room."""
    rng = random.Random(seed)
    prompt = LONG if seed == 0 else 400
    return {
        "input_ids": [rng.randrange(1, 200) for _ in range(prompt)],
        "sampling_params": {"max_new_tokens": 900 if seed == 0 else 800, "ignore_eos": True},
        "priority": -10 if seed == 0 else 10,
    }


@pytest.mark.parametrize(
    ("host_bytes_per_s", "chosen", "other"),
    [(64e9, "offload", "recompute"), (1e9, "recompute", "offload")],
)
async def test_relief_offloads_a_long_context_by_cost_and_recomputes_it_over_a_slow_link(
    host_bytes_per_s: float, chosen: str, other: str
) -> None:
    """A burst whose outputs outgrow what admission reserved drives the endpoint to
    exhaustion; relief takes the long, low-priority context and weighs its modes by the
    engine's own figures: over a 64 GB/s host link a round trip of its KV is far cheaper
    than prefilling its 3,000-odd tokens again (offload), over 1 GB/s far dearer
    (recompute). Every stream ends whole with the tokens of an uninterrupted run. The
    engine writes through, so it has timed copies before relief reads its bandwidth."""
    timing = TimingModel(hardware=replace(H200, host_bytes_per_s=host_bytes_per_s))
    tiered = engine_config(
        page_size=16, speed_factor=12.0, enable_hierarchical_cache=True,
        hicache_write_policy="write_through", timing=timing,
    )  # fmt: skip
    bodies = [burst_body(seed) | {"stream": True} for seed in range(4)]
    async with (
        serve_engine(engine_config()) as plain,
        serve_engine(tiered) as engine,
        serve_sidecar(
            SidecarConfig(engine_url=engine.url, pool="p", policy=BURST_POLICY)
        ) as sidecar,
        aiohttp.ClientSession() as http,
    ):
        expected = await asyncio.gather(
            *(uninterrupted(http, plain.url, "/generate", b) for b in bodies)
        )

        async def stream(body: dict[str, object]) -> Received:
            async with http.post(sidecar.url + "/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await read_sse(resp)

        got = await asyncio.gather(*(stream(b) for b in bodies))
        async with http.get(sidecar.url + "/metrics") as scraped:
            metrics = await scraped.text()
        service = sidecar.service
        assert engine.engine.retracted_total == 0  # relief acted before the engine ran out
    assert [g.text() for g in got] == [e.text() for e in expected]
    assert all(g.done for g in got)
    assert service.costs.host_bytes_per_s == pytest.approx(host_bytes_per_s)
    samples = {
        (s.name, s.labels.get("mode", "")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples["weir_sidecar_preemptions_total", chosen] >= 1
    assert samples["weir_sidecar_preemptions_total", other] == 0
    # The long context went, and only it: its history resumed the chosen way.
    resumed = samples[f"weir_sidecar_{chosen.rstrip('e')}ed_tokens_total", ""]
    assert LONG < resumed <= LONG + 900
    assert service.ledger.own_used == 0
