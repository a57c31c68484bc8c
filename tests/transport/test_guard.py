"""The guard's parts on their own: the budget of body bytes in flight, the limits'
defaults, and decoding a large body with the collector paused."""

from __future__ import annotations

import asyncio
import gc

import msgspec
import pytest

from controlplane.transport.guard import (
    LARGE_BODY,
    ByteBudget,
    ServerLimits,
    _decode_large,
    body_limit,
)


async def test_a_take_that_fits_passes_others_that_wait() -> None:
    budget = ByteBudget(100)
    assert await budget.take(70, 1.0)
    big = asyncio.create_task(budget.take(60, 30.0))  # does not fit: waits
    await asyncio.sleep(0)
    assert budget.waits == 1
    assert await budget.take(30, 1.0)  # fits beside the 70: passes the waiting 60
    assert budget.used == 100
    budget.release(70)
    assert not big.done()  # 30 + 60 fits now, but it is woken, not run, yet
    assert await big
    assert budget.used == 90
    assert budget.peak == 100
    budget.release(30)
    budget.release(60)
    assert budget.used == 0


async def test_a_wait_in_vain_or_cancelled_holds_nothing() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(100)
    assert not await budget.take(1, 0.05)
    assert budget.timeouts == 1
    waiting = asyncio.create_task(budget.take(50, 30.0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.release(100)
    assert budget.used == 0  # neither waiter was granted anything that leaked
    assert await budget.take(100, 0.05)


async def test_waiters_are_granted_in_order_as_room_frees() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(100)
    order: list[int] = []

    async def want(n: int) -> None:
        assert await budget.take(n, 30.0)
        order.append(n)

    waiters = [asyncio.create_task(want(n)) for n in (80, 20, 10)]
    await asyncio.sleep(0)
    budget.release(100)  # 80 and 20 fit, in order; 10 waits for either
    await asyncio.sleep(0)
    assert order == [80, 20]
    budget.release(20)
    await asyncio.gather(*waiters)
    assert order == [80, 20, 10]
    assert budget.used == 90


def test_defaults_follow_the_context() -> None:
    assert body_limit(32768) == 2_359_296  # 2.25 MiB
    assert body_limit(131072) == 6 << 20
    limits = ServerLimits().for_context(32768)
    assert limits.max_body_bytes == 2_359_296
    assert limits.max_body_bytes_in_flight == 4 * 2_359_296
    given = ServerLimits(max_body_bytes=1000, max_body_bytes_in_flight=5000).for_context(32768)
    assert (given.max_body_bytes, given.max_body_bytes_in_flight) == (1000, 5000)
    # An explicit budget under a context-sized body grows to hold one body.
    assert ServerLimits(max_body_bytes_in_flight=10).for_context(1000).max_body_bytes_in_flight == (
        body_limit(1000)
    )


def test_a_large_body_decodes_with_the_collector_paused_and_restored() -> None:
    raw = b"[" + b",".join([b"[]"] * LARGE_BODY) + b"]"
    seen: list[bool] = []

    def decode(data: bytes) -> object:
        seen.append(gc.isenabled())
        return msgspec.json.decode(data)

    assert gc.isenabled()
    assert len(_decode_large(decode, raw)) == LARGE_BODY  # type: ignore[arg-type]
    with pytest.raises(msgspec.DecodeError):
        _decode_large(decode, raw[:-1])
    assert seen == [False, False]
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        _decode_large(decode, raw)
        assert not gc.isenabled()
    finally:
        gc.enable()
