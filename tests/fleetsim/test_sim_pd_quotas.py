"""P/D disaggregation and tenant quotas in the simulator: prefill on prefill engines, KV
imported on decode engines, Weir's decode handoff credits and tenant quotas decided by
the control plane's pure rules."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest

from controlplane.contract import FinishReason, Role, TenantQuota
from fleetsim.report import is_lost
from fleetsim.sim import FleetConfig, Simulation, default_pool_policy, policies
from fleetsim.sim.flight import SimFlight
from fleetsim.sim.weir import WeirPolicy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec, scenario


def long_request(
    rid: str,
    arrival_s: float,
    tenant: str,
    blocks: int,
    output: int,
    max_tokens: int,
    first_block: int,
    max_wait_s: float,
) -> RequestSpec:
    """A low-priority request of `blocks` distinct prompt blocks (ids from `first_block`)."""
    ids = tuple(range(first_block, first_block + blocks))
    return RequestSpec(
        rid, arrival_s, tenant, 0, blocks * BLOCK_TOKENS, output, max_tokens, ids,
        max_wait_s=max_wait_s,
    )  # fmt: skip


def pd_config(**fields: object) -> FleetConfig:
    return FleetConfig(**{"engines": 4, "prefill_engines": 1, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["round_robin", "sglang_cache_aware", "weir"])
def test_a_pd_fleet_prefills_once_and_decodes_from_imported_kv(name: str) -> None:
    specs = scenario("pd_no_decode_credit").with_duration(4.0).generate(3.0, seed=1)
    sim = Simulation(specs, policies()[name](), pd_config())
    result = sim.run()
    done = [f for f in result.flights if f.completed]
    assert len(done) == len(specs)
    prefill = sim.role_engines(Role.PREFILL)
    decode = sim.role_engines(Role.DECODE)
    # Every prompt was computed on the prefill engine, which generated one token each...
    assert sum(e.model.prompt_tokens_total for e in prefill) == sum(s.input_tokens for s in specs)
    assert sum(e.model.generation_tokens_total for e in prefill) == len(specs)
    # ...and imported, not computed again, on the decode side.
    two_or_more = [f for f in done if f.generated > 1]
    assert sum(e.model.imported_tokens_total for e in decode) == sum(
        f.spec.input_tokens for f in two_or_more
    )
    assert all(f.transfer_s > 0 for f in two_or_more)
    assert all(f.generated == f.spec.generated_tokens for f in done)


def test_without_decode_credit_weir_does_not_prefill() -> None:
    """Decode engines with room for a few long requests: round robin prefills every
    request at once and its KV then waits on the decode queues; Weir refuses prefills it
    cannot hand off (429 decode_credit; these clients retry), so what it prefilled goes
    on decoding soon after."""
    specs = [long_request(f"r{i}", 0.05 * i, "batch", 16, 400, 512, 1000 * i, 120.0)
             for i in range(16)]  # fmt: skip
    config = pd_config(engines=3, kv_tokens=20_000)
    handoff = {}
    for name in ("round_robin", "weir"):
        result = Simulation(specs, policies()[name](), config).run()
        assert all(f.completed for f in result.flights), name
        handoff[name] = max(f.handoff_s for f in result.flights)
        if name == "weir":
            assert any(f.retries for f in result.flights)
    assert handoff["weir"] < handoff["round_robin"] / 4


def test_weir_prefills_only_what_one_decode_engine_can_take() -> None:
    """Two decode engines each hold one 12K-token answer in flight; their free KV adds up
    to another 12K prompt, but no engine alone has it. Round robin prefills the third
    prompt, whose KV then waits for a decode engine; Weir's credit is refused as too
    large for any endpoint (the client retries) and, once granted, hands off at once.
    The prefill engine, idle by then, admits what queued behind a handed-off prompt."""
    specs = [long_request(f"r{i}", arrival, "batch", 24, 2000, 2048, 1000 * i, 300.0)
             for i, arrival in enumerate((0.0, 0.05, 15.0))]  # fmt: skip
    config = pd_config(engines=3, kv_tokens=20_000)
    third = {}
    for name in ("round_robin", "weir"):
        result = Simulation(specs, policies()[name](), config).run()
        assert all(f.completed for f in result.flights), name
        third[name] = next(f for f in result.flights if f.rid == "r2")
    assert third["weir"].retries > 0
    assert third["weir"].handoff_s < third["round_robin"].handoff_s / 10


def test_a_tenant_quota_caps_its_concurrency_and_releases_with_usage() -> None:
    specs = [
        long_request(f"b{i}", 0.01 * i, "bulk", 4, 300, 1024, 100 * i, 120.0) for i in range(8)
    ] + [
        RequestSpec(f"c{i}", 0.01 * i, "chat", 2, BLOCK_TOKENS, 20, 64, (9000 + i,))
        for i in range(4)
    ]
    quotas = (TenantQuota(name="bulk", max_concurrency=2), TenantQuota(name="chat"))
    policy = msgspec.structs.replace(default_pool_policy(), tenants=quotas)
    config = FleetConfig(engines=2, policy=policy)
    weir = policies()["weir"]()
    result = Simulation(specs, weir, config).run()
    assert all(f.completed for f in result.flights)
    bulk = sorted(
        (f for f in result.flights if f.spec.tenant == "bulk"), key=lambda f: f.dispatched_at
    )
    # Never more than two bulk requests at once: each waits for one to end.
    for later, earlier in zip(bulk[2:], bulk, strict=False):
        assert later.dispatched_at >= earlier.finished_at - 1e-9
    assert sum(f.retries for f in bulk) > 0
    assert not any(f.retries for f in result.flights if f.spec.tenant == "chat")
    ledger = weir.gate.quotas
    assert ledger is not None
    assert not ledger.charges  # every charge released
    assert ledger.concurrency["bulk"] == 0


def test_an_interactive_client_takes_the_quota_refusal() -> None:
    specs = [
        RequestSpec(f"c{i}", 0.0, "chat", 2, BLOCK_TOKENS, 200, 256, (9000 + i,)) for i in range(3)
    ]
    policy = msgspec.structs.replace(
        default_pool_policy(), tenants=(TenantQuota(name="chat", max_concurrency=1),)
    )
    result = Simulation(specs, policies()["weir"](), FleetConfig(engines=1, policy=policy)).run()
    reasons = Counter(f.reason for f in result.flights)
    assert reasons == {FinishReason.STOP: 1, FinishReason.OVERLOAD: 2}
    assert {f.detail for f in result.flights if f.reason is FinishReason.OVERLOAD} == {
        "router: 429 concurrency"
    }


@pytest.mark.parametrize("name", ["least_outstanding", "weir"])
def test_pd_and_quota_runs_are_deterministic_for_a_seed(name: str) -> None:
    specs = scenario("pd_no_decode_credit").with_duration(6.0).generate(4.0, seed=2)
    policy = msgspec.structs.replace(
        default_pool_policy(),
        tenants=(
            TenantQuota(name="batch", max_concurrency=2),
            *(TenantQuota(name=f"chat-{c}") for c in "abcd"),
        ),
    )
    config = pd_config(policy=policy)
    runs = [Simulation(specs, policies(seed=1)[name](), config).run() for _ in range(2)]
    outcomes = [
        [
            (f.rid, f.reason, f.first_token_at, f.finished_at, f.retries, f.handoff_s)
            for f in r.flights
        ]
        for r in runs
    ]
    assert outcomes[0] == outcomes[1]


class _Landings(Simulation):
    """Where each handoff's KV was imported (the engine a flight with `kv_ready` went to)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.landed: dict[str, int] = {}

    def submit(self, flight: SimFlight, engine: int, now: float, priority: int = 0) -> bool:
        if flight.kv_ready:
            self.landed.setdefault(flight.rid, engine)
        return super().submit(flight, engine, now, priority)


