"""Prefill→decode handoff-credit decisions as pure Python: what `lua/credit_issue.lua`,
`credit_consume.lua` and `credit_expire.lua` decide in Redis, on a caller's clock.

`CreditLedger` holds what the scripts keep — each decode class's budget and the bytes
outstanding credits promise on it, and the credits with their expiry — and applies the
scripts' rules in their order: an issue first sweeps at most `sweep_limit` lapsed credits
(earliest expiry first, ties by id), is idempotent per credit id, and is refused when the
class has no budget or its budget is promised (Retry-After: until the next credit
expires). The fleet simulator takes its handoff credits here; `tests/controlplane/
test_credit_rules_differential.py` checks it against the real scripts.

Times are server milliseconds (integers), as in the scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Credit:
    decode_class: str
    kv_bytes: int
    expires_ms: int


@dataclass(frozen=True, slots=True)
class CreditDecision:
    """Issued (`credit` set) or refused: `reason` 'unknown_class' or 'insufficient' for
    an issue, 'unknown' or 'expired' for a consume; `retry_after_ms` -1 when waiting
    cannot help."""

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
    outstanding: dict[str, int] = field(default_factory=dict)
    credits: dict[str, Credit] = field(default_factory=dict)

    def set_budget(self, decode_class: str, kv_bytes: int) -> None:
        """How many KV bytes outstanding credits may promise on `decode_class`."""
        self.budgets[decode_class] = kv_bytes

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
        if out + kv_bytes > cap:
            nearest = min((c.expires_ms for c in self.credits.values()), default=None)
            wait = -1 if nearest is None else max(0, nearest - now_ms)
            return CreditDecision(None, "insufficient", wait)
        credit = Credit(decode_class, kv_bytes, now_ms + ttl_ms)
        self.credits[credit_id] = credit
        self.outstanding[decode_class] = out + kv_bytes
        return CreditDecision(credit)

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
