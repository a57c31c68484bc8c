"""The command channel: a Redis stream per endpoint, read by its sidecar.

The operator and routers send drain, pause/resume admission, preempt (a request or a
tenant's requests) and set-priority commands. A command id is appended at most once (a
guard key remembers it), the sidecar reads through a consumer group and acknowledges what
it executed, and whatever stays unacknowledged longer than `redeliver_after_s` (its reader
crashed, or never acked) is delivered again, to any reader of the group. A sidecar still
executes a command id at most once: it remembers the ids it executed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from controlplane.contract import Command, SchemaError, decode, encode
from controlplane.store.connection import RedisClient
from controlplane.store.keys import PoolKeys, check_name
from controlplane.store.scripts import as_text, script

log = logging.getLogger(__name__)
_SEND = script("command_send.lua")
GROUP = "sidecar"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One command as read from the stream; acknowledge it by `entry_id`."""

    entry_id: str
    command: Command
    redelivered: bool


class CommandChannel:
    """Commands of one pool's endpoints."""

    def __init__(
        self,
        redis: RedisClient,
        pool: str,
        *,
        maxlen: int = 10_000,
        remember_ids_s: float = 3600.0,
        redeliver_after_s: float = 30.0,
    ) -> None:
        self.redis = redis
        self.pool = pool
        self.keys = PoolKeys(pool)
        self.maxlen = maxlen
        self.remember_ids_ms = max(1, round(remember_ids_s * 1000))
        self.redeliver_after_ms = max(1, round(redeliver_after_s * 1000))
        self._groups: set[str] = set()

    async def send(self, command: Command) -> bool:
        """Append `command` to its endpoint's stream; False if this id was sent before."""
        if not isinstance(command, Command):
            raise SchemaError(f"expected a Command, got {type(command).__name__}")
        if command.pool != self.pool:
            raise SchemaError(f"command for pool {command.pool!r} sent to pool {self.pool!r}")
        check_name("command id", command.command_id)
        blob = encode(command)
        decode(blob, Command)  # strict types and schema, before anything is written
        appended, _entry = await _SEND(
            self.redis,
            (self.keys.commands(command.endpoint_id), self.keys.command_id(command.command_id)),
            (blob, self.remember_ids_ms, self.maxlen),
        )
        return bool(int(appended))

    async def _ensure_group(self, stream: str) -> None:
        if stream in self._groups:
            return
        try:
            await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(stream)

    async def receive(
        self, endpoint_id: str, consumer: str, *, count: int = 16, block_s: float = 0.0
    ) -> list[Delivery]:
        """Commands for `endpoint_id`: first any left unacknowledged for too long, then new
        ones (waiting up to `block_s` for one). Unreadable entries are logged and
        acknowledged so they cannot block the stream."""
        stream = self.keys.commands(endpoint_id)
        check_name("consumer", consumer)
        await self._ensure_group(stream)
        try:
            entries, redelivered = await self._read(stream, consumer, count, block_s)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost the stream (a restart without persistence): start it again.
            self._groups.discard(stream)
            await self._ensure_group(stream)
            entries, redelivered = await self._read(stream, consumer, count, block_s)
        deliveries = []
        for entry_id, fields in entries:
            eid = as_text(entry_id)
            try:
                command = decode(fields[b"c"], Command)
            except (SchemaError, KeyError, TypeError) as exc:
                log.warning("dropping unreadable command %s on %s: %s", eid, stream, exc)
                await self.redis.xack(stream, GROUP, eid)
                continue
            deliveries.append(Delivery(eid, command, redelivered))
        return deliveries

    async def _read(
        self, stream: str, consumer: str, count: int, block_s: float
    ) -> tuple[list[Any], bool]:
        """(entries, redelivered): overdue unacknowledged entries, else new ones."""
        claimed: Any = await self.redis.xautoclaim(
            stream, GROUP, consumer, self.redeliver_after_ms, "0-0", count=count
        )
        if claimed[1]:
            return list(claimed[1]), True
        read: Any = await self.redis.xreadgroup(
            GROUP,
            consumer,
            {stream: ">"},
            count=count,
            block=None if block_s <= 0 else max(1, round(block_s * 1000)),
        )
        return (list(read[0][1]) if read else []), False

    async def ack(self, endpoint_id: str, entry_id: str) -> bool:
        """Acknowledge an executed command; False if it was not pending."""
        return bool(await self.redis.xack(self.keys.commands(endpoint_id), GROUP, entry_id))

    async def pending(self, endpoint_id: str) -> int:
        """Commands delivered but not yet acknowledged."""
        stream = self.keys.commands(endpoint_id)
        await self._ensure_group(stream)
        info = await self.redis.xpending(stream, GROUP)
        return int(info["pending"])