def test_weir_picks_the_decode_engine_at_dispatch_and_loses_no_handoff() -> None:
    """Two decode engines with room for two or three of these prompts and answers at a
    time, patient clients, and a resume wait of 5 s. Picking the decode engine once the
    KV has moved, a handoff waited past that for room and was lost; the live router picks
    it with the prefill (429 `decode_saturated` while none has room: the client retries)
    and the decode sidecar holds room for the prompt's KV until it lands there."""
    specs = [
        long_request(f"r{i}", 0.5 * i, "batch", 16 + 4 * (i % 3), 1500, 1600, 1000 * i, 300.0)
        for i in range(12)
    ]
    base = default_pool_policy()
    routing = msgspec.structs.replace(base.routing, resume_wait_s=5.0)
    config = pd_config(
        engines=3, kv_tokens=20_000, policy=msgspec.structs.replace(base, routing=routing)
    )
    sim = _Landings(specs, policies()["weir"](), config)
    result = sim.run()
    assert not [f.rid for f in result.flights if is_lost(f)]
    assert all(f.completed for f in result.flights)
    assert sum(f.retries for f in result.flights) > 0  # the decode side was full at times
    assert len(sim.landed) == len(specs)
    for flight in result.flights:
        assert flight.decode_endpoint == f"engine-{sim.landed[flight.rid]}"
    weir = sim.policy
    assert isinstance(weir, WeirPolicy)
    assert not weir._pairs  # every room held for a pair was taken by its handoff
    assert all(not s.reservations.held_tokens for s in weir.sidecars)
