"""The tenants' virtual counters that the router's fair queue and the sidecar's admission
queue both order by: weights, the lift of a tenant that becomes active, settling."""

from __future__ import annotations

import math

import pytest

from controlplane.contract import TenantQuota
from controlplane.rules.fairness import Charge, VirtualCounters, kv_cost, tenant_weights


def test_service_counts_divided_by_the_tenants_weight() -> None:
    weights = tenant_weights([TenantQuota(name="gold", weight=2.0), TenantQuota(name="iron")])
    assert weights == {"gold": 2.0, "iron": 1.0}
    counters = VirtualCounters(weights)
    counters.charge("gold", 1000.0)
    counters.charge("iron", 1000.0)
    counters.charge("other", 1000.0)  # a tenant the policy does not list weighs 1
    assert [counters.counter(t) for t in ("gold", "iron", "other")] == [500.0, 1000.0, 1000.0]


def test_a_tenant_that_becomes_active_cannot_bank_its_idle_time() -> None:
    counters = VirtualCounters()
    counters.charge("busy", 900.0)
    counters.charge("steady", 400.0)
    counters.join("idle", ["busy", "steady"])  # lifted to the least active counter
    assert counters.counter("idle") == 400.0
    counters.join("busy", [])  # nothing active: the least of all; never lowered
    assert counters.counter("busy") == 900.0


def test_a_charge_is_settled_to_what_the_request_really_pinned() -> None:
    counters = VirtualCounters({"gold": 2.0})
    charge = Charge.placed("gold", 1000, 200, now=10.0, tpot_s=0.01)
    counters.charge("gold", charge.estimate)
    counters.settle(charge, 40, now=12.0)
    assert counters.counter("gold") == pytest.approx(kv_cost(1000, 40, 2.0) / 2)


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan, math.inf])
def test_a_weight_that_is_not_a_positive_number_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="'t': weight must be a positive number"):
        VirtualCounters({"t": weight})
