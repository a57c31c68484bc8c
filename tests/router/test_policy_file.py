"""The router obeys its pool policy (`weir router --policy-file`, the operator's ConfigMap):
routing settings, context length, tenant quotas it publishes and enforces and the tenants'
fair-share weights; event
counters are exported at zero before their first event."""

from __future__ import annotations

import math
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.contract import PoolPolicy, RoutingPolicy, TenantQuota, encode_json
from controlplane.router import PoolView, QuotaSettings, Router, RouterConfig
from controlplane.routing.filters import BoundedLoad
from controlplane.routing.scorers import PrefixAffinity
from controlplane.store import QuotaStore
from tests.router.conftest import MODEL, POOL, make_fleet
from weir.cli import main

TENANTS = (
    TenantQuota(name="default", max_concurrency=8),
    TenantQuota(name="batch", max_concurrency=1, weight=0.5),
)


def test_the_pool_policy_sets_the_routers_routing_limits_and_tenants() -> None:
    routing = RoutingPolicy(
        prefix_block_tokens=32, prefix_blocks_for_owner=2, virtual_nodes=64,
        bounded_load_factor=1.5, max_affinity_wait_s=0.5, snapshot_staleness_s=3.0,
    )  # fmt: skip
    policy = PoolPolicy(pool="p", model="m", context_length=4096, routing=routing, tenants=TENANTS)
    config = RouterConfig.from_policy(policy, port=9)
    assert (config.pool, config.model, config.port) == ("p", "m", 9)
    assert config.limits.context_length == 4096
    assert config.routing == routing
    assert config.quotas == QuotaSettings(enforce=True, tenants=TENANTS)
    assert not RouterConfig.from_policy(PoolPolicy(pool="p", model="m")).quotas.enforce

    router = Router(config, PoolView("p", math.inf))
    bounded = [f for f in router.profile.filters if isinstance(f, BoundedLoad)]
    affinity = [s.scorer for s in router.profile.scorers if isinstance(s.scorer, PrefixAffinity)]
    assert [f.factor for f in bounded] == [1.5]
    assert [(s.block_tokens, s.owner_blocks, s.max_wait_s) for s in affinity] == [(32, 2, 0.5)]
    assert router.keys.declared == {"default", "batch"}
    # Its fair queue weighs the tenants as the policy does.
    assert router.dispatch.queue.counters.weights == {"default": 1.0, "batch": 0.5}


@pytest.mark.redis
async def test_the_policys_quotas_are_published_and_enforced_by_tenant_header(
    redis_url: str,
) -> None:
    async with (
        make_fleet(redis_url, engines=1, speed_factor=1.0,
                   quotas=QuotaSettings(enforce=True, tenants=TENANTS)) as fleet,
        aiohttp.ClientSession() as session,
    ):  # fmt: skip
        store = QuotaStore(fleet.registry.redis, POOL)
        assert await store.get_quota("batch") == TENANTS[1]

        async def short(headers: dict[str, str]) -> tuple[int, str]:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            async with session.post(
                fleet.url + "/v1/completions", json=body, headers=headers
            ) as reply:
                reason = "" if reply.status == 200 else (await reply.json())["error"]["reason"]
                return reply.status, reason

        body = {"model": MODEL, "prompt": "long story", "stream": True, "max_tokens": 3000,
                "ignore_eos": True}  # fmt: skip
        async with session.post(
            fleet.url + "/v1/completions", json=body, headers={"x-weir-tenant": "batch"}
        ) as held:
            assert held.status == 200
            await held.content.readline()  # batch's one slot is taken
            assert await short({"x-weir-tenant": "batch"}) == (429, "concurrency")
            assert await short({}) == (200, "")  # tenant default has its own quota
            assert await short({"x-weir-tenant": "nobody"}) == (403, "unknown_tenant")
        async with session.get(fleet.url + "/metrics") as reply:
            exposition = await reply.text()
    ratios = {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "weir_router_quota_utilization_ratio"
    }
    assert ratios == {"default", "batch"}


@pytest.mark.redis
async def test_event_counters_start_at_zero_for_every_known_reason(redis_url: str) -> None:
    async with (
        make_fleet(redis_url, engines=1) as fleet,
        aiohttp.ClientSession() as session,
        session.get(fleet.url + "/metrics") as reply,
    ):
        exposition = await reply.text()
    pool = f'pool="{POOL}"'
    for series in (
        f'weir_router_overloads_total{{{pool},reason="queue_full"}} 0.0',
        f'weir_router_overloads_total{{{pool},reason="concurrency"}} 0.0',
        f'weir_router_retries_total{{{pool},reason="connect_error"}} 0.0',
        f'weir_router_resumes_total{{{pool},reason="preempted"}} 0.0',
        f"weir_router_lease_expiries_total{{{pool}}} 0.0",
        f'weir_router_queue_seconds_count{{{pool},priority="0"}} 0.0',
    ):
        assert series in exposition


def _policy_file(tmp_path: Path, policy: PoolPolicy) -> str:
    path = tmp_path / "policy.json"
    path.write_bytes(encode_json(policy))
    return str(path)


def test_weir_router_refuses_a_bad_or_mismatched_policy_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = ["--endpoint", "http://127.0.0.1:9"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"pool": "p"}')  # no model
    assert main(["router", *endpoint, "--policy-file", str(bad)]) == 2
    assert "model" in capsys.readouterr().err

    plain = _policy_file(tmp_path, PoolPolicy(pool="p", model="m"))
    assert main(["router", *endpoint, "--policy-file", plain, "--pool", "q"]) == 2
    assert "the policy is for pool p" in capsys.readouterr().err

    with_tenants = _policy_file(tmp_path, PoolPolicy(pool="p", model="m", tenants=TENANTS))
    assert main(["router", *endpoint, "--policy-file", with_tenants]) == 2
    assert "need --redis-url" in capsys.readouterr().err
