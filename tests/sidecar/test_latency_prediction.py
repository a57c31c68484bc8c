"""The sidecar's latency model against the reference engine: what it publishes in its
heartbeat tracks what requests see, follows the engine when it slows down, and its error
is exported. Real engine, real sidecar, real Redis; the assertions are ratios between
what was predicted and what was measured, never wall-clock thresholds."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import aiohttp
import pytest

from controlplane.store import EndpointRegistry, connect
from controlplane.store.connection import RedisSettings
from engine_sidecar.server import SidecarConfig, serve_sidecar
from fleetsim.server import serve_engine
from tests.polling import until
from tests.sidecar.conftest import engine_config, pool_policy

pytestmark = pytest.mark.redis

WAVE = 4  # concurrent requests a training wave sends
OUTPUT_TOKENS = 24


@dataclass(frozen=True)
class Seen:
    ttft_s: float
    tpot_s: float
    prompt_tokens: int


async def _request(http: aiohttp.ClientSession, url: str, i: int) -> Seen:
    """One streamed request (a distinct prompt: nothing cached) as the client saw it."""
    body = {
        "text": f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 20,
        "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True},
        "stream": True,
    }
    started = time.monotonic()
    stamps: list[float] = []
    last = b""
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.monotonic())
                last = line
    prompt = json.loads(last[5:])["meta_info"]["prompt_tokens"]
    ttft = stamps[0] - started
    return Seen(ttft, (stamps[-1] - stamps[0]) / (OUTPUT_TOKENS - 1), prompt)


def _errors(exposition: str, measure: str) -> dict[str, float]:
    """The exported error histogram of `measure`: cumulative count by bucket bound."""
    prefix = "weir_sidecar_latency_prediction_error_ratio_bucket"
    counts = {}
    for line in exposition.splitlines():
        if line.startswith(prefix) and f'measure="{measure}"' in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[bound] = float(line.rsplit(" ", 1)[1])
    return counts


async def test_the_published_prediction_tracks_the_engine_and_follows_a_slowdown(
    redis_url: str,
) -> None:
    """Waves of concurrent requests train the model; a last wave is judged by the errors
    the sidecar exports for it (each request's forecast when it arrived against what it
    saw), before and after the engine slows down fourfold."""
    redis = connect(RedisSettings(url=redis_url))
    registry = EndpointRegistry(redis, "p")
    try:
        # Real time: a decode step takes ~10 ms, well above the loopback's overhead.
        async with serve_engine(engine_config(speed_factor=1.0)) as engine:
            config = SidecarConfig(
                engine_url=engine.url, redis_url=redis_url, pool="p", endpoint_id="pod-a",
                advertise_url="http://pod-a:8001", policy=pool_policy(), heartbeat_s=0.05,
                lease_ttl_s=2.0,
            )  # fmt: skip
            async with serve_sidecar(config) as sidecar, aiohttp.ClientSession() as http:
                sent = 0

                async def wave() -> list[Seen]:
                    nonlocal sent
                    ids = range(sent, sent + WAVE)
                    sent += WAVE
                    return await asyncio.gather(*(_request(http, sidecar.url, i) for i in ids))

                async def errors() -> tuple[dict[str, float], dict[str, float]]:
                    async with http.get(sidecar.url + "/metrics") as resp:
                        exposition = await resp.text()
                    return _errors(exposition, "ttft"), _errors(exposition, "tpot")

                async def judged_wave() -> None:
                    """A wave judged by the errors the sidecar exported for it: every
                    TTFT forecast within 3x of what the request saw (absolute percentage
                    error at most 2: the loopback's jitter is of a prefill's order), every
                    TPOT forecast within half of it either way (at most 0.5: a model
                    still describing an engine four times faster is off by 0.75)."""
                    ttft_before, tpot_before = await errors()
                    await wave()
                    ttft, tpot = await errors()
                    assert ttft["+Inf"] - ttft_before["+Inf"] == WAVE
                    assert ttft["2.0"] - ttft_before["2.0"] == WAVE
                    assert tpot["+Inf"] - tpot_before["+Inf"] == WAVE
                    assert tpot["0.5"] - tpot_before["0.5"] == WAVE

                async def published_tpot() -> float:
                    """The TPOT the next heartbeat publishes (what a router reads)."""
                    beat_after = time.time()

                    async def published() -> bool:
                        state = (await registry.snapshot()).endpoints.get("pod-a")
                        return state is not None and state.updated_at > beat_after

                    await until(published, "a heartbeat after the wave")
                    return (await registry.snapshot()).endpoints["pod-a"].predicted_tpot_s

                for _ in range(4):
                    seen = await wave()
                await judged_wave()
                fast = await published_tpot()

                # The engine slows down fourfold (a noisy neighbour, a throttled GPU).
                engine.driver.speed_factor = 0.25
                for _ in range(3):
                    slow_seen = await wave()
                # Medians: on a loaded machine one request of a wave can see a stall.
                before = statistics.median(s.tpot_s for s in seen)
                assert statistics.median(s.tpot_s for s in slow_seen) > 2.0 * before
                await judged_wave()  # the model followed it
                assert await published_tpot() > fast
    finally:
        await redis.aclose()
