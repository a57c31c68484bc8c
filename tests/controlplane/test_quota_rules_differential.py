"""The pure quota rules against the real Lua: the same seeded random sequences of quota
changes, charges, releases, lease renewals, lapses and reaps, applied to a real
redis-server through `QuotaStore` and to `QuotaLedger`, must give identical outcomes
(granted or refused, reason, Retry-After) and leave identical balances (every field of
the pool's usage, classes, charges and holders).

The scripts read Redis server time; the test reads it before and after each call and
accepts the call if the pure rules, at one millisecond in that window, agree exactly.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from controlplane.contract import TenantQuota
from controlplane.rules.quotas import RATES, QuotaLedger
from controlplane.store import Amounts, QuotaStore
from controlplane.store.scripts import as_text
from tests.controlplane.records import POOL

pytestmark = pytest.mark.redis


@pytest.fixture
def store_url(redis_url: str) -> str:
    """A standalone server only: the quota scripts are the same on a cluster (where the
    store's other tests run them), and TIME here must come from the scripts' server."""
    return redis_url


_LETTER = dict(zip(RATES, "iok", strict=True))
CLASSES = {"gold": 0.25, "standard": 0.0, "bulk": 0.5}
TENANTS = {"acme": "gold", "beta": "standard", "bulk": "bulk", "gold2": "gold"}
HOLDERS = ("router-1", "router-2", "sidecar-1")


async def server_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def random_quota(rng: random.Random, tenant: str) -> TenantQuota:
    """Small limits: a bucket refills a token every few milliseconds, so balances depend
    on the exact server millisecond of each call."""

    def limit(*choices: int) -> int:
        return rng.choice(choices)

    return TenantQuota(
        name=tenant,
        priority_class=TENANTS[tenant],
        reserved_fraction=CLASSES[TENANTS[tenant]],
        max_concurrency=limit(0, 1, 2, 3),
        input_tokens_per_min=limit(0, 600, 3000),
        output_tokens_per_min=limit(0, 900, 6000),
        kv_token_seconds_per_min=limit(0, 1200),
    )


async def redis_state(store: QuotaStore) -> dict[str, Any]:
    """The pool's quota hashes, numbers parsed."""
    keys, redis = store.keys, store.redis
    usage = {as_text(k): float(v) for k, v in (await redis.hgetall(keys.usage)).items()}
    classes = {as_text(k): float(v) for k, v in (await redis.hgetall(keys.classes)).items()}
    charges = {as_text(k): as_text(v) for k, v in (await redis.hgetall(keys.charges)).items()}
    holders = {
        as_text(m): int(s) for m, s in await redis.zrange(keys.holders, 0, -1, withscores=True)
    }
    held = {}
    for holder in HOLDERS:
        members = await redis.smembers(keys.held_by(holder))
        if members:
            held[holder] = sorted(as_text(m) for m in members)
    return {
        "usage": usage,
        "classes": classes,
        "charges": charges,
        "holders": holders,
        "held": held,
    }


def pure_state(ledger: QuotaLedger) -> dict[str, Any]:
    """The ledger in the scripts' Redis layout (see lua/_quota.lua)."""
    usage: dict[str, float] = {f"{t}:c": float(n) for t, n in ledger.concurrency.items()}
    for (tenant, rate), bucket in ledger.buckets.items():
        usage[f"{tenant}:{_LETTER[rate]}"] = bucket.level
        usage[f"{tenant}:{_LETTER[rate]}t"] = float(bucket.since_ms)
    classes = {f"f:{c}": f for c, f in ledger.reserved_fraction.items()}
    classes.update({f"u:{c}": float(n) for c, n in ledger.class_in_use.items()})
    if ledger.capacity:
        classes["cap"] = float(ledger.capacity)
    charges = {
        f"{holder} {rid}": (
            f"{c.tenant} {c.priority_class} {c.concurrency} {c.input_tokens} "
            f"{c.output_tokens} {c.kv_token_seconds}"
        )
        for (holder, rid), c in ledger.charges.items()
    }
    held: dict[str, list[str]] = {}
    for holder, rid in ledger.charges:
        held.setdefault(holder, []).append(rid)
    return {
        "usage": usage,
        "classes": classes,
        "charges": charges,
        "holders": dict(ledger.leases),
        "held": {h: sorted(r) for h, r in held.items()},
    }


class Differential:
    def __init__(self, store: QuotaStore) -> None:
        self.store = store
        self.ledger = QuotaLedger()
        self.log: list[str] = []
        self.outcomes: set[object] = set()

    async def step(
        self,
        what: str,
        real: Callable[[], Awaitable[Any]],
        pure: Callable[[QuotaLedger, int], Any],
    ) -> Any:
        """Run one call on Redis and find the server millisecond at which the pure rules
        give the same answer and the same state."""
        self.log.append(what)
        before = await server_ms(self.store.redis)
        got = await real()
        if hasattr(got, "granted"):  # a ChargeResult
            got = as_result(got)
        after = await server_ms(self.store.redis)
        state = await redis_state(self.store)
        attempts = []
        for now in range(before, after + 1):
            ledger = copy.deepcopy(self.ledger)
            expected = pure(ledger, now)
            mirror = pure_state(ledger)
            if expected == got and mirror == state:
                self.ledger = ledger
                self.outcomes.add(got[1] if isinstance(got, tuple) else type(got).__name__)
                return got
            attempts.append((now, expected, mirror))
        history = "\n".join(self.log[-12:])
        now, expected, mirror = attempts[-1]
        raise AssertionError(
            f"pure rules disagree with the Lua after:\n{history}\n"
            f"Lua: {got!r}\nLua state: {state!r}\n"
            f"pure at {now}: {expected!r}\npure state: {mirror!r}"
        )


def as_result(decision: Any) -> tuple[bool, str, float | None]:
    return (decision.granted, decision.reason, decision.retry_after_s)


@pytest.mark.parametrize("seed", range(4))
async def test_pure_quota_rules_match_the_lua(client: Redis, seed: int) -> None:
    rng = random.Random(seed)
    store = QuotaStore(client, POOL)
    diff = Differential(store)
    for tenant in TENANTS:
        quota = random_quota(rng, tenant)
        await store.set_quota(quota)
        diff.ledger.set_quota(quota)
    capacity = rng.choice((0, 4, 6))
    await store.set_capacity(capacity)
    diff.ledger.set_capacity(capacity)
    rids = [f"r{i}" for i in range(12)]
    for _ in range(160):
        op = rng.random()
        holder = rng.choice(HOLDERS)
        rid = rng.choice(rids)
        if op < 0.1:
            ttl_ms = rng.choice((15, 40, 30_000))
            await diff.step(
                f"renew {holder} {ttl_ms}",
                lambda h=holder, t=ttl_ms: store.renew_holder(h, t / 1000),
                lambda led, now, h=holder, t=ttl_ms: led.renew(h, t, now),
            )
        elif op < 0.5:
            tenant = rng.choice([*TENANTS, "ghost"])
            amounts = Amounts(
                concurrency=rng.choice((0, 1, 1, 2)),
                input_tokens=rng.choice((0, 50, 400, 700, 2500)),
                output_tokens=rng.choice((0, 100, 800, 1000)),
                kv_token_seconds=rng.choice((0, 0, 300, 1500)),
            )
            await diff.step(
                f"charge {tenant} {holder} {rid} {amounts}",
                lambda t=tenant, h=holder, r=rid, a=amounts: store.charge(t, h, r, a),
                lambda led, now, t=tenant, h=holder, r=rid, a=amounts: as_result(
                    led.charge(
                        t,
                        h,
                        r,
                        now,
                        concurrency=a.concurrency,
                        input_tokens=a.input_tokens,
                        output_tokens=a.output_tokens,
                        kv_token_seconds=a.kv_token_seconds,
                    )
                ),
            )
        elif op < 0.75:
            used = None
            if rng.random() < 0.7:
                used = Amounts(
                    input_tokens=rng.choice((0, 50, 400)),
                    output_tokens=rng.choice((0, 10, 500)),
                    kv_token_seconds=rng.choice((0, 100)),
                )
            spent = None if used is None else (
                used.input_tokens, used.output_tokens, used.kv_token_seconds
            )  # fmt: skip
            await diff.step(
                f"release {holder} {rid} {used}",
                lambda h=holder, r=rid, u=used: store.release(h, r, u),
                lambda led, now, h=holder, r=rid, s=spent: led.release(h, r, now, s),
            )
        elif op < 0.85:
            await diff.step("reap", store.reap_holders, lambda led, now: led.reap(now))
        elif op < 0.9:
            tenant = rng.choice(list(TENANTS))
            quota = random_quota(rng, tenant)
            await diff.step(
                f"set {quota}",
                lambda q=quota: store.set_quota(q),
                lambda led, now, q=quota: led.set_quota(q),
            )
        else:
            await asyncio.sleep(rng.choice((0.005, 0.02, 0.05)))
    # The sequence granted and refused for several reasons (which ones depends on how
    # long the calls took: leases lapse in real time).
    refusals = {"holder_expired", "unknown_tenant", "concurrency", "class_capacity", *RATES}
    assert "" in diff.outcomes
    assert len(diff.outcomes & refusals) >= 3
