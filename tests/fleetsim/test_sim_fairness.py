"""Fairness by KV cost, end to end in the simulator: Weir's router charges each tenant the
KV token-seconds its requests pin, so a tenant of long answers gets fewer requests through
than one of short answers, in proportion to the memory each holds."""

from __future__ import annotations

import msgspec

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
    more of short's tokens through. The sidecar's local queue holds two requests, so that
    what the router's fair queue lets go is what gets served (with a deep local queue
    its arrival order would decide). Charged by tokens instead (before), 'long' got over
    four times short's KV token-seconds (Jain's index 0.73), short only 1.6x long's tokens."""
    span_s = 60.0
    specs = [
        *_requests("long", 0, 150, 256, 512, span_s),
        *_requests("short", 1_000_000, 1500, 768, 32, span_s),
    ]
    base = default_pool_policy()
    policy = msgspec.structs.replace(
        base, scheduling=msgspec.structs.replace(base.scheduling, local_queue_size=2)
    )
    config = FleetConfig(engines=1, kv_tokens=20_000, drain_s=10.0, policy=policy)
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
