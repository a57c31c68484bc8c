"""Prefill→decode handoff-credit decisions as pure Python: what `lua/credit_issue.lua`,
`credit_consume.lua` and `credit_expire.lua` decide in Redis, on a caller's clock.

`CreditLedger` holds what the scripts keep — each decode class's budget and the bytes
outstanding credits promise on it, and the credits with their expiry — and applies the
scripts' rules in their order: an issue first sweeps at most `sweep_limit` lapsed credits
(earliest expiry first, ties by id), is idempotent per credit id, and is refused when the
class has no budget, when the credit is larger than the largest single decode endpoint
could admit (a handoff lands on one engine: free KV spread thinly over many is no room),
or when the class's budget is promised (Retry-After, for both: until the next credit
expires). The fleet simulator takes its handoff credits here; `tests/controlplane/
test_credit_rules_differential.py` checks it against the real scripts.

`decode_budget` computes what a budget publisher sets from the decode pool's endpoints.

Times are server milliseconds (integers), as in the scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from controlplane.contract.models import WatermarkState
from controlplane.contract.policy import KVPolicy

if TYPE_CHECKING:
    from controlplane.routing.snapshot import PoolSnapshot


@dataclass(frozen=True, slots=True)
class Credit:
    decode_class: str
    kv_bytes: int
    expires_ms: int


@dataclass(frozen=True, slots=True)
class CreditDecision:
    """Issued (`credit` set) or refused: `reason` 'unknown_class',
    'too_large_for_any_endpoint' or 'insufficient' for an issue, 'unknown' or 'expired'
    for a consume; `retry_after_ms` -1 when waiting cannot help."""

    credit: Credit | None
    reason: str = ""
    retry_after_ms: int = -1

    @property
    def granted(self) -> bool:
        return self.credit is not None


@dataclass
class CreditLedger:
    """One pool's handoff credits and its decode classes' budgets."""

    sweep_limit: int = 100
    budgets: dict[str, int] = field(default_factory=dict)
    largest: dict[str, int] = field(default_factory=dict)
    outstanding: dict[str, int] = field(default_factory=dict)
    credits: dict[str, Credit] = field(default_factory=dict)

    def set_budget(
        self, decode_class: str, kv_bytes: int, largest_bytes: int | None = None
    ) -> None:
        """How many KV bytes outstanding credits may promise on `decode_class`, and the
        most one credit may promise (its largest endpoint's room; None: no such bound)."""
        self.budgets[decode_class] = kv_bytes
        if largest_bytes is None:
            self.largest.pop(decode_class, None)
        else:
            self.largest[decode_class] = largest_bytes

    def issue(
        self, credit_id: str, decode_class: str, kv_bytes: int, ttl_ms: int, now_ms: int
    ) -> CreditDecision:
        """Promise `kv_bytes` on `decode_class` until `now_ms + ttl_ms`; issuing again under
        the same id returns the same credit."""
        self.expire(now_ms)
        existing = self.credits.get(credit_id)
        if existing is not None:
            return CreditDecision(existing)
        cap = self.budgets.get(decode_class)
        if cap is None:
            return CreditDecision(None, "unknown_class")
        out = self.outstanding.get(decode_class, 0)
        if kv_bytes > self.largest.get(decode_class, kv_bytes):
            return CreditDecision(None, "too_large_for_any_endpoint", self._wait(now_ms))
        if out + kv_bytes > cap:
            return CreditDecision(None, "insufficient", self._wait(now_ms))
        credit = Credit(decode_class, kv_bytes, now_ms + ttl_ms)
        self.credits[credit_id] = credit
        self.outstanding[decode_class] = out + kv_bytes
        return CreditDecision(credit)

    def _wait(self, now_ms: int) -> int:
        """Until the next credit expires (-1: none outstanding)."""
        nearest = min((c.expires_ms for c in self.credits.values()), default=None)
        return -1 if nearest is None else max(0, nearest - now_ms)

    def consume(self, credit_id: str, now_ms: int) -> CreditDecision:
        """Take a credit, once: its bytes go back to the budget either way."""
        credit = self.credits.get(credit_id)
        if credit is None:
            return CreditDecision(None, "unknown")
        self._drop(credit_id, credit)
        if credit.expires_ms <= now_ms:
            return CreditDecision(None, "expired")
        return CreditDecision(credit)

    def expire(self, now_ms: int) -> int:
        """Expire at most `sweep_limit` lapsed credits, earliest first; returns how many."""
        lapsed = sorted(
            (c.expires_ms, credit_id)
            for credit_id, c in self.credits.items()
            if c.expires_ms <= now_ms
        )[: self.sweep_limit]
        for _, credit_id in lapsed:
            self._drop(credit_id, self.credits[credit_id])
        return len(lapsed)

    def _drop(self, credit_id: str, credit: Credit) -> None:
        del self.credits[credit_id]
        self.outstanding[credit.decode_class] -= credit.kv_bytes


# How often a decode pool's router publishes its budget: the wait worth suggesting when no
# outstanding credit's expiry is a better one.
BUDGET_PERIOD_S: Final = 1.0


def credit_refusal(reason: str, retry_after_s: float | None) -> tuple[int, str, float | None]:
    """How a prefill pool's router answers a refused credit: (HTTP status, reason,
    Retry-After). A decode class with no budget at all is unavailable; otherwise the
    budget frees as credits expire or the next publication comes, so it is an overload."""
    if reason == "unknown_class":
        return 503, "no_decode_capacity", None
    return 429, "decode_credit", BUDGET_PERIOD_S if retry_after_s is None else retry_after_s


def endpoint_headroom_tokens(
    capacity_tokens: int,
    committed_tokens: int,
    watermark: WatermarkState,
    kv: KVPolicy,
) -> int:
    """The longest prompt an endpoint's sidecar would admit now: none at critical or
    worse (it admits nothing new), else capacity less its safety margin
    (`KVPolicy.safety_tokens`) less what is used and reserved for growth."""
    if watermark.rank >= WatermarkState.CRITICAL.rank:
        return 0
    return max(0, capacity_tokens - kv.safety_tokens(capacity_tokens) - committed_tokens)


def decode_budget(
    snapshot: PoolSnapshot, now: float, kv: KVPolicy, kv_bytes_per_token: int
) -> tuple[int, int]:
    """A decode pool's credit budget from the router's view of it: (the class cap, the
    largest single endpoint's room), in KV bytes, for `set_budget`. Only endpoints the
    router may send to count: lease valid and ready (not draining), as the routing
    filters `LeaseValid` and `NotDraining` decide."""
    rooms = [
        endpoint_headroom_tokens(e.kv_capacity_tokens, e.kv_committed_tokens, e.state.watermark, kv)
        for e in snapshot.endpoints
        if e.lease_deadline > now and e.routable
    ]
    return sum(rooms) * kv_bytes_per_token, max(rooms, default=0) * kv_bytes_per_token
