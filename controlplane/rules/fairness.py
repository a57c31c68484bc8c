"""Fair shares between tenants by KV cost: the rule the router's queue and the sidecar's
admission queue both order waiting requests by.

In the spirit of the virtual token counter (Sheng et al., "Fairness in Serving Large
Language Models"): each tenant has a counter of the service it received divided by its
weight (`TenantQuota.weight`, 1 for a tenant the pool policy does not list), the tenant
with the smallest counter goes next, and a tenant that becomes active (something of it
waits where nothing did) is lifted to the smallest active counter, so that idle time
cannot be banked into a burst later. A tenant of weight 2 therefore gets twice the
service of one of weight 1 while both wait.

Service is KV cost, not tokens: the KV token-seconds a request pins, its prompt plus its
output growth (reserved from admission on) held for its life (`kv_cost`). A tenant of
long answers pays for the memory it holds while it decodes, which a token count misses:
1,000 output tokens hold their prompt's KV a thousand decode steps. A request is charged
an estimate when it is placed or admitted (`Charge.placed`, from the service times known
then) and the difference to what it really cost when it ends (`VirtualCounters.settle`).
Pure: the caller passes the clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from controlplane.contract import TenantQuota

# The share of its output limit a request is assumed to generate until it ends (the cost
# model's `expected_output_fraction`).
EXPECTED_OUTPUT_FRACTION: Final = 0.5
# The time per output token assumed where none is known yet: the sidecar's own starting
# estimate, before a request has finished there.
UNKNOWN_TPOT_S: Final = 0.02


def kv_cost(prompt_tokens: int, output_tokens: float, held_s: float) -> float:
    """A request's KV cost in token-seconds: its prompt plus its output, the growth its
    endpoint reserves for it from admission on, held for `held_s`. What the router
    exports per tenant (`weir_router_kv_token_seconds_total`) is this, with the output
    generated and the time from dispatch to end."""
    if held_s < 0 or output_tokens < 0:
        raise ValueError(
            f"a KV cost needs output >= 0 and time >= 0, got {output_tokens}, {held_s}"
        )
    return (prompt_tokens + output_tokens) * held_s


def kv_cost_estimate(
    prompt_tokens: int, max_new_tokens: int, ttft_s: float, tpot_s: float
) -> float:
    """The KV cost charged when a request is placed: its expected output (a fixed share
    of its limit) held from dispatch until that output is done — the first token after
    `ttft_s`, then `tpot_s` per token (`UNKNOWN_TPOT_S` where none is known)."""
    output = max_new_tokens * EXPECTED_OUTPUT_FRACTION
    tpot = tpot_s if tpot_s > 0 else UNKNOWN_TPOT_S
    return kv_cost(prompt_tokens, output, max(0.0, ttft_s) + output * tpot)


def tenant_weights(quotas: Iterable[TenantQuota]) -> dict[str, float]:
    """The fair-share weights a pool policy declares (`PoolPolicy.tenants`)."""
    return {quota.name: quota.weight for quota in quotas}


@dataclass(frozen=True, slots=True)
class Charge:
    """What a tenant was charged for one request as it was placed, to settle at its end."""

    tenant: str
    prompt_tokens: int
    estimate: float
    since: float

    @classmethod
    def placed(
        cls,
        tenant: str,
        prompt_tokens: int,
        max_new_tokens: int,
        now: float,
        *,
        ttft_s: float = 0.0,
        tpot_s: float = 0.0,
    ) -> Charge:
        """A request placed at `now`, charged `kv_cost_estimate`."""
        estimate = kv_cost_estimate(prompt_tokens, max_new_tokens, ttft_s, tpot_s)
        return cls(tenant, prompt_tokens, estimate, now)


class VirtualCounters:
    """Each tenant's service so far, divided by its weight."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        for tenant, weight in self.weights.items():
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"tenant {tenant!r}: weight must be a positive number, got {weight!r}"
                )
        self._counters: dict[str, float] = {}
        self.changes = 0  # how many times a counter was set (what orders by them reads)

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def share(self, tenant: str, cost: float) -> float:
        """What `cost` of service adds to `tenant`'s counter."""
        return cost / self.weights.get(tenant, 1.0)

    def join(self, tenant: str, active: Iterable[str]) -> None:
        """`tenant` has something waiting where it had nothing: lifted to the smallest
        counter of the `active` tenants (those with something waiting already), or of
        every tenant when none is."""
        counters = self._counters
        floor = min((counters.get(t, 0.0) for t in active), default=None)
        if floor is None:
            floor = min(counters.values(), default=0.0)
        counters[tenant] = max(counters.get(tenant, 0.0), floor)
        self.changes += 1

    def charge(self, tenant: str, cost: float) -> None:
        """Add service to a tenant's counter (a placement, or a correction, perhaps
        negative, once the real cost is known)."""
        self._counters[tenant] = self.counter(tenant) + self.share(tenant, cost)
        self.changes += 1

    def settle(self, charge: Charge, output_tokens: int, now: float) -> None:
        """The request `charge` was placed for ended at `now` with `output_tokens`
        generated since: its tenant's charge becomes what it really cost."""
        cost = kv_cost(charge.prompt_tokens, output_tokens, max(0.0, now - charge.since))
        self.charge(charge.tenant, cost - charge.estimate)
