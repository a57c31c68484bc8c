"""The reference engine's hierarchical cache over HTTP: SGLang's launch flags in its
server info, SGLang's host-tier metric families on /metrics, and a prompt evicted to the
host tier served again from it."""

from __future__ import annotations

import random

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetsim.server import serve_engine

from .conftest import small_config
from .test_server_native import get, post


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(n)]


def samples(text: str) -> dict[str, float]:
    """Each sample's value by name and its pool/cache_source label (if any)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tag = sample.labels.get("pool") or sample.labels.get("cache_source")
            out[f"{sample.name}/{tag}" if tag else sample.name] = sample.value
    return out


async def test_a_prompt_evicted_to_the_host_tier_is_served_from_it() -> None:
    config = small_config(
        max_total_tokens=4096, page_size=16, enable_hierarchical_cache=True, hicache_ratio=2.0
    )
    async with serve_engine(config) as eng, aiohttp.ClientSession() as http:
        _, info = await get(http, f"{eng.url}/server_info")
        assert info["enable_hierarchical_cache"] is True
        assert (info["hicache_ratio"], info["hicache_write_policy"]) == (2.0, "write_back")

        def body(seed: int) -> dict[str, object]:
            return {
                "input_ids": ids(seed, 1500),
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            }

        first = await post(http, f"{eng.url}/generate", body(1))
        for seed in (2, 3, 4):  # push the first prompt out of the device pool
            await post(http, f"{eng.url}/generate", body(seed))
        again = await post(http, f"{eng.url}/generate", body(1))
        assert again[1]["output_ids"] == first[1]["output_ids"]
        assert again[1]["meta_info"]["cached_tokens"] == 1488  # whole pages, host and device
        _, text = await get(http, f"{eng.url}/metrics")
    values = samples(text)
    assert values["sglang:hicache_host_total_tokens"] == 8192
    assert values["sglang:hicache_host_used_tokens"] > 0
    assert values["sglang:evicted_tokens_total"] > 0
    assert values["sglang:hicache_backup_tokens_total/kv"] > 0
    assert values["sglang:load_back_tokens_total/kv"] > 0
    assert values["sglang:cached_tokens_total/host"] == values["sglang:load_back_tokens_total/kv"]
    # Bytes over copy time, each way, is the modelled PCIe link's bandwidth.
    kv_bytes = config.timing.model.kv_bytes_per_token
    for tokens, nbytes, seconds in (
        ("hicache_backup_tokens_total/kv", "hicache_backup_bytes_total",
         "hicache_backup_duration_seconds_sum"),
        ("load_back_tokens_total/kv", "load_back_bytes_total", "load_back_duration_seconds_sum"),
    ):  # fmt: skip
        assert values[f"sglang:{nbytes}"] == values[f"sglang:{tokens}"] * kv_bytes
        rate = values[f"sglang:{nbytes}"] / values[f"sglang:{seconds}"]
        assert rate == pytest.approx(config.timing.hardware.host_bytes_per_s)


async def test_without_the_flag_no_host_tier_family_is_served() -> None:
    async with serve_engine(small_config()) as eng, aiohttp.ClientSession() as http:
        _, info = await get(http, f"{eng.url}/server_info")
        _, text = await get(http, f"{eng.url}/metrics")
    assert info["enable_hierarchical_cache"] is False
    for family in ("hicache", "load_back", "evicted_tokens"):
        assert family not in text
