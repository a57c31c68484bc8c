"""The fused decision loop decides exactly as the plugins run one by one: same pick,
same total score, same fallbacks, same rejection counts, over random pools, requests and
profiles built from the built-in plugins, near-ties spread or not."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.contract import EndpointState, Lifecycle, Role, WatermarkState
from controlplane.routing import (
    Decision,
    EndpointView,
    PoolSnapshot,
    PrefixIndex,
    RouteRequest,
    RoutingContext,
    default_config,
    profile_from_config,
)

_MODELS = ("m", "other")
_ADAPTERS = ("", "a1", "a2")


@st.composite
def _endpoints(draw: st.DrawFn, index: int) -> EndpointView:
    capacity = draw(st.sampled_from((0, 1_000, 100_000)))
    state = EndpointState(
        pool="p",
        endpoint_id=f"e{index}",
        address=f"http://e{index}",
        model=draw(st.sampled_from(_MODELS)),
        role=draw(st.sampled_from((Role.MIXED, Role.MIXED, Role.PREFILL))),
        adapters=tuple(draw(st.sets(st.sampled_from(_ADAPTERS[1:]), max_size=2))),
        lifecycle=draw(st.sampled_from((Lifecycle.READY, Lifecycle.READY, Lifecycle.DRAINING))),
        watermark=draw(st.sampled_from(list(WatermarkState))),
        kv_capacity_tokens=capacity,
        kv_used_tokens=draw(st.integers(0, capacity)),
        kv_reserved_growth_tokens=draw(st.integers(0, 20_000)),
        waiting_prefill_tokens=draw(st.integers(0, 60_000)),
        running_requests=draw(st.integers(0, 20)),
        queued_requests=draw(st.integers(0, 40)),
        predicted_ttft_s=draw(st.floats(0.0, 3.0)),
        predicted_tpot_s=draw(st.floats(0.0, 0.1)),
    )
    return EndpointView(state, draw(st.sampled_from((5.0, 10.0, 1e12))))


@st.composite
def _profiles(draw: st.DrawFn) -> dict[str, Any]:
    config = default_config()
    filters = draw(st.lists(st.sampled_from(config["filters"]), unique_by=str, max_size=5))
    config["filters"] = filters
    if draw(st.booleans()):
        config["filters"] = [
            f if f != {"name": "bounded-load", "factor": 1.25} else {**f, "factor": 1.0}
            for f in filters
        ]
    scorers = [
        {**s, "weight": draw(st.sampled_from((0.0, 0.5, 1.0, 3.0)))}
        for s in config["scorers"]
        if draw(st.integers(0, 3))  # drop about one in four
    ]
    config["scorers"] = scorers or config["scorers"][:1]
    config["candidates"] = draw(st.integers(1, 6))
    config["tie_band"] = draw(st.sampled_from((0.0, 0.005, 0.05, 1.0)))
    return config


@st.composite
def _cases(draw: st.DrawFn) -> tuple[dict[str, Any], RouteRequest, RoutingContext]:
    size = draw(st.integers(1, 24))
    views = tuple(draw(_endpoints(i)) for i in range(size))
    snapshot = PoolSnapshot("p", views)
    ids = [v.endpoint_id for v in views] + ["gone"]
    index = PrefixIndex()
    blocks = tuple(range(1, draw(st.integers(0, 8)) + 1))
    for endpoint_id in draw(st.lists(st.sampled_from(ids), max_size=4)):
        index.record(endpoint_id, blocks[: draw(st.integers(0, len(blocks)))])
    request = RouteRequest(
        request_id=draw(st.text(max_size=4)),
        model=draw(st.sampled_from(_MODELS)),
        prompt_tokens=draw(st.integers(1, 20_000)),
        max_new_tokens=draw(st.integers(1, 4_000)),
        adapter=draw(st.sampled_from(_ADAPTERS)),
        role=draw(st.sampled_from((Role.MIXED, Role.PREFILL))),
        deadline_s=draw(st.sampled_from((0.0, 0.5, 5.0))),
        block_hashes=blocks,
        owners=tuple(draw(st.lists(st.sampled_from(ids), max_size=2))),
        exclude=frozenset(draw(st.sets(st.sampled_from(ids), max_size=2))),
    )
    inflight = draw(st.dictionaries(st.sampled_from(ids), st.integers(1, 5), max_size=4))
    ctx = RoutingContext(snapshot, draw(st.sampled_from((0.0, 7.0))), inflight,
                         sum(inflight.values()), index)  # fmt: skip
    return draw(_profiles()), request, ctx


def _summary(decision: Decision) -> tuple[object, ...]:
    return (
        decision.endpoint_id,
        decision.reason,
        decision.owner_hit,
        decision.score,
        dict(decision.rejected),
        decision.fallbacks,
        decision.refusal,
    )


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_the_fused_loop_decides_exactly_as_the_plugins(
    case: tuple[dict[str, Any], RouteRequest, RoutingContext],
) -> None:
    config, request, ctx = case
    profile = profile_from_config(config)
    assert profile.fused
    assert _summary(profile.decide(request, ctx)) == _summary(
        profile.decide_with_plugins(request, ctx)
    )


def test_the_default_profile_is_fused_and_a_reordered_one_runs_the_plugins() -> None:
    assert profile_from_config(default_config()).fused
    config = default_config()
    config["scorers"] = list(reversed(config["scorers"]))
    reordered = profile_from_config(config)
    assert not reordered.fused
    snapshot = PoolSnapshot.of(
        "p", [EndpointState(pool="p", endpoint_id="e", address="http://e", model="m")]
    )
    decision = reordered.decide(RouteRequest("r", "m", 10, 10), RoutingContext(snapshot, 0.0))
    assert decision.endpoint_id == "e"
