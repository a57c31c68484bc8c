"""Tenant quotas against a real redis-server: atomic charges, refunds, holder leases."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from controlplane.contract import SCHEMA_VERSION, SchemaError, TenantQuota
from controlplane.store import Amounts, QuotaHolder, QuotaStore, RedisSettings, connect
from controlplane.store.scripts import as_text
from tests.controlplane.records import POOL
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
async def quotas(client: Redis) -> QuotaStore:
    store = QuotaStore(client, POOL)
    await store.renew_holder("router-1", ttl_s=30)
    return store


async def test_concurrency_is_charged_and_released_idempotently(quotas: QuotaStore) -> None:
    await quotas.set_quota(TenantQuota(name="acme", max_concurrency=2))
    one = Amounts(concurrency=1)
    assert (await quotas.charge("acme", "router-1", "r1", one)).granted
    again = await quotas.charge("acme", "router-1", "r1", one)  # a retried charge
    assert (again.granted, again.reason) == (True, "duplicate")
    assert (await quotas.charge("acme", "router-1", "r2", one)).granted
    refused = await quotas.charge("acme", "router-1", "r3", one)
    assert (refused.granted, refused.reason) == (False, "concurrency")
    assert refused.retry_after_s is not None
    assert (await quotas.usage("acme")).concurrency == 2
    assert await quotas.release("router-1", "r1")
    assert not await quotas.release("router-1", "r1")
    assert (await quotas.usage("acme")).concurrency == 1
    assert (await quotas.charge("acme", "router-1", "r3", one)).granted


async def test_token_rates_refuse_with_retry_after_and_refund_unused(quotas: QuotaStore) -> None:
    await quotas.set_quota(
        TenantQuota(name="acme", input_tokens_per_min=6000, output_tokens_per_min=600)
    )
    first = await quotas.charge(
        "acme", "router-1", "r1", Amounts(input_tokens=5000, output_tokens=500)
    )
    assert first.granted
    refused = await quotas.charge("acme", "router-1", "r2", Amounts(input_tokens=2000))
    assert (refused.granted, refused.reason) == (False, "input_tokens")
    # 1000 tokens short at 100 tokens/s: about ten seconds, less what refilled meanwhile.
    assert refused.retry_after_s is not None
    assert 5 < refused.retry_after_s <= 10
    too_big = await quotas.charge("acme", "router-1", "r3", Amounts(output_tokens=601))
    assert (too_big.granted, too_big.reason, too_big.retry_after_s) == (
        False,
        "output_tokens",
        None,
    )
    # r1 stopped after 100 output tokens: 400 come back to the bucket.
    before = (await quotas.usage("acme")).output_tokens_left
    assert await quotas.release(
        "router-1", "r1", used=Amounts(input_tokens=5000, output_tokens=100)
    )
    assert (await quotas.usage("acme")).output_tokens_left >= before + 400


async def test_a_refused_charge_changes_nothing(quotas: QuotaStore) -> None:
    await quotas.set_quota(TenantQuota(name="acme", max_concurrency=5, output_tokens_per_min=100))
    refused = await quotas.charge(
        "acme", "router-1", "r1", Amounts(concurrency=1, output_tokens=500)
    )
    assert not refused.granted
    usage = await quotas.usage("acme")
    assert usage.concurrency == 0
    assert usage.output_tokens_left == 100


async def test_subsets_of_dimensions_from_router_and_sidecar(quotas: QuotaStore) -> None:
    await quotas.set_quota(
        TenantQuota(name="acme", max_concurrency=1, input_tokens_per_min=1000,
                    kv_token_seconds_per_min=10_000)
    )  # fmt: skip
    await quotas.renew_holder("sidecar-7", ttl_s=30)
    router = await quotas.charge("acme", "router-1", "r1", Amounts(concurrency=1, input_tokens=10))
    sidecar = await quotas.charge("acme", "sidecar-7", "r1", Amounts(kv_token_seconds=9_000))
    assert router.granted
    assert sidecar.granted
    more_kv = await quotas.charge("acme", "sidecar-7", "r2", Amounts(kv_token_seconds=2_000))
    assert (more_kv.granted, more_kv.reason) == (False, "kv_token_seconds")
    usage = await quotas.usage("acme")
    assert usage.concurrency == 1
    assert usage.kv_token_seconds_left < 2_000  # the refused charge still would not fit


async def test_crashed_holder_charges_come_back(quotas: QuotaStore) -> None:
    await quotas.set_quota(TenantQuota(name="acme", max_concurrency=3))
    await quotas.renew_holder("router-2", ttl_s=30)
    for rid in ("a", "b"):
        assert (await quotas.charge("acme", "router-2", rid, Amounts(concurrency=1))).granted
    assert (await quotas.charge("acme", "router-1", "c", Amounts(concurrency=1))).granted
    assert (await quotas.usage("acme")).concurrency == 3
    assert await quotas.reap_holders() == {}  # router-2's lease is still valid
    # Its last renewal, and then it crashes: the lease lapses. (Taken short from the
    # start, it lapsed before the check above on a loaded machine.)
    await quotas.renew_holder("router-2", ttl_s=0.2)
    async with asyncio.timeout(30):
        while True:
            reaped = await quotas.reap_holders()
            if reaped:
                break
            await asyncio.sleep(0.05)
    assert reaped == {"router-2": 2}
    assert (await quotas.usage("acme")).concurrency == 1  # router-1's charge stays
    late = await quotas.charge("acme", "router-2", "d", Amounts(concurrency=1))
    assert (late.granted, late.reason) == (False, "holder_expired")
    assert not await quotas.release("router-2", "a")


async def test_a_holder_lists_the_requests_it_holds_charges_for(quotas: QuotaStore) -> None:
    """What a live holder reconciles against: its own charges, not another holder's, not a
    refused or released one."""
    await quotas.set_quota(TenantQuota(name="acme", max_concurrency=3))
    await quotas.renew_holder("router-2", ttl_s=30)
    assert await quotas.held("router-1") == frozenset()
    for holder, rid in (("router-1", "a"), ("router-1", "b"), ("router-2", "c")):
        assert (await quotas.charge("acme", holder, rid, Amounts(concurrency=1))).granted
    assert not (await quotas.charge("acme", "router-1", "d", Amounts(concurrency=1))).granted
    assert await quotas.held("router-1") == {"a", "b"}
    assert await quotas.held("router-2") == {"c"}
    assert await quotas.release("router-1", "a")
    assert await quotas.held("router-1") == {"b"}
    with pytest.raises(ValueError, match="holder"):
        await quotas.held("router 1")


async def test_a_request_charged_again_before_its_release_landed_keeps_the_new_charge() -> None:
    """A sidecar may see a request id again (a request migrated back) while the release of
    its earlier charge still waits for Redis: that release lands first, so the new charge
    is made (not taken for a duplicate) and no late release returns it."""
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    with RedisServer(extra_args=aof) as server:
        client = connect(RedisSettings(url=server.url, retries=1, backoff_cap_s=0.1))
        try:
            store = QuotaStore(client, POOL)
            await store.set_quota(TenantQuota(name="acme", max_concurrency=1))
            book = QuotaHolder(store, "sidecar.e1", lease_ttl_s=30)
            await book.renew()
            one = Amounts(concurrency=1)
            assert (await book.charge("acme", "r1", one)).granted
            await asyncio.to_thread(server.stop)
            assert not await book.release("r1")
            assert book.pending == 1
            await asyncio.to_thread(server.start)
            again = await book.charge("acme", "r1", one)
            assert (again.granted, again.reason, book.pending) == (True, "", 0)
            await book.settle()  # reconciles (a call failed): r1 is in flight, it stays
            assert await store.held("sidecar.e1") == {"r1"}
            assert (await store.usage("acme")).concurrency == 1
        finally:
            await client.aclose()


async def test_priority_class_reserved_capacity(quotas: QuotaStore) -> None:
    await quotas.set_capacity(10)
    await quotas.set_quota(
        TenantQuota(name="gold-co", priority_class="gold", reserved_fraction=0.3)
    )
    await quotas.set_quota(TenantQuota(name="bulk-co", priority_class="bulk"))
    one = Amounts(concurrency=1)
    granted = [(await quotas.charge("bulk-co", "router-1", f"b{i}", one)).granted for i in range(9)]
    assert granted == [True] * 7 + [False] * 2  # 3 of 10 slots are gold's
    refused = await quotas.charge("bulk-co", "router-1", "b9", one)
    assert refused.reason == "class_capacity"
    for i in range(3):
        assert (await quotas.charge("gold-co", "router-1", f"g{i}", one)).granted
    assert not (await quotas.charge("gold-co", "router-1", "g3", one)).granted  # pool full
    assert await quotas.release("router-1", "b0")
    assert (await quotas.charge("gold-co", "router-1", "g3", one)).granted  # shared slot


async def test_bad_quota_input_is_refused(quotas: QuotaStore) -> None:
    with pytest.raises(SchemaError, match="max_concurrency"):
        await quotas.set_quota(TenantQuota(name="acme", max_concurrency=-1))
    with pytest.raises(SchemaError, match="schema version"):
        await quotas.set_quota(TenantQuota(name="acme", schema=SCHEMA_VERSION + 1))
    with pytest.raises(SchemaError, match="reserved_fraction"):
        await quotas.set_quota(TenantQuota(name="acme", reserved_fraction=1.5))
    await quotas.set_quota(TenantQuota(name="a", priority_class="x", reserved_fraction=0.7))
    with pytest.raises(ValueError, match="exceed 1"):
        await quotas.set_quota(TenantQuota(name="b", priority_class="y", reserved_fraction=0.5))
    with pytest.raises(ValueError, match="tenant"):
        await quotas.set_quota(TenantQuota(name="bad tenant"))
    with pytest.raises(ValueError, match="input_tokens"):
        Amounts(input_tokens=-3)
    unknown = await quotas.charge("nobody", "router-1", "r1", Amounts(concurrency=1))
    assert (unknown.granted, unknown.reason, unknown.retry_after_s) == (
        False,
        "unknown_tenant",
        None,
    )
    assert await quotas.get_quota("acme") is None
    assert await quotas.get_quota("a") == TenantQuota(
        name="a", priority_class="x", reserved_fraction=0.7
    )


async def test_no_ghost_reservations_after_random_charges_releases_and_crashes(
    client: Redis,
) -> None:
    """Seeded random charges and releases from three holders, one of which crashes: after
    the survivors release and the crashed holder is reaped, nothing is held anywhere."""
    rng = random.Random(7)
    store = QuotaStore(client, POOL)
    await store.set_capacity(20)
    await store.set_quota(TenantQuota(name="gold-co", priority_class="gold",
                                      reserved_fraction=0.25, max_concurrency=8))  # fmt: skip
    await store.set_quota(TenantQuota(name="bulk-co", max_concurrency=15))
    holders = {"router-1": 30.0, "router-2": 30.0, "doomed": 0.3}
    for holder, ttl in holders.items():
        await store.renew_holder(holder, ttl)
    held: dict[tuple[str, str], str] = {}
    for i in range(300):
        holder = rng.choice(list(holders))
        if held and rng.random() < 0.4:
            key = rng.choice(sorted(held))
            assert await store.release(*key)
            del held[key]
            continue
        tenant = rng.choice(["gold-co", "bulk-co"])
        result = await store.charge(tenant, holder, f"r{i}", Amounts(concurrency=1))
        if result.granted:
            held[(holder, f"r{i}")] = tenant
        else:
            assert result.reason in ("concurrency", "class_capacity", "holder_expired")
        in_use = (await store.usage("gold-co")).concurrency + (
            await store.usage("bulk-co")
        ).concurrency
        assert in_use == len(held) <= 20
    for key in [k for k in held if k[0] != "doomed"]:
        assert await store.release(*key)
    async with asyncio.timeout(30):
        while True:
            if "doomed" in await store.reap_holders():
                break
            await asyncio.sleep(0.05)
    assert (await store.usage("gold-co")).concurrency == 0
    assert (await store.usage("bulk-co")).concurrency == 0
    classes = await client.hgetall(store.keys.classes)
    assert all(int(v) == 0 for k, v in classes.items() if as_text(k).startswith("u:"))
    assert await client.hlen(store.keys.charges) == 0


async def test_tenants_lists_exactly_those_with_a_quota(quotas: QuotaStore) -> None:
    assert await quotas.tenants() == frozenset()
    await quotas.set_quota(TenantQuota(name="acme", max_concurrency=1))
    await quotas.set_quota(TenantQuota(name="globex", max_concurrency=1))
    assert await quotas.tenants() == {"acme", "globex"}
