"""Handoff credits and the command channel against a real redis-server."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from redis.asyncio import Redis

from controlplane.contract import (
    SCHEMA_VERSION,
    Command,
    CommandKind,
    HandoffCredit,
    KVPolicy,
    Lifecycle,
    SchemaError,
    WatermarkState,
)
from controlplane.routing import PoolSnapshot
from controlplane.routing.snapshot import EndpointView
from controlplane.rules.credits import decode_budget
from controlplane.store import CommandChannel, CreditRefusal, CreditStore
from tests.controlplane.records import POOL, endpoint

pytestmark = pytest.mark.redis


@pytest.fixture
async def credits(client: Redis) -> CreditStore:
    store = CreditStore(client, POOL)
    await store.set_budget("h100-decode", 1000)
    return store


async def test_credits_are_bounded_by_the_class_budget(credits: CreditStore) -> None:
    first = await credits.issue("h100-decode", 600, ttl_s=30, credit_id="c1")
    assert isinstance(first, HandoffCredit)
    assert (first.kv_bytes, first.decode_class, first.pool) == (600, "h100-decode", POOL)
    again = await credits.issue("h100-decode", 600, ttl_s=30, credit_id="c1")  # a retry
    assert again == first
    refused = await credits.issue("h100-decode", 500, ttl_s=30)
    assert isinstance(refused, CreditRefusal)
    assert refused.reason == "insufficient"
    assert refused.retry_after_s is not None
    assert await credits.outstanding("h100-decode") == 600
    unknown = await credits.issue("a100-decode", 1, ttl_s=30)
    assert unknown == CreditRefusal("unknown_class", None)


async def test_a_credit_must_fit_one_decode_endpoint(client: Redis) -> None:
    # Capacity 1000 tokens each; the sidecar keeps 5 % above the emergency watermark.
    live = [
        endpoint("d1", kv_used_tokens=500, kv_reserved_growth_tokens=100),  # room 350
        endpoint("d2", kv_used_tokens=200),  # room 750
        endpoint("d3", kv_used_tokens=900, watermark=WatermarkState.CRITICAL),  # admits none
        endpoint("d4", lifecycle=Lifecycle.DRAINING),  # takes nothing new
    ]
    lapsed = EndpointView(endpoint("d5"), lease_deadline=10.0)
    snapshot = PoolSnapshot(POOL, (*(EndpointView(s, 100.0) for s in live), lapsed))
    cap, largest = decode_budget(snapshot, 50.0, KVPolicy(), kv_bytes_per_token=2)
    assert (cap, largest) == (2 * (350 + 750), 2 * 750)

    store = CreditStore(client, POOL)
    await store.set_budget("decode", cap, largest)
    assert isinstance(await store.issue("decode", 200, ttl_s=30), HandoffCredit)
    # 800 tokens: the class has room for them in total, no engine has it alone.
    refused = await store.issue("decode", 1600, ttl_s=30)
    assert isinstance(refused, CreditRefusal)
    assert refused.reason == "too_large_for_any_endpoint"
    assert refused.retry_after_s is not None  # retryable, like 'insufficient'
    await store.set_budget("decode", cap)  # the old call: no bound per endpoint
    assert isinstance(await store.issue("decode", 1600, ttl_s=30), HandoffCredit)


async def test_a_credit_is_consumed_once(credits: CreditStore) -> None:
    issued = await credits.issue("h100-decode", 400, ttl_s=30)
    assert isinstance(issued, HandoffCredit)
    consumed = await credits.consume(issued.credit_id)
    assert consumed == issued
    assert await credits.consume(issued.credit_id) == CreditRefusal("unknown", None)
    assert await credits.outstanding("h100-decode") == 0
    assert isinstance(await credits.issue("h100-decode", 1000, ttl_s=30), HandoffCredit)


async def test_unconsumed_credits_expire_by_server_time_and_free_the_budget(
    credits: CreditStore,
) -> None:
    short = await credits.issue("h100-decode", 900, ttl_s=0.1)
    assert isinstance(short, HandoffCredit)
    async with asyncio.timeout(30):
        while await credits.outstanding("h100-decode"):
            await credits.expire()
            await asyncio.sleep(0.05)
    assert await credits.consume(short.credit_id) == CreditRefusal("unknown", None)
    assert isinstance(await credits.issue("h100-decode", 1000, ttl_s=30), HandoffCredit)


async def test_bad_credit_input_is_refused(credits: CreditStore) -> None:
    for bytes_ in (0, -1):
        with pytest.raises(ValueError, match="kv_bytes"):
            await credits.issue("h100-decode", bytes_, ttl_s=1)
    for cap, largest in ((-1, None), (1, -1), (True, None)):
        with pytest.raises(ValueError, match="bytes"):
            await credits.set_budget("h100-decode", cap, largest)
    for ttl in (0, float("nan"), 1e9):
        with pytest.raises(ValueError, match="ttl"):
            await credits.issue("h100-decode", 1, ttl_s=ttl)
    with pytest.raises(ValueError, match="decode class"):
        await credits.issue("bad class", 1, ttl_s=1)
    assert await credits.outstanding("h100-decode") == 0


def _command(command_id: str, kind: CommandKind = CommandKind.DRAIN, **fields: object) -> Command:
    return Command(
        command_id=command_id,
        pool=POOL,
        endpoint_id="ep-1",
        kind=kind,
        **fields,  # type: ignore[arg-type]
    )


async def test_commands_are_sent_once_per_id_and_acknowledged(client: Redis) -> None:
    channel = CommandChannel(client, POOL)
    sent = [
        _command("c1", CommandKind.PAUSE_ADMISSION),
        _command("c2", CommandKind.PREEMPT_REQUEST, request_id="r9"),
        _command("c3", CommandKind.PREEMPT_TENANT, tenant="acme"),
        _command("c4", CommandKind.SET_PRIORITY, request_id="r9", priority=5),
        _command("c5", CommandKind.RESUME_ADMISSION),
    ]
    assert [await channel.send(c) for c in sent] == [True] * 5
    assert not await channel.send(sent[1])  # a repeated id is not appended again
    got = await channel.receive("ep-1", "sidecar-a", count=10)
    assert [d.command for d in got] == sent
    assert not any(d.redelivered for d in got)
    assert await channel.pending("ep-1") == 5
    for d in got:
        assert await channel.ack("ep-1", d.entry_id)
    assert await channel.pending("ep-1") == 0
    assert await channel.receive("ep-1", "sidecar-a") == []


async def test_unacknowledged_commands_are_redelivered(client: Redis) -> None:
    channel = CommandChannel(client, POOL, redeliver_after_s=0.1)
    await channel.send(_command("c1"))
    first = await channel.receive("ep-1", "sidecar-old")  # then the reader crashes
    assert [d.command.command_id for d in first] == ["c1"]
    async with asyncio.timeout(30):
        while True:
            again = await channel.receive("ep-1", "sidecar-new")
            if again:
                break
            await asyncio.sleep(0.05)
    assert [(d.command.command_id, d.redelivered) for d in again] == [("c1", True)]
    assert again[0].entry_id == first[0].entry_id
    assert await channel.ack("ep-1", again[0].entry_id)
    assert await channel.pending("ep-1") == 0


async def test_blocking_receive_wakes_on_a_command(client: Redis) -> None:
    channel = CommandChannel(client, POOL)
    assert await channel.receive("ep-1", "s") == []  # creates the group
    waiting = asyncio.ensure_future(channel.receive("ep-1", "s", block_s=4))
    await channel.send(_command("c1"))
    got = await asyncio.wait_for(waiting, timeout=30)
    assert [d.command.command_id for d in got] == ["c1"]


async def test_bad_commands_are_refused_and_unreadable_entries_dropped(client: Redis) -> None:
    channel = CommandChannel(client, POOL)
    with pytest.raises(SchemaError, match="schema"):
        await channel.send(_command("c1", schema=SCHEMA_VERSION + 1))
    with pytest.raises(SchemaError, match="pool"):
        await channel.send(msgspec.structs.replace(_command("c1"), pool="other"))
    with pytest.raises(SchemaError, match="malformed"):
        await channel.send(_command("c1", priority="high"))
    with pytest.raises(ValueError, match="command id"):
        await channel.send(_command("c 1"))
    assert await channel.receive("ep-1", "s") == []
    await client.xadd(channel.keys.commands("ep-1"), {"c": b"\xc1garbage"})
    await channel.send(_command("c1"))
    got = await channel.receive("ep-1", "s")
    assert [d.command.command_id for d in got] == ["c1"]
    assert await channel.pending("ep-1") == 1  # the garbage was acknowledged and dropped


async def test_command_channel_survives_redis_losing_the_stream(client: Redis) -> None:
    channel = CommandChannel(client, POOL)
    assert await channel.receive("ep-1", "s") == []
    await client.flushall()  # what a restart without persistence leaves
    await channel.send(_command("c1"))
    got = await channel.receive("ep-1", "s")
    assert [d.command.command_id for d in got] == ["c1"]
