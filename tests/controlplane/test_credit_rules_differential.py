"""The pure handoff-credit rules against the real Lua: the same seeded random sequences
of budgets (with and without a largest-endpoint bound), issues (retried ids included),
consumes, sweeps and lapses, applied to a real
redis-server through `CreditStore` and to `CreditLedger`, must give identical outcomes
(issued or refused, reason, expiry, Retry-After) and identical state (credits, expiry
index, budgets and outstanding bytes).

As in the quota differential, each call is matched at one server millisecond between the
times read before and after it.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from controlplane.contract import HandoffCredit
from controlplane.rules.credits import CreditDecision, CreditLedger
from controlplane.store import CreditRefusal, CreditStore
from controlplane.store.scripts import as_text
from tests.controlplane.records import POOL

pytestmark = pytest.mark.redis


@pytest.fixture
def store_url(redis_url: str) -> str:
    """A standalone server only: the credit scripts are the same on a cluster (where the
    store's other tests run them), and TIME here must come from the scripts' server."""
    return redis_url


SWEEP_LIMIT = 2  # small, so a sweep can leave lapsed credits behind


async def server_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def reply(got: HandoffCredit | CreditRefusal | int) -> tuple[object, ...]:
    if isinstance(got, HandoffCredit):
        return ("credit", got.decode_class, got.kv_bytes, got.expires_at)
    if isinstance(got, CreditRefusal):
        return ("refused", got.reason, got.retry_after_s)
    return ("count", got)


def decision(d: CreditDecision) -> tuple[object, ...]:
    if d.credit is not None:
        return ("credit", d.credit.decode_class, d.credit.kv_bytes, d.credit.expires_ms / 1000)
    return ("refused", d.reason, None if d.retry_after_ms < 0 else d.retry_after_ms / 1000)


async def redis_state(store: CreditStore) -> dict[str, Any]:
    keys, redis = store.keys, store.redis
    credits = {as_text(k): as_text(v) for k, v in (await redis.hgetall(keys.credits)).items()}
    expiry = {
        as_text(m): int(s)
        for m, s in await redis.zrange(keys.credit_expiry, 0, -1, withscores=True)
    }
    budget = {as_text(k): int(v) for k, v in (await redis.hgetall(keys.credit_budget)).items()}
    return {"credits": credits, "expiry": expiry, "budget": budget}


def pure_state(ledger: CreditLedger) -> dict[str, Any]:
    budget = {f"cap:{c}": n for c, n in ledger.budgets.items()}
    budget.update({f"max:{c}": n for c, n in ledger.largest.items()})
    budget.update({f"out:{c}": n for c, n in ledger.outstanding.items()})
    return {
        "credits": {
            i: f"{c.decode_class} {c.kv_bytes} {c.expires_ms}" for i, c in ledger.credits.items()
        },
        "expiry": {i: c.expires_ms for i, c in ledger.credits.items()},
        "budget": budget,
    }


@pytest.mark.parametrize("seed", range(4))
async def test_pure_credit_rules_match_the_lua(client: Redis, seed: int) -> None:
    rng = random.Random(seed)
    store = CreditStore(client, POOL, sweep_limit=SWEEP_LIMIT)
    ledger = CreditLedger(sweep_limit=SWEEP_LIMIT)
    log: list[str] = []
    outcomes: set[object] = set()

    async def step(
        what: str,
        real: Callable[[], Awaitable[Any]],
        pure: Callable[[CreditLedger, int], tuple[object, ...]],
    ) -> None:
        nonlocal ledger
        log.append(what)
        before = await server_ms(client)
        got = reply(await real())
        after = await server_ms(client)
        state = await redis_state(store)
        for now in range(before, after + 1):
            candidate = copy.deepcopy(ledger)
            expected = pure(candidate, now)
            if expected == got and pure_state(candidate) == state:
                ledger = candidate
                outcomes.add(got[1] if got[0] == "refused" else got[0])
                return
        raise AssertionError(
            "pure rules disagree with the Lua after:\n" + "\n".join(log[-12:]) + f"\n"
            f"Lua: {got!r} {state!r}\npure at {after}: {expected!r} {pure_state(candidate)!r}"
        )

    # decode-a's largest endpoint has room for 1000 bytes; decode-b's budget is set the
    # old way, without that bound.
    for decode_class, largest in (("decode-a", 1000), ("decode-b", None)):
        cap = rng.choice((1000, 2500))
        await store.set_budget(decode_class, cap, largest)
        ledger.set_budget(decode_class, cap, largest)
    # Ids are retried with their own class and bytes here; a retry naming others is the
    # test below.
    ids = {
        f"c{i}": (rng.choice(("decode-a", "decode-a", "decode-b", "unknown")),
                  rng.choice((100, 400, 900, 1200)))
        for i in range(10)
    }  # fmt: skip
    for _ in range(150):
        op = rng.random()
        credit_id = rng.choice(list(ids))
        if op < 0.45:
            decode_class, kv_bytes = ids[credit_id]
            ttl_ms = rng.choice((10, 30, 60_000))
            await step(
                f"issue {credit_id} {decode_class} {kv_bytes} {ttl_ms}",
                lambda i=credit_id, c=decode_class, b=kv_bytes, t=ttl_ms: store.issue(
                    c, b, t / 1000, i
                ),
                lambda led, now, i=credit_id, c=decode_class, b=kv_bytes, t=ttl_ms: decision(
                    led.issue(i, c, b, t, now)
                ),
            )
        elif op < 0.75:
            await step(
                f"consume {credit_id}",
                lambda i=credit_id: store.consume(i),
                lambda led, now, i=credit_id: decision(led.consume(i, now)),
            )
        elif op < 0.83:
            await step("expire", store.expire, lambda led, now: ("count", led.expire(now)))
        elif op < 0.88:
            decode_class = rng.choice(("decode-a", "decode-b"))
            cap = rng.choice((500, 1000, 2500))
            largest = rng.choice((None, 1000))  # None: the old call, no bound
            await step(
                f"budget {decode_class} {cap} {largest}",
                lambda c=decode_class, n=cap, m=largest: store.set_budget(c, n, m),
                lambda led, now, c=decode_class, n=cap, m=largest: (
                    "count",
                    led.set_budget(c, n, m),
                ),
            )
        else:
            await asyncio.sleep(rng.choice((0.005, 0.02, 0.04)))
    assert {
        "credit",
        "insufficient",
        "too_large_for_any_endpoint",
        "unknown_class",
        "unknown",
        "count",
    } <= outcomes


async def test_a_retried_issue_reports_the_credit_it_holds(client: Redis) -> None:
    store = CreditStore(client, POOL)
    await store.set_budget("decode-a", 1000)
    first = await store.issue("decode-a", 900, 30, "c1")
    again = await store.issue("decode-b", 100, 30, "c1")
    assert isinstance(first, HandoffCredit)
    assert again == first  # the pure rules: CreditLedger.issue returns the held credit
