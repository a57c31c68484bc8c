"""The endpoint registry against a real redis-server: leases, fencing, the change feed."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
from redis.asyncio import Redis

from controlplane.contract import (
    SCHEMA_VERSION,
    EndpointState,
    Lifecycle,
    SchemaError,
    WatermarkState,
    encode,
)
from controlplane.store import (
    ChangeKind,
    EndpointRegistry,
    FencedError,
    HeartbeatStatus,
    PoolFollower,
)
from tests.controlplane.records import POOL, endpoint

pytestmark = pytest.mark.redis


async def _stored(registry: EndpointRegistry, endpoint_id: str) -> tuple[int, int, bytes]:
    """(epoch, version, blob) exactly as Redis holds them."""
    meta, blob = await registry.redis.hmget(registry.keys.state, [endpoint_id, endpoint_id + "#"])
    assert isinstance(meta, bytes)
    assert isinstance(blob, bytes)
    epoch, version, _lifecycle, _lease = meta.split(b" ")
    return int(epoch), int(version), blob


async def _until_server_time_passes(registry: EndpointRegistry, ms: int) -> None:
    """Poll Redis server time (the lease clock) until it is past `ms`."""
    async with asyncio.timeout(30):
        while True:
            if await registry.server_time_ms() > ms:
                return
            await asyncio.sleep(0.02)


async def test_register_hands_out_rising_epochs_and_heartbeats_advance_versions(
    registry: EndpointRegistry,
) -> None:
    a = await registry.register(endpoint("a"), ttl_s=10)
    b = await registry.register(endpoint("b"), ttl_s=10)
    assert (a.epoch, a.version) == (1, 1)
    assert b.epoch == 2
    floor = await registry.register(endpoint("c"), ttl_s=10, epoch_floor=40)
    assert floor.epoch == 41

    beat = msgspec.structs.replace(a, version=2, kv_used_tokens=300)
    result = await registry.heartbeat(beat, ttl_s=10)
    assert result.status is HeartbeatStatus.OK
    assert (result.epoch, result.version) == (1, 2)
    snap = await registry.snapshot()
    assert snap.endpoints["a"].kv_used_tokens == 300
    assert snap.endpoints["a"].version == 2
    assert snap.lease_valid("a")
    assert snap.membership().members == ("a", "b", "c")


async def test_zombie_with_old_epoch_cannot_overwrite_its_successor(
    registry: EndpointRegistry,
) -> None:
    zombie = await registry.register(endpoint("a", kv_used_tokens=1), ttl_s=10)
    successor = await registry.register(endpoint("a", kv_used_tokens=2), ttl_s=10)
    assert successor.epoch > zombie.epoch
    before = await _stored(registry, "a")

    with pytest.raises(FencedError) as caught:
        await registry.heartbeat(
            msgspec.structs.replace(zombie, version=99, kv_used_tokens=666), ttl_s=10
        )
    assert caught.value.current_epoch == successor.epoch
    with pytest.raises(FencedError):
        await registry.deregister("a", zombie.epoch)
    with pytest.raises(FencedError):
        await registry.drain("a", zombie.epoch)
    assert await _stored(registry, "a") == before
    assert (await registry.snapshot()).endpoints["a"].kv_used_tokens == 2


async def test_duplicated_and_reordered_heartbeats_keep_the_newest_state(
    registry: EndpointRegistry,
) -> None:
    first = await registry.register(endpoint("a"), ttl_s=10)
    beats = [msgspec.structs.replace(first, version=v, kv_used_tokens=v * 10) for v in (2, 3, 4)]
    delivered = [beats[0], beats[2], beats[1], beats[2], beats[0]]  # reordered and duplicated
    statuses = [(await registry.heartbeat(b, ttl_s=10)).status for b in delivered]
    assert statuses == [
        HeartbeatStatus.OK,
        HeartbeatStatus.OK,
        HeartbeatStatus.STALE,
        HeartbeatStatus.STALE,
        HeartbeatStatus.STALE,
    ]
    epoch, version, blob = await _stored(registry, "a")
    assert (epoch, version) == (first.epoch, 4)
    assert blob == encode(beats[2])


async def test_skewed_client_clock_does_not_move_the_lease(
    registry: EndpointRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client believes it is a day ahead and says so in its timestamps.
    skew = 86_400.0
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    state = endpoint("a", started_at=time.time(), updated_at=time.time())
    before = await registry.server_time_ms()
    await registry.register(state, ttl_s=5)
    after = await registry.server_time_ms()
    lease = (await registry.snapshot()).lease_expires_ms["a"]
    assert before + 5000 <= lease <= after + 5000


async def test_expired_lease_is_reaped_by_server_time(registry: EndpointRegistry) -> None:
    await registry.register(endpoint("short"), ttl_s=0.2)
    await registry.register(endpoint("long"), ttl_s=60)
    lease = (await registry.snapshot()).lease_expires_ms["short"]
    first = await registry.reap()
    if first.server_time_ms < lease:  # normally: the lease has not lapsed yet
        assert first.endpoints == ()
    await _until_server_time_passes(registry, lease)
    reaped = await registry.reap()
    assert reaped.server_time_ms > lease
    assert set(first.endpoints + reaped.endpoints) == {"short"}
    snap = await registry.snapshot()
    assert set(snap.endpoints) == {"long"}
    assert "short" not in snap.membership().members


async def test_heartbeat_after_lapse_removes_record_and_asks_to_register(
    registry: EndpointRegistry,
) -> None:
    state = await registry.register(endpoint("a"), ttl_s=0.1)
    lease = (await registry.snapshot()).lease_expires_ms["a"]
    await _until_server_time_passes(registry, lease)
    result = await registry.heartbeat(msgspec.structs.replace(state, version=2), ttl_s=10)
    assert result.status is HeartbeatStatus.EXPIRED
    assert result.must_register
    assert "a" not in (await registry.snapshot()).endpoints


async def test_drain_is_sticky_and_leaves_membership(registry: EndpointRegistry) -> None:
    a = await registry.register(endpoint("a"), ttl_s=10)
    await registry.register(endpoint("b"), ttl_s=10)
    mv = (await registry.snapshot()).membership_version
    assert await registry.drain("a")  # the operator's drain: no epoch
    assert not await registry.drain("nobody")
    result = await registry.heartbeat(msgspec.structs.replace(a, version=2), ttl_s=10)
    assert result.lifecycle == "draining"
    snap = await registry.snapshot()
    assert snap.endpoints["a"].lifecycle is Lifecycle.DRAINING
    assert snap.membership().members == ("b",)
    assert snap.membership_version > mv
    assert await registry.deregister("a", a.epoch)
    assert not await registry.deregister("a", a.epoch)
    assert set((await registry.snapshot()).endpoints) == {"b"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": SCHEMA_VERSION + 1}, "schema version"),
        ({"kv_used_tokens": -5}, "kv_used_tokens"),
        ({"preemptions_per_s": float("nan")}, "preemptions_per_s"),
        ({"kv_capacity_tokens": "lots"}, "kv_capacity_tokens"),
        ({"address": 123}, "malformed"),
        ({"pool": "other"}, "pool"),
        ({"lifecycle": Lifecycle.GONE}, "gone"),
    ],
)
async def test_malformed_or_unknown_schema_records_are_rejected_and_overwrite_nothing(
    registry: EndpointRegistry, change: dict[str, object], message: str
) -> None:
    good = await registry.register(endpoint("a", kv_used_tokens=7), ttl_s=10)
    before = await _stored(registry, "a")
    seq = (await registry.snapshot()).position.seq
    bad = msgspec.structs.replace(good, version=2, **change)
    with pytest.raises(SchemaError, match=message):
        await registry.heartbeat(bad, ttl_s=10)
    with pytest.raises(SchemaError, match=message):
        await registry.register(bad, ttl_s=10)
    assert await _stored(registry, "a") == before
    assert (await registry.snapshot()).position.seq == seq


async def test_invalid_names_and_ttls_are_refused(registry: EndpointRegistry) -> None:
    with pytest.raises(ValueError, match="endpoint id"):
        await registry.register(endpoint("bad id{}"), ttl_s=10)
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl"):
            await registry.register(endpoint("a"), ttl_s=ttl)
    with pytest.raises(ValueError, match="pool name"):
        EndpointRegistry(registry.redis, "pool{x}")
    assert (await registry.snapshot()).endpoints == {}


async def test_unreadable_record_in_redis_is_left_out_of_views(
    registry: EndpointRegistry,
) -> None:
    await registry.register(endpoint("a"), ttl_s=10)
    b = await registry.register(endpoint("b"), ttl_s=10)
    follower = PoolFollower(registry)
    await follower.refresh()
    # Someone writes garbage straight into Redis; readers must not crash or guess.
    await registry.redis.hset(registry.keys.state, "a#", b"\xc1not msgpack")
    await registry.redis.hset(registry.keys.state, "c", b"no metadata at all")
    snap = await registry.snapshot()
    assert set(snap.endpoints) == {"b"}
    await registry.heartbeat(msgspec.structs.replace(b, version=2), ttl_s=10)
    await follower.refresh()
    assert follower.snapshot.endpoints["b"].version == 2


async def test_change_feed_carries_versioned_deltas(registry: EndpointRegistry) -> None:
    start = (await registry.snapshot()).position
    a = await registry.register(endpoint("a"), ttl_s=10)
    await registry.heartbeat(
        msgspec.structs.replace(a, version=2, watermark=WatermarkState.PRESSURE), ttl_s=10
    )
    await registry.set_hot_prefix(12345, ["a"], ttl_s=10)
    await registry.deregister("a", a.epoch)
    batch = await registry.changes(start)
    assert not batch.resync
    assert [c.kind for c in batch.changes] == [
        ChangeKind.UPSERT,
        ChangeKind.UPSERT,
        ChangeKind.HOT_SET,
        ChangeKind.GONE,
    ]
    assert [c.seq for c in batch.changes] == list(range(start.seq + 1, start.seq + 5))
    upsert = batch.changes[1].endpoint
    assert upsert is not None
    assert upsert.watermark is WatermarkState.PRESSURE
    assert upsert.version == 2
    hot = batch.changes[2].hot
    assert hot is not None
    assert hot.extra_owners == ("a",)
    assert batch.position.seq == start.seq + 4
    assert (await registry.changes(batch.position)).changes == ()

    limited = await registry.changes(start, limit=3)
    assert limited.more
    assert len(limited.changes) == 3


async def test_trimmed_feed_and_lost_incarnation_ask_for_resync(
    client: Redis, registry: EndpointRegistry
) -> None:
    small = EndpointRegistry(client, POOL, feed_maxlen=100)
    a = await small.register(endpoint("a"), ttl_s=10)
    position = (await small.snapshot()).position
    for v in range(2, 400):
        await small.heartbeat(msgspec.structs.replace(a, version=v), ttl_s=10)
    assert (await small.changes(position)).resync

    follower = PoolFollower(small)
    await follower.refresh()
    await client.flushall()  # what a Redis restart without persistence looks like
    await small.register(endpoint("b"), ttl_s=10)
    batch = await small.changes(follower.position)
    assert batch.resync
    refreshed = await follower.refresh()
    assert refreshed.resynced
    assert set(follower.snapshot.endpoints) == {"b"}
    assert follower.position.incarnation != position.incarnation


async def test_follower_applies_only_the_deltas(registry: EndpointRegistry) -> None:
    states = [await registry.register(endpoint(f"e{i}"), ttl_s=10) for i in range(50)]
    follower = PoolFollower(registry)
    assert (await follower.refresh()).resynced
    assert len(follower.snapshot.endpoints) == 50

    await registry.heartbeat(msgspec.structs.replace(states[7], version=2, kv_used_tokens=5), 10)
    await registry.deregister("e9", states[9].epoch)
    await registry.drain("e3")
    refreshed = await follower.refresh()
    assert (refreshed.applied, refreshed.resynced) == (3, False)
    view = follower.snapshot
    assert view.endpoints["e7"].kv_used_tokens == 5
    assert "e9" not in view.endpoints
    assert view.endpoints["e3"].lifecycle is Lifecycle.DRAINING
    full = await registry.snapshot()
    assert dict(view.endpoints) == dict(full.endpoints)
    assert dict(view.lease_expires_ms) == dict(full.lease_expires_ms)
    assert view.membership() == full.membership()
    assert view.position == full.position


async def test_watch_wakes_on_a_change(registry: EndpointRegistry) -> None:
    follower = PoolFollower(registry)
    views = follower.watch(block_s=5.0)
    first = await anext(views)
    assert first.endpoints == {}
    waiting = anext(views)
    task = asyncio.ensure_future(waiting)
    await registry.register(endpoint("a"), ttl_s=10)
    second = await asyncio.wait_for(task, timeout=30)
    assert set(second.endpoints) == {"a"}
    await views.aclose()


async def test_hot_prefix_overrides_are_versioned_and_expire(
    registry: EndpointRegistry,
) -> None:
    first = await registry.set_hot_prefix(7, ["a", "b"], ttl_s=60)
    second = await registry.set_hot_prefix(8, ["c"], ttl_s=0.1)
    assert second.version > first.version
    table = (await registry.snapshot()).hot_prefixes
    assert table.extra_owners(7, first.expires_at_ms - 1) == ("a", "b")
    assert table.extra_owners(7, first.expires_at_ms) == ()
    await _until_server_time_passes(registry, second.expires_at_ms)
    reaped = await registry.reap()
    assert reaped.hot_prefixes == (8,)
    assert await registry.remove_hot_prefix(7)
    assert not await registry.remove_hot_prefix(7)
    after = (await registry.snapshot()).hot_prefixes
    assert after.overrides == {}
    assert after.version > second.version
    with pytest.raises(ValueError, match="unsigned"):
        await registry.set_hot_prefix(-1, ["a"], ttl_s=1)


async def test_follower_matches_the_store_through_random_operations(
    client: Redis,
) -> None:
    """Seeded random writes (with trims of a short feed) and refreshes: after every
    refresh the follower's view equals a full snapshot, deltas or resync alike."""
    rng = random.Random(20261130)
    registry = EndpointRegistry(client, POOL, feed_maxlen=100)
    follower = PoolFollower(registry)
    held: dict[str, EndpointState] = {}
    resyncs = 0
    for step in range(450):
        op = rng.random()
        eid = f"e{rng.randrange(12)}"
        if op < 0.2 or (eid not in held and op < 0.7):
            held[eid] = await registry.register(endpoint(eid), ttl_s=30)
        elif op < 0.7:
            state = msgspec.structs.replace(
                held[eid], version=held[eid].version + 1, kv_used_tokens=step
            )
            if (await registry.heartbeat(state, ttl_s=30)).status is HeartbeatStatus.OK:
                held[eid] = state
        elif op < 0.78:
            await registry.drain(eid)
        elif op < 0.86 and eid in held:
            await registry.deregister(eid, held.pop(eid).epoch)
        elif op < 0.93:
            await registry.set_hot_prefix(rng.randrange(5), [eid], ttl_s=30)
        else:
            await registry.remove_hot_prefix(rng.randrange(5))
        # A long quiet stretch lets the short feed be trimmed past the follower.
        if rng.random() < (0.0 if 100 <= step < 350 else 0.2):
            resyncs += (await follower.refresh()).resynced
            view, full = follower.snapshot, await registry.snapshot()
            assert view.position == full.position
            assert dict(view.endpoints) == dict(full.endpoints)
            assert dict(view.lease_expires_ms) == dict(full.lease_expires_ms)
            assert view.membership() == full.membership()
            assert dict(view.hot_prefixes.overrides) == dict(full.hot_prefixes.overrides)
            assert view.hot_prefixes.version == full.hot_prefixes.version
    assert resyncs >= 2  # the first sync and at least one gap after a trim
