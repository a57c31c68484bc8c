"""Fairness by KV cost, end to end in the simulator: Weir's router and sidecars charge each
tenant the KV token-seconds its requests pin, divided by its weight, so a tenant of long
answers gets fewer requests through than one of short answers, in proportion to the
memory each holds, and a tenant of weight 2 twice the memory of one of weight 1."""

from __future__ import annotations

import msgspec

from controlplane.contract import TenantQuota
from fleetsim.report.metrics import jain_index, kv_service
from fleetsim.sim import FleetConfig, Simulation, policies
from fleetsim.sim.config import default_pool_policy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec


def _requests(
    tenant: str, first_block: int, count: int, prompt: int, output: int, span_s: float
) -> list[RequestSpec]:
    """`count` requests evenly over `span_s`, each its own blocks from `first_block` on
    (no prefix shared)."""
    blocks = -(-prompt // BLOCK_TOKENS)
    return [
        RequestSpec(
            f"{tenant}{i}",
            span_s * i / count,
            tenant,
            0,
            prompt,
            output,
            output,
            tuple(range(first_block + i * blocks, first_block + (i + 1) * blocks)),
        )
        for i in range(count)
    ]


def test_a_long_answer_tenant_and_a_short_answer_tenant_share_kv_seconds_not_tokens() -> None:
    """Two tenants of equal weight, both asking far more than one engine serves for a
    minute: 'long' sends 256-token prompts for 512-token answers, 'short' ten times as
    many 768-token prompts for 32-token answers. A 'long' request holds its KV through
    512 decode steps, a 'short' one through 32, so KV-fair service lets several times
    more of short's tokens through. The sidecar's local queue (256 deep) decides who of
    what the router let go runs, by the same counters. Charged by tokens (d9696e4),
    'long' got over four times short's KV token-seconds (Jain's index 0.73); with the
    sidecar's queue in arrival order (312853a), 2.7 times (0.83); with the sidecar's
    charge leaving out the wait to the first token, on stock SGLang engine flags, 2.3
    times (0.87)."""
    span_s = 60.0
    specs = [
        *_requests("long", 0, 150, 256, 512, span_s),
        *_requests("short", 1_000_000, 1500, 768, 32, span_s),
    ]
    config = FleetConfig(engines=1, kv_tokens=20_000, drain_s=10.0)
    result = Simulation(specs, policies()["weir"](), config).run()

    served = kv_service(result.flights, result.end_s)
    tokens = dict.fromkeys(served, 0)
    for f in result.flights:
        if f.dispatched_at >= 0:
            tokens[f.spec.tenant] += f.spec.input_tokens + f.generated
    # Both tenants wanted more than they got the whole time.
    assert all(any(not f.completed for f in result.flights if f.spec.tenant == t) for t in served)
    assert jain_index(served.values()) >= 0.9
    assert 0.5 <= served["long"] / served["short"] <= 2.0
    assert tokens["short"] >= 3 * tokens["long"]


def test_a_tenant_of_weight_two_gets_twice_the_kv_seconds_of_one_of_weight_one() -> None:
    """Two tenants of the same requests (512-token prompts, 128-token answers), both
    asking far more than one engine serves for a minute; 'iron' arrives first at every
    instant. With 'gold' at weight 2 it gets twice iron's KV token-seconds; with no
    weights anywhere and the sidecar's queue in arrival order (312853a), iron got 1.6x
    gold's, first in every tie."""
    span_s = 60.0
    specs = [
        *_requests("iron", 1_000_000, 600, 512, 128, span_s),
        *_requests("gold", 0, 600, 512, 128, span_s),
    ]
    tenants = (TenantQuota(name="gold", weight=2.0), TenantQuota(name="iron"))
    policy = msgspec.structs.replace(default_pool_policy(), tenants=tenants)
    config = FleetConfig(engines=1, kv_tokens=20_000, drain_s=10.0, policy=policy)
    result = Simulation(specs, policies()["weir"](), config).run()

    served = kv_service(result.flights, result.end_s)
    assert all(any(not f.completed for f in result.flights if f.spec.tenant == t) for t in served)
    assert 1.7 <= served["gold"] / served["iron"] <= 2.3
