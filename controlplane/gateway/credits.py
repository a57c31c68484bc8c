"""Prefill→decode handoff credits: a prefill pool admits a request only with decode
capacity promised for it.

Before a prefill is sent, the router takes a credit for the prompt's KV bytes on the
decode pool's class from the control plane (idempotent under the request id); the credit
id travels upstream in `x-weir-handoff-credit` for the decode side to consume. A credit
nobody consumes expires by Redis server time and its bytes return to the budget, so a
lost prefill never strands decode capacity. No credit: 429 `overload`, reason
`decode_credit`, with the time until the next credit expires as Retry-After.
"""

from __future__ import annotations

from redis.exceptions import RedisError

from controlplane.contract import HandoffCredit
from controlplane.contract import headers as wire
from controlplane.gateway.errors import overload, unavailable
from controlplane.store import CreditRefusal, CreditStore

CREDIT_HEADER = wire.HANDOFF_CREDIT


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
        if got.retry_after_s is None:
            raise unavailable(
                "no_decode_capacity",
                f"decode class {self.decode_class!r} has no handoff budget ({got.reason})",
            )
        raise overload(
            "decode_credit",
            f"decode class {self.decode_class!r} cannot take {kv_bytes} more KV bytes now",
            got.retry_after_s,
        )
