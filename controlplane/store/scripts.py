"""Lua scripts: one purpose per `.lua` file, loaded as package data, called by SHA.

Every script is prefixed with `lua/_feed.lua` (the change-feed publisher and the server
clock) and any further preludes it names (`_quota.lua`, `_credit.lua`), so shared pieces
are written once. The SHA is computed locally; a call goes out as EVALSHA and only a
NOSCRIPT reply (a restarted server, a promoted replica, a cluster slot moved to another
primary) makes the client load the source and retry, so the script text crosses the wire
once per server (on a cluster, SCRIPT LOAD goes to every primary).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import NoScriptError

from controlplane.store.connection import RedisClient

Arg = str | bytes | int
_PRELUDE = "_feed.lua"


def _read(name: str) -> str:
    return resources.files("controlplane.store").joinpath("lua", name).read_text()


class LuaScript:
    """One script of the store, ready to run against any connection or pipeline."""

    def __init__(self, name: str, preludes: tuple[str, ...] = ()) -> None:
        self.name = name
        self.source = "\n".join(_read(part) for part in (_PRELUDE, *preludes, name))
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, redis: RedisClient, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(redis)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)

    async def load(self, redis: RedisClient) -> None:
        await redis.script_load(self.source)

    def queue(
        self, pipe: Pipeline | ClusterPipeline, keys: Sequence[str], args: Sequence[Arg]
    ) -> None:
        """Queue an EVALSHA on a pipeline; see `run_batch` for NOSCRIPT handling."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)


@cache
def script(name: str, *preludes: str) -> LuaScript:
    """The script in `lua/<name>` after `lua/_feed.lua` and `preludes`, read and hashed
    once per process."""
    return LuaScript(name, preludes)


async def run_batch(
    redis: RedisClient, lua: LuaScript, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]]
) -> list[Any]:
    """Run many calls of one script in one pipelined round trip.

    Results are in call order; a call that failed holds its exception. After a NOSCRIPT the
    script is loaded and only the calls that did not run are sent again, so no call runs twice.
    """
    results: list[Any] = [None] * len(calls)
    pending = list(range(len(calls)))
    for _attempt in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            for i in pending:
                lua.queue(pipe, *calls[i])
            replies = await pipe.execute(raise_on_error=False)
        missing = []
        for i, reply in zip(pending, replies, strict=True):
            results[i] = reply
            if isinstance(reply, NoScriptError):
                missing.append(i)
        if not missing:
            break
        await lua.load(redis)
        pending = missing
    return results


async def server_time_ms(redis: RedisClient, key: str) -> int:
    """Redis server time, in ms, on the node that holds `key` (leases and expiries are
    measured by that node's clock; on a cluster, TIME alone may go to another node)."""
    return int(await script("server_time.lua")(redis, (key,), ()))


def as_text(reply: object) -> str:
    """A string from a Redis reply (bytes unless the client decodes responses)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)
