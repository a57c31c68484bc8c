"""Flooding a served engine with long outputs: it retracts and recomputes, never crashes,
and every client gets exactly the tokens an uninterrupted run produces."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from fleetsim.engine import EngineConfig, EngineModel, encode
from fleetsim.server import serve_engine

from .conftest import small_config, until


def uninterrupted(prompt: str, max_new: int) -> list[int]:
    model = EngineModel(EngineConfig(max_total_tokens=1 << 16))
    req = model.make_request("solo", encode(prompt), max_new, ignore_eos=True)
    model.submit(req, 0.0)
    now = 0.0
    while model.has_work:
        now += model.step(now).duration
    return req.output_ids


async def test_flood_of_long_outputs_over_http() -> None:
    """Requests arrive a few steps apart, so admission counts the running ones' growth at
    the new-token ratio (never EOS, but not declared ignore_eos): the pool overfills."""
    config = small_config(
        max_total_tokens=2048, chunked_prefill_size=256, speed_factor=1e6, eos_per_mille=0.0
    )
    prompts = [(f"flood {i}: " + "tell me more " * (i % 5 + 1), 300 + 25 * i) for i in range(16)]
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:

        async def stream(i: int, prompt: str, max_new: int) -> dict[str, object]:
            steps = 3 * i
            await until(lambda: eng.engine.steps >= steps)
            body = {
                "text": prompt,
                "rid": f"flood-{i:03d}",
                "stream": True,
                "sampling_params": {"max_new_tokens": max_new},
            }
            last: dict[str, object] = {}
            async with http.post(f"{eng.url}/generate", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
            return last

        results = await asyncio.gather(*(stream(i, p, n) for i, (p, n) in enumerate(prompts)))
        eng.engine.check()
        assert eng.engine.kv.used_pages == 0
        async with http.get(f"{eng.url}/health") as resp:
            assert resp.status == 200
    retractions = 0
    for (prompt, max_new), result in zip(prompts, results, strict=True):
        meta = result["meta_info"]
        assert isinstance(meta, dict)
        assert meta["finish_reason"] == {"type": "length", "length": max_new}
        assert result["output_ids"] == uninterrupted(prompt, max_new)
        retractions += meta["num_retractions"]
    assert retractions > 0
    assert eng.engine.retracted_total == retractions
