"""The tiny torch transformer over the paged KV cache: the engine's paging, prefix sharing
and recompute must give exactly what a dense forward pass gives."""

from __future__ import annotations

import aiohttp

from fleetsim.engine import EngineConfig, EngineModel, encode
from fleetsim.engine.torch_backend import TorchBackend
from fleetsim.server import serve_engine


def test_paged_attention_matches_dense_through_cache_hits_and_retraction() -> None:
    # Admission charges each newcomer its whole output but running requests only their
    # ratio's share: with an optimistic ratio, requests arriving one by one overfill the
    # pool and decode must retract (0.5.5 applies the ratio to ignore_eos requests too).
    config = EngineConfig(
        max_total_tokens=160, page_size=4, chunked_prefill_size=16, token_backend="torch",
        init_new_token_ratio=0.05, sglang_version="0.5.5",
    )  # fmt: skip
    backend = TorchBackend(config)
    model = EngineModel(config, backend)
    prompts = ["shared system prompt: answer briefly. " + q for q in ("why?", "how?", "who?")]
    reqs = [
        model.make_request(f"t{i}", encode(prompt), 45, ignore_eos=True)
        for i, prompt in enumerate(prompts)
    ]
    now, retracted, arriving = 0.0, 0, list(reqs)
    while arriving or model.has_work:
        if arriving:
            model.submit(arriving.pop(0), now)
        result = model.step(now)
        now += result.duration
        retracted += len(result.retracted)
        model.check()
    assert retracted > 0  # 3 × (~43 + 45) tokens do not fit 160: recompute happened
    assert any(r.cached_tokens > 0 for r in reqs)  # and pages were shared
    for req in reqs:
        assert req.output_ids == backend.model.generate_dense(req.input_ids, 45)
    assert model.kv.used_pages == 0


async def test_torch_backend_serves_http() -> None:
    config = EngineConfig(max_total_tokens=512, page_size=8, token_backend="torch", speed_factor=64)
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        async with http.post(f"{eng.url}/generate", json=body) as resp:
            out = await resp.json()
    assert resp.status == 200
    backend = eng.engine.backend
    assert isinstance(backend, TorchBackend)
    assert out["output_ids"] == backend.model.generate_dense(encode("hello"), 6)
