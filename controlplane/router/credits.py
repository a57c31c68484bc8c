"""Prefill→decode handoff credits: a prefill pool admits a request only with decode
capacity promised for it.

Before a P/D pair starts, the router takes a credit for the prompt's KV bytes on the
decode pool's class from the control plane (idempotent under its name); when the handoff
lands on the decode side the router consumes it, and when the request ends before, it
releases it (`settle`): either way its bytes return to the budget at once, while the
decode pool's next published budget counts the KV that landed. A credit nobody settles
(a router that died) expires by Redis server time, so a lost prefill never strands
decode capacity. No credit: 429 `overload`, reason `decode_credit`, with the time until
the next credit expires (or until the budget is published again) as Retry-After; a
decode class with no budget at all: 503.

The budget is the decode pool's: its router publishes, every `BUDGET_PERIOD_S`, what its
routable endpoints' sidecars would admit now (`rules.credits.decode_budget`) — the class
cap and the largest single endpoint's room, which bounds one credit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from controlplane.contract import HandoffCredit, KVPolicy
from controlplane.router.errors import overload, unavailable
from controlplane.router.pool import PoolView
from controlplane.rules.credits import BUDGET_PERIOD_S, credit_refusal, decode_budget
from controlplane.store import CreditRefusal, CreditStore

log = logging.getLogger(__name__)


class HandoffGate:
    def __init__(
        self, store: CreditStore, decode_class: str, kv_bytes_per_token: int, ttl_s: float
    ) -> None:
        self.store = store
        self.decode_class = decode_class
        self.kv_bytes_per_token = kv_bytes_per_token
        self.ttl_s = ttl_s

    async def take(self, request_id: str, prompt_tokens: int) -> HandoffCredit:
        kv_bytes = max(1, prompt_tokens) * self.kv_bytes_per_token
        try:
            got = await self.store.issue(self.decode_class, kv_bytes, self.ttl_s, request_id)
        except (RedisError, OSError) as exc:
            raise unavailable("credit_unavailable", f"handoff credits unreachable: {exc}") from exc
        if not isinstance(got, CreditRefusal):
            return got
        status, reason, retry_after_s = credit_refusal(got.reason, got.retry_after_s)
        if status == 503:
            raise unavailable(
                reason, f"decode class {self.decode_class!r} has no handoff budget ({got.reason})"
            )
        assert retry_after_s is not None  # a 429 always names its wait
        raise overload(
            reason,
            f"decode class {self.decode_class!r} cannot take {kv_bytes} more KV bytes now "
            f"({got.reason})",
            retry_after_s,
        )

    async def settle(self, credit_id: str, *, landed: bool) -> str:
        """Consume a credit (its handoff `landed`) or release it (it never will): its
        bytes go back to the budget now. Returns the outcome: "consumed", "released",
        "expired" (it lapsed first: its bytes went back then) or "unreachable" (the
        control plane was; the credit expires on its own)."""
        try:
            got = await self.store.consume(credit_id)
        except (RedisError, OSError) as exc:
            log.warning("credit %s not settled (it will expire): %s", credit_id, exc)
            return "unreachable"
        if isinstance(got, CreditRefusal):
            return "expired"
        return "consumed" if landed else "released"


async def publish_budget(
    store: CreditStore,
    view: PoolView,
    clock: Callable[[], float],
    kv: KVPolicy,
    kv_bytes_per_token: int,
) -> None:
    """A decode pool's router: publish the pool's handoff budget (its own name is the
    credit class) every `BUDGET_PERIOD_S`, for as long as it runs."""
    while True:
        cap, largest = decode_budget(view.snapshot, clock(), kv, kv_bytes_per_token)
        try:
            await store.set_budget(view.pool, cap, largest)
        except (RedisError, OSError) as exc:
            log.warning("decode pool %s: cannot publish its handoff budget (%s)", view.pool, exc)
        await asyncio.sleep(BUDGET_PERIOD_S)
