"""What a reader of a pool sees: full snapshots, feed positions and change batches.

Epoch, version and lifecycle in each `EndpointState` here are the store's (the fencing
metadata the Lua scripts keep beside the blob), not whatever the sidecar's blob said: a
pool's truth is what the fenced writes left behind, and an operator's drain is visible
before the sidecar's next heartbeat.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from controlplane.contract import EndpointState, Lifecycle, SchemaError, decode
from controlplane.ownership import HotPrefix, HotPrefixOverride, HotPrefixTable, Membership

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EndpointMeta:
    """The fencing metadata the store keeps in front of each endpoint's blob."""

    epoch: int
    version: int
    lifecycle: Lifecycle
    lease_expires_ms: int


def parse_meta(raw: bytes) -> EndpointMeta:
    """Parse a stored `epoch version lifecycle lease_ms` (see lua/_feed.lua)."""
    epoch, version, lifecycle, lease = raw.split(b" ")
    return EndpointMeta(int(epoch), int(version), Lifecycle(lifecycle.decode()), int(lease))


def endpoint_from_store(blob: bytes, meta: EndpointMeta) -> EndpointState | None:
    """The endpoint as the store knows it, or None (logged) if its blob is unreadable.

    An unreadable blob comes from a writer with another schema (a rolling upgrade) or from
    someone writing to Redis by hand: the endpoint is left out of the view, never guessed.
    """
    try:
        state = decode(blob, EndpointState)
    except SchemaError as exc:
        log.warning("leaving out an unreadable endpoint record: %s", exc)
        return None
    return msgspec.structs.replace(
        state, epoch=meta.epoch, version=meta.version, lifecycle=meta.lifecycle
    )


def hot_prefix_from_store(key: bytes | str, raw: bytes) -> HotPrefixOverride | None:
    """Parse a stored `version expires_ms blob` override, or None (logged) if unreadable."""
    try:
        version, expires, blob = raw.split(b" ", 2)
        body = decode(blob, HotPrefix)
        return HotPrefixOverride(int(key), body.extra_owners, int(version), int(expires))
    except (SchemaError, ValueError) as exc:
        log.warning("leaving out an unreadable hot-prefix override: %s", exc)
        return None


@dataclass(frozen=True, slots=True, order=True)
class FeedPosition:
    """A reader's place in a pool's change feed: the last change seen, in one incarnation.

    The incarnation changes when Redis loses the pool's data (a restart without
    persistence): positions from another incarnation are meaningless and force a resync.
    """

    incarnation: str = ""
    seq: int = 0


@dataclass(frozen=True, slots=True)
class StoredPool:
    """One pool as the store holds it, at feed position `position` (what the router builds
    its routing `PoolSnapshot` from, and the operator its observations).

    `server_time_ms` is Redis server time when the snapshot was read (estimated from the
    last read for a follower's view): compare lease expiries with it, never with a local
    clock. Endpoints whose lease lapsed but were not reaped yet are still listed, with
    their expiry, so every reader at one position sees the same membership.
    """

    pool: str
    position: FeedPosition
    membership_version: int
    endpoints: Mapping[str, EndpointState]
    lease_expires_ms: Mapping[str, int]
    hot_prefixes: HotPrefixTable = field(default_factory=HotPrefixTable)
    server_time_ms: int = 0

    def membership(self) -> Membership:
        """Ready endpoints (registered, not draining): the members of the ownership ring."""
        return Membership.of(
            self.membership_version,
            (eid for eid, s in self.endpoints.items() if s.lifecycle is Lifecycle.READY),
        )

    def lease_valid(self, endpoint_id: str, now_ms: int | None = None) -> bool:
        """Whether `endpoint_id` holds a lease at server time `now_ms` (default: the
        snapshot's own server time)."""
        expires = self.lease_expires_ms.get(endpoint_id, 0)
        return expires > (self.server_time_ms if now_ms is None else now_ms)


class ChangeKind(enum.StrEnum):
    UPSERT = "u"
    GONE = "g"
    HOT_SET = "h"
    HOT_REMOVED = "x"


@dataclass(frozen=True, slots=True)
class Change:
    """One entry of the change feed.

    For an endpoint upsert, `endpoint` is the new state (None if its blob is unreadable,
    which a reader treats as the endpoint leaving); for a hot-prefix set, `hot` is the
    override. `key` is the endpoint id or the hot prefix key in decimal.
    """

    seq: int
    kind: ChangeKind
    key: str
    membership_version: int | None  # None: this change left the membership alone
    endpoint: EndpointState | None = None
    lease_expires_ms: int = 0
    hot: HotPrefixOverride | None = None
    hot_version: int = 0


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    """Changes after a position, in order, or an explicit request to resynchronise.

    `resync` is set when the reader's position cannot be continued: the feed was trimmed
    past it, or Redis lost the pool's data (another incarnation). The reader then takes a
    full snapshot. `more` says the batch hit its size limit: ask again from `position`.
    """

    position: FeedPosition
    changes: tuple[Change, ...]
    resync: bool
    more: bool
    server_time_ms: int


def parse_change(entry_id: bytes, fields: Mapping[bytes, bytes]) -> Change:
    """Decode one stream entry written by `publish()` in lua/_feed.lua."""
    seq = int(entry_id.split(b"-", 1)[1])
    raw_kind, raw_key, raw_mv, meta = fields[b"h"].split(b" ", 3)
    kind = ChangeKind(raw_kind.decode())
    key = raw_key.decode()
    mv = None if raw_mv == b"-" else int(raw_mv)
    if kind is ChangeKind.UPSERT:
        record = parse_meta(meta)
        endpoint = endpoint_from_store(fields[b"s"], record)
        return Change(seq, kind, key, mv, endpoint, record.lease_expires_ms)
    if kind is ChangeKind.HOT_SET:
        hot = hot_prefix_from_store(key, meta + b" " + fields[b"s"])
        return Change(seq, kind, key, mv, hot=hot, hot_version=int(meta.split(b" ")[0]))
    if kind is ChangeKind.HOT_REMOVED:
        return Change(seq, kind, key, mv, hot_version=int(meta.split(b" ")[0]))
    return Change(seq, kind, key, mv)
