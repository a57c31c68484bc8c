"""A quota holder's side of its charges: the requests it holds charges for, and the releases
Redis has not taken yet.

Both kinds of holder, a router replica (concurrency and token rates) and a sidecar (KV
token-seconds), charge under a lease and release when a request ends. While the holder
lives, nothing else returns its charges: a release lost to a Redis outage would hold the
tenant's quota for good. So a release that fails is never given up. It waits in an outbox
that `settle()`, called by the loop that renews the lease, sends again until Redis takes
it; releases are idempotent per (holder, request id), so one sent twice, or one whose reply
was lost, does no harm.

Some charges the holder cannot account for from its side alone: a charge whose reply was
lost (the request was refused, but the script ran), or a release taken by a master that
failed over before its replica had it. After any failed store call, the next `settle()`
reconciles: it lists the holder's charges in the store and releases those that belong to
no request in flight here and to no release in the outbox. Rate tokens of such a charge
stay spent, as when the reaper returns a dead holder's charges.

At shutdown `close()` makes one bounded attempt at the outbox; what is left comes back
when the holder's lease lapses and a reaper runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisError

from controlplane.store.quotas import Amounts, ChargeResult, QuotaStore

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class _Release:
    """One release in the outbox (a fresh object each time, so a sender removes only the
    entry it sent)."""

    __slots__ = ("used",)

    def __init__(self, used: Amounts | None) -> None:
        self.used = used


class QuotaHolder:
    """`name` is the holder id in the store (unique per process); `lease_ttl_s` its lease."""

    def __init__(self, store: QuotaStore, name: str, lease_ttl_s: float) -> None:
        self.store = store
        self.name = name
        self.lease_ttl_s = lease_ttl_s
        self.in_flight: set[str] = set()  # request ids charged (or maybe charged) here
        self.outbox: dict[str, _Release] = {}  # releases Redis has not taken yet
        self._unsure = False  # a store call failed: reconcile at the next settle

    @property
    def pending(self) -> int:
        """Releases waiting in the outbox."""
        return len(self.outbox)

    async def renew(self) -> None:
        """Start or renew the lease."""
        await self._call(self.store.renew_holder(self.name, self.lease_ttl_s))

    async def charge(
        self,
        tenant: str,
        request_id: str,
        amounts: Amounts,
        republish: Callable[[], Awaitable[None]] | None = None,
    ) -> ChargeResult:
        """Charge `request_id` to `tenant` under this holder.

        What Redis lost is restored and the charge made again, up to twice: a lease the
        store no longer has (renewed), and, with `republish`, a tenant it no longer knows
        (`republish` writes the quotas again). A Redis restarted empty has lost both.

        The request is in flight from before the charge is sent until it is released, or
        refused. A RedisError or OSError leaves it in flight, because the charge may have
        landed: the caller then releases it, or `forget`s it."""
        if request_id in self.outbox:
            # A release of an earlier charge with this id has to land first; otherwise
            # the new charge is taken for a duplicate and the late release returns it.
            await self._send(request_id)
        self.in_flight.add(request_id)
        charge = self.store.charge(tenant, self.name, request_id, amounts)
        result = await self._call(charge)
        for _ in range(2):
            if result.reason == "holder_expired":
                await self.renew()
            elif result.reason == "unknown_tenant" and republish is not None:
                log.warning("the control plane lost tenant quotas; publishing them again")
                await self._call(republish())
            else:
                break
            result = await self._call(self.store.charge(tenant, self.name, request_id, amounts))
        if not result.granted:
            self.in_flight.discard(request_id)
        return result

    def forget(self, request_id: str) -> None:
        """The caller will not release `request_id` (its charge failed, the request was
        refused): the next `settle` releases its charge if it landed after all."""
        self.in_flight.discard(request_id)
        self._unsure = True

    async def release(self, request_id: str, used: Amounts | None = None) -> bool:
        """Return the charge of `request_id`; with `used`, rate tokens charged beyond it
        are refunded. False when Redis did not take it now: the release stays in the
        outbox and `settle` sends it again."""
        self.in_flight.discard(request_id)
        self.outbox[request_id] = _Release(used)
        try:
            await self._send(request_id)
        except (RedisError, OSError) as exc:
            log.warning(
                "quota holder %s: release of %s failed, kept to send again (%s)",
                self.name, request_id, exc,
            )  # fmt: skip
            return False
        return True

    async def settle(self) -> None:
        """Send the releases in the outbox; then, if a store call failed since the last
        settle, reconcile. A Redis error ends it (and is raised): what is left stays."""
        for request_id in list(self.outbox):
            if request_id in self.outbox:
                await self._send(request_id)
        if self._unsure:
            self._unsure = False
            await self.reconcile()

    async def reconcile(self) -> list[str]:
        """Release the charges the store holds for this holder that belong to no request in
        flight here and to no release in the outbox; returns their request ids."""
        held = await self._call(self.store.held(self.name))
        stray = sorted(held - self.in_flight - self.outbox.keys())
        for request_id in stray:
            if request_id not in self.in_flight and request_id not in self.outbox:
                await self._call(self.store.release(self.name, request_id))
        if stray:
            log.warning(
                "quota holder %s: returned %d charges held for no request: %s",
                self.name, len(stray), ", ".join(stray[:10]),
            )  # fmt: skip
        return stray

    async def close(self, timeout_s: float) -> int:
        """One last attempt, bounded by `timeout_s`, to send the outbox (at shutdown).
        Returns the releases left: their charges come back when the lease lapses."""
        try:
            async with asyncio.timeout(timeout_s):
                for request_id in list(self.outbox):
                    if request_id in self.outbox:
                        await self._send(request_id)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning(
                "quota holder %s: %d releases not taken at shutdown (%s); they come back "
                "when its lease lapses", self.name, len(self.outbox), exc or "timed out",
            )  # fmt: skip
        return len(self.outbox)

    async def _send(self, request_id: str) -> None:
        entry = self.outbox.get(request_id)
        if entry is None:
            return
        await self._call(self.store.release(self.name, request_id, entry.used))
        if self.outbox.get(request_id) is entry:
            del self.outbox[request_id]

    async def _call(self, call: Awaitable[_T]) -> _T:
        """Await a store call; a failure makes the next settle reconcile."""
        try:
            return await call
        except (RedisError, OSError):
            self._unsure = True
            raise
