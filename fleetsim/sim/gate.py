"""Weir's router gate in the simulator: tenant quotas and handoff credits, decided by the
control plane's pure rules and refused the way the router refuses.

The live router (`controlplane.router.app`) charges a request's tenant quota — one unit
of concurrency, the prompt's input tokens and its `max_tokens` of output tokens — before
anything else, then on a prefill pool takes a decode handoff credit for the prompt's KV
bytes; a credit refusal hands the quota charge back unused. Both decisions are Lua
scripts in Redis; here they are `QuotaLedger` and `CreditLedger`, the same rules as pure
Python (checked against the scripts by the control plane's differential tests), on the
simulator's clock in milliseconds. Refusals carry the router's status, reason and
Retry-After, from the same mappings (`quota_refusal`, `credit_refusal`). When the
request ends its charge is released with what it used, so unused output tokens flow back;
its credit goes back when its handoff lands or, failing that, when it ends.
"""

from __future__ import annotations

import functools
from typing import Final

from controlplane.contract import PoolPolicy
from controlplane.routing import Refusal
from controlplane.rules.credits import CreditLedger, credit_refusal
from controlplane.rules.quotas import QuotaLedger, quota_refusal
from fleetsim.sim.flight import SimFlight

HOLDER = "router-sim"
# The router's defaults: the quota holder's lease (renewed at a third of it) and a
# handoff credit's time to live.
HOLDER_TTL_MS: Final = 15_000
CREDIT_TTL_MS: Final = 30_000
DECODE_CLASS = "decode"


def _ms(now: float) -> int:
    return round(now * 1000)


class RouterGate:
    """Quota charges (when the pool policy declares tenants) and, on a disaggregated
    fleet, decode handoff credits."""

    def __init__(self, policy: PoolPolicy, kv_bytes_per_token: int, credits: bool) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.quotas: QuotaLedger | None = None
        if policy.tenants:
            self.quotas = QuotaLedger()
            for quota in policy.tenants:
                self.quotas.set_quota(quota)
        self.credits = CreditLedger() if credits else None
        self._charged: set[str] = set()

    def renew(self, now: float) -> None:
        """The router's holder lease (the simulated router never dies)."""
        if self.quotas is not None:
            self.quotas.renew(HOLDER, HOLDER_TTL_MS, _ms(now))

    def set_decode_budget(self, kv_bytes: int, largest_bytes: int) -> None:
        if self.credits is not None:
            self.credits.set_budget(DECODE_CLASS, kv_bytes, largest_bytes)

    def admit(self, flight: SimFlight, now: float) -> Refusal | None:
        """Charge the quota, then take the handoff credit; None when both granted."""
        spec, now_ms = flight.spec, _ms(now)
        if self.quotas is not None:
            charge = functools.partial(
                self.quotas.charge,
                spec.tenant,
                HOLDER,
                spec.request_id,
                now_ms,
                concurrency=1,
                input_tokens=spec.input_tokens,
                output_tokens=spec.max_tokens,
            )
            decision = charge()
            if decision.reason == "holder_expired":  # as QuotaGate: renew, charge again
                self.renew(now)
                decision = charge()
            if not decision.granted:
                return Refusal(*quota_refusal(decision.reason, decision.retry_after_s))
            self._charged.add(spec.request_id)
        if self.credits is not None:
            kv_bytes = max(1, spec.input_tokens) * self.kv_bytes_per_token
            credit = self.credits.issue(
                spec.request_id, DECODE_CLASS, kv_bytes, CREDIT_TTL_MS, now_ms
            )
            if not credit.granted:
                self.release(flight, now, unused=True)
                wait_s = None if credit.retry_after_ms < 0 else credit.retry_after_ms / 1000
                return Refusal(*credit_refusal(credit.reason, wait_s))
        return None

    def settle(self, flight: SimFlight, now: float) -> None:
        """The flight's credit is consumed (its handoff landed) or released (it ended, or
        its pair was refused, first): its bytes go back to the budget either way, as the
        router's `HandoffGate.settle` gives them back. A client's retry takes a new one."""
        if self.credits is not None:
            self.credits.consume(flight.rid, _ms(now))

    def release(self, flight: SimFlight, now: float, *, unused: bool = False) -> None:
        """Return the quota charge with what the request used (nothing, if `unused`)."""
        if self.quotas is None or flight.rid not in self._charged:
            return
        self._charged.discard(flight.rid)
        used = (0, 0, 0) if unused else (flight.spec.input_tokens, flight.generated, 0)
        self.quotas.release(HOLDER, flight.rid, _ms(now), used)
