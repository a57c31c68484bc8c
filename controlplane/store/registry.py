"""The endpoint registry: leases, fenced heartbeats, drains, the reaper and the change feed.

A sidecar registers and receives an epoch (a fencing token from the pool's counter); every
heartbeat carries (epoch, version) and is written only if the epoch is current and the
version is above the stored one, atomically in Lua. Leases are renewed and expire by Redis
server time, so a client's clock never decides liveness. Every change is appended to the
pool's change feed (a stream whose entry ids are sequence numbers), from which readers
keep their view current (see `follower`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from controlplane.contract import (
    SCHEMA_VERSION,
    EndpointState,
    Lifecycle,
    SchemaError,
    decode,
    encode,
)
from controlplane.ownership import HotPrefix, HotPrefixOverride, HotPrefixTable
from controlplane.store.connection import RedisClient
from controlplane.store.keys import PoolKeys, check_name, ttl_ms
from controlplane.store.scripts import as_text, run_batch, script, server_time_ms
from controlplane.store.snapshot import (
    ChangeBatch,
    FeedPosition,
    StoredPool,
    endpoint_from_store,
    hot_prefix_from_store,
    parse_change,
    parse_meta,
)

log = logging.getLogger(__name__)

_REGISTER = script("register.lua")
_HEARTBEAT = script("heartbeat.lua")
_DRAIN = script("drain.lua")
_DEREGISTER = script("deregister.lua")
_REAP = script("reap.lua")
_HOT_SET = script("hot_set.lua")
_HOT_REMOVE = script("hot_remove.lua")
_SNAPSHOT = script("snapshot.lua")
_CHANGES = script("changes.lua")

# Fields a sidecar reports that can never be negative or non-finite.
_NON_NEGATIVE = (
    "kv_capacity_tokens",
    "kv_used_tokens",
    "kv_reserved_growth_tokens",
    "kv_growth_tokens_per_s",
    "waiting_prefill_tokens",
    "running_requests",
    "queued_requests",
    "preemptions_per_s",
    "predicted_ttft_s",
    "predicted_tpot_s",
    "predicted_prefill_s_per_token",
    "started_at",
    "updated_at",
)


class FencedError(Exception):
    """A write carried an epoch older than the stored one: the writer is a zombie whose
    endpoint id was registered again by its successor. It must stop writing."""

    def __init__(self, endpoint_id: str, held_epoch: int, current_epoch: int) -> None:
        super().__init__(
            f"endpoint {endpoint_id!r}: epoch {held_epoch} is fenced by epoch {current_epoch}"
        )
        self.endpoint_id = endpoint_id
        self.held_epoch = held_epoch
        self.current_epoch = current_epoch


class HeartbeatStatus(enum.StrEnum):
    OK = "ok"
    STALE = "stale"  # version not above the stored one: a duplicate or a reordered beat
    FENCED = "fenced"  # a newer epoch holds the endpoint id (raised as FencedError)
    UNKNOWN = "unknown"  # no record of this epoch: register again
    EXPIRED = "expired"  # the lease lapsed by server time; the record is gone: register


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """What the store holds after a heartbeat (the stored epoch and version when not OK)."""

    status: HeartbeatStatus
    epoch: int
    version: int
    lifecycle: str
    lease_expires_ms: int

    @property
    def must_register(self) -> bool:
        return self.status in (HeartbeatStatus.UNKNOWN, HeartbeatStatus.EXPIRED)


@dataclass(frozen=True, slots=True)
class Reaped:
    """One reaper pass: what left at `server_time_ms` (Redis server time)."""

    server_time_ms: int
    endpoints: tuple[str, ...]
    hot_prefixes: tuple[int, ...]


class EndpointRegistry:
    """One pool's endpoints in Redis. Cheap to create; share the `Redis` client."""

    def __init__(
        self, redis: RedisClient, pool: str, *, feed_maxlen: int = 50_000, reap_limit: int = 1000
    ) -> None:
        if feed_maxlen < 100 or reap_limit < 1:
            raise ValueError("feed_maxlen must be at least 100 and reap_limit at least 1")
        self.redis = redis
        self.keys = PoolKeys(pool)
        self.pool = pool
        self.feed_maxlen = feed_maxlen
        self.reap_limit = reap_limit

    # --- writers: sidecars and the operator -------------------------------------------

    def _blob(self, state: EndpointState) -> bytes:
        """Encode a state after checking it, so that nothing invalid is ever stored."""
        if not isinstance(state, EndpointState):
            raise SchemaError(f"expected an EndpointState, got {type(state).__name__}")
        if state.schema != SCHEMA_VERSION:
            raise SchemaError(
                f"EndpointState has schema version {state.schema}; this build writes "
                f"{SCHEMA_VERSION}"
            )
        if state.pool != self.pool:
            raise SchemaError(f"state of pool {state.pool!r} written to pool {self.pool!r}")
        check_name("endpoint id", state.endpoint_id)
        for name in _NON_NEGATIVE:
            value = getattr(state, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise SchemaError(f"EndpointState.{name} must be finite and >= 0, got {value!r}")
        if state.lifecycle is Lifecycle.GONE:
            raise SchemaError("a live endpoint cannot report lifecycle 'gone'; deregister it")
        blob = encode(state)
        decode(blob, EndpointState)  # strict types: a str where an int belongs fails here
        return blob

    async def register(
        self, state: EndpointState, ttl_s: float, *, epoch_floor: int = 0
    ) -> EndpointState:
        """Register `state.endpoint_id` and start its lease.

        Returns the state with its new epoch (above `epoch_floor` and every epoch handed
        out before in this pool) and version 1. A previous holder of the id is fenced.
        """
        blob = self._blob(state)
        epoch, _lease, _mv, _entry = await _REGISTER(
            self.redis,
            self.keys.endpoint_keys,
            (
                state.endpoint_id,
                max(0, int(epoch_floor)),
                state.lifecycle.value,
                blob,
                ttl_ms("lease", ttl_s),
                self.feed_maxlen,
            ),
        )
        return msgspec.structs.replace(state, epoch=int(epoch), version=1)

    def _heartbeat_args(self, state: EndpointState, ttl_ms: int) -> tuple[Any, ...]:
        return (
            state.endpoint_id,
            state.epoch,
            state.version,
            state.lifecycle.value,
            self._blob(state),
            ttl_ms,
            self.feed_maxlen,
        )

    async def heartbeat(self, state: EndpointState, ttl_s: float) -> HeartbeatResult:
        """Write `state` (its epoch and version decide) and renew the lease.

        Raises `FencedError` if a newer epoch holds the endpoint id. A stale version
        (duplicate or reordered beat) writes nothing and returns status STALE; UNKNOWN and
        EXPIRED mean the caller must register again.
        """
        reply = await _HEARTBEAT(
            self.redis, self.keys.endpoint_keys, self._heartbeat_args(state, ttl_ms("lease", ttl_s))
        )
        result = _heartbeat_result(reply)
        if result.status is HeartbeatStatus.FENCED:
            raise FencedError(state.endpoint_id, state.epoch, result.epoch)
        return result

    async def heartbeat_many(
        self, states: Sequence[EndpointState], ttl_s: float
    ) -> list[HeartbeatResult]:
        """Heartbeats for many endpoints in one pipelined round trip (a simulator, a local
        fleet, the benchmark). FENCED is returned as a status here, not raised."""
        lease_ms = ttl_ms("lease", ttl_s)
        calls = [(self.keys.endpoint_keys, self._heartbeat_args(s, lease_ms)) for s in states]
        replies = await run_batch(self.redis, _HEARTBEAT, calls)
        results = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            results.append(_heartbeat_result(reply))
        return results

    async def drain(self, endpoint_id: str, epoch: int = 0) -> bool:
        """Take the endpoint out of routing for good (it keeps its lease until it leaves).

        `epoch` 0 is the operator's drain; a sidecar passes its own epoch and is fenced
        like any other write. Returns False if the endpoint is not registered.
        """
        check_name("endpoint id", endpoint_id)
        done = await _DRAIN(
            self.redis, self.keys.endpoint_keys, (endpoint_id, int(epoch), self.feed_maxlen)
        )
        if done == -1:
            raise FencedError(endpoint_id, epoch, await self._current_epoch(endpoint_id))
        return bool(done)

    async def deregister(self, endpoint_id: str, epoch: int) -> bool:
        """Remove the endpoint (clean shutdown). Only the current epoch's holder may."""
        check_name("endpoint id", endpoint_id)
        done = await _DEREGISTER(
            self.redis, self.keys.endpoint_keys, (endpoint_id, int(epoch), self.feed_maxlen)
        )
        if done == -1:
            raise FencedError(endpoint_id, epoch, await self._current_epoch(endpoint_id))
        return bool(done)

    async def _current_epoch(self, endpoint_id: str) -> int:
        raw = await self.redis.hget(self.keys.state, endpoint_id)
        return parse_meta(raw).epoch if isinstance(raw, bytes) else 0

    async def reap(self) -> Reaped:
        """Remove endpoints whose lease lapsed and hot-prefix overrides that expired, by
        Redis server time (at most `reap_limit` of each per call)."""
        reply = await _REAP(
            self.redis,
            (*self.keys.endpoint_keys, self.keys.hot, self.keys.hot_expiry),
            (self.reap_limit, self.feed_maxlen),
        )
        now = int(reply[0])
        items = [as_text(x) for x in reply[1:]]
        split = items.index("")
        return Reaped(now, tuple(items[:split]), tuple(int(k) for k in items[split + 1 :]))

    # --- hot-prefix overrides -----------------------------------------------------------

    async def set_hot_prefix(
        self, key: int, extra_owners: Sequence[str], ttl_s: float
    ) -> HotPrefixOverride:
        """Give prefix `key` extra owners until `ttl_s` from now (server time)."""
        owners = tuple(check_name("endpoint id", o) for o in extra_owners)
        if not owners:
            raise ValueError("a hot-prefix override needs at least one extra owner")
        version, expires = await _HOT_SET(
            self.redis,
            (self.keys.hot, self.keys.hot_expiry, self.keys.counters, self.keys.changes),
            (_prefix_key(key), encode(HotPrefix(extra_owners=owners)), ttl_ms("hot-prefix", ttl_s),
             self.feed_maxlen),
        )  # fmt: skip
        return HotPrefixOverride(key, owners, int(version), int(expires))

    async def remove_hot_prefix(self, key: int) -> bool:
        version = await _HOT_REMOVE(
            self.redis,
            (self.keys.hot, self.keys.hot_expiry, self.keys.counters, self.keys.changes),
            (_prefix_key(key), self.feed_maxlen),
        )
        return bool(version)

    # --- readers ------------------------------------------------------------------------

    async def server_time_ms(self) -> int:
        """Redis server time on the node that holds the pool."""
        return await server_time_ms(self.redis, self.keys.counters)

    async def snapshot(self) -> StoredPool:
        """The whole pool, read atomically (one script), with its feed position."""
        raw_fields, last, counters, raw_hot, (sec, usec) = await _SNAPSHOT(
            self.redis,
            (self.keys.state, self.keys.counters, self.keys.changes, self.keys.hot),
            (),
        )
        fields, hot = _pairs(raw_fields), _pairs(raw_hot)
        endpoints, leases = {}, {}
        for raw_id, raw in fields.items():
            if raw_id.endswith(b"#"):
                continue
            blob = fields.get(raw_id + b"#")
            try:
                meta = parse_meta(raw)
            except ValueError as exc:
                log.warning("leaving out endpoint %r: unreadable record (%s)", raw_id, exc)
                continue
            state = None if blob is None else endpoint_from_store(blob, meta)
            if state is not None:
                endpoint_id = raw_id.decode()
                endpoints[endpoint_id] = state
                leases[endpoint_id] = meta.lease_expires_ms
        overrides = {}
        for raw_key, raw in hot.items():
            override = hot_prefix_from_store(raw_key, raw)
            if override is not None:
                overrides[override.key] = override
        inc, mv, hv = counters
        return StoredPool(
            pool=self.pool,
            position=FeedPosition(inc.decode() if inc else "", _last_seq(last)),
            membership_version=int(mv or 0),
            endpoints=endpoints,
            lease_expires_ms=leases,
            hot_prefixes=HotPrefixTable(int(hv or 0), overrides),
            server_time_ms=int(sec) * 1000 + int(usec) // 1000,
        )

    async def changes(self, after: FeedPosition, limit: int = 1000) -> ChangeBatch:
        """Changes after `after`, oldest first, at most `limit`; or `resync` set when
        `after` cannot be continued (trimmed feed, other incarnation)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        raw_inc, last, entries, (sec, usec) = await _CHANGES(
            self.redis, (self.keys.counters, self.keys.changes), (f"0-{after.seq + 1}", limit)
        )
        now = int(sec) * 1000 + int(usec) // 1000
        seq = _last_seq(last)
        incarnation = raw_inc.decode() if raw_inc else ""
        current = FeedPosition(incarnation, seq)
        # A reader that saw an empty pool (no feed yet) continues into any incarnation.
        same = incarnation == after.incarnation or after == FeedPosition()
        in_step = same and seq >= after.seq
        if in_step and seq == after.seq:
            return ChangeBatch(after, (), False, False, now)
        first = int(entries[0][0].split(b"-", 1)[1]) if entries else 0
        if not in_step or first != after.seq + 1:
            return ChangeBatch(current, (), True, False, now)
        changes = tuple(parse_change(entry_id, _pairs(fields)) for entry_id, fields in entries)
        position = FeedPosition(incarnation, changes[-1].seq)
        return ChangeBatch(position, changes, False, position.seq < seq, now)

    async def wait_for_change(self, after: FeedPosition, block_ms: int) -> bool:
        """Block up to `block_ms` until the feed has an entry after `after`; True if so.

        Uses the stream's own blocking read, so a follower wakes on the change instead of
        polling. Keep `block_ms` below the client's command timeout.
        """
        reply = await self.redis.xread(
            {self.keys.changes: f"0-{after.seq}"}, count=1, block=max(1, block_ms)
        )
        return bool(reply)


def _last_seq(last: list[Any]) -> int:
    """The feed's position from XREVRANGE ... COUNT 1 (0 for an empty feed)."""
    return int(last[0][0].split(b"-", 1)[1]) if last else 0


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """A hash or a stream entry's fields from a script's flat [field, value, ...] reply."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _prefix_key(key: int) -> str:
    if not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError(f"a prefix key is an unsigned 64-bit integer, got {key!r}")
    return str(key)


def _heartbeat_result(reply: list[Any]) -> HeartbeatResult:
    status, epoch, version, lifecycle, lease = reply
    return HeartbeatResult(
        HeartbeatStatus(as_text(status)), int(epoch), int(version), as_text(lifecycle), int(lease)
    )
