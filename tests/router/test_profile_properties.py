"""What every decision holds, over random pools, requests and profiles built from the
built-in plugins, near-ties spread or not: the pick and its fallbacks pass every filter,
each total is the weighted sum of the candidate's scores, each score is within [0, 1],
the pick is the first of the highest totals (or, with a tie band, a near-tie credited
with the same cached prefix), and a refusal may wait exactly when saturation made it."""

from __future__ import annotations

import math
import random
from operator import mul
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.contract import EndpointState, Lifecycle, Role, WatermarkState
from controlplane.routing import (
    SATURATION,
    Cycle,
    EndpointView,
    PoolSnapshot,
    PrefixIndex,
    Profile,
    RouteRequest,
    RoutingContext,
    default_config,
    profile_from_config,
)
from controlplane.routing.profile import clamp
from controlplane.routing.scorers import PrefixAffinity

_MODELS = ("m", "other")
_ADAPTERS = ("", "a1", "a2")


def _endpoint(rng: random.Random, index: int) -> EndpointView:
    """A random endpoint, drawn from a seed: hypothesis draws one number instead of
    sixteen per endpoint, which is most of what a case costs to make."""
    capacity = rng.choice((0, 1_000, 100_000))
    state = EndpointState(
        pool="p",
        endpoint_id=f"e{index}",
        address=f"http://e{index}",
        model=rng.choice(_MODELS),
        role=rng.choice((Role.MIXED, Role.MIXED, Role.PREFILL)),
        adapters=tuple(sorted(set(rng.choices(_ADAPTERS[1:], k=rng.randint(0, 2))))),
        lifecycle=rng.choice((Lifecycle.READY, Lifecycle.READY, Lifecycle.DRAINING)),
        watermark=rng.choice(list(WatermarkState)),
        kv_capacity_tokens=capacity,
        kv_used_tokens=rng.randint(0, capacity),
        kv_reserved_growth_tokens=rng.randint(0, 20_000),
        waiting_prefill_tokens=rng.randint(0, 60_000),
        running_requests=rng.randint(0, 20),
        queued_requests=rng.randint(0, 40),
        predicted_ttft_s=rng.choice((0.0, rng.uniform(0.0, 3.0))),
        predicted_tpot_s=rng.uniform(0.0, 0.1),
        # Block ids of the requests' prompts (1..8): some held in host memory.
        host_prefixes=tuple(rng.sample(range(1, 9), k=rng.choice((0, 0, 1, 2)))),
    )
    return EndpointView(state, rng.choice((5.0, 10.0, 1e12)))


@st.composite
def _profiles(draw: st.DrawFn) -> dict[str, Any]:
    config = default_config()
    filters = draw(st.lists(st.sampled_from(config["filters"]), unique_by=str, max_size=5))
    if draw(st.booleans()):  # a second bounded load, named apart, stricter than the first
        filters.append({"type": "bounded-load", "name": "strict-load", "factor": 1.0})
    config["filters"] = filters
    scorers = [
        {**s, "weight": draw(st.sampled_from((0.0, 0.5, 1.0, 3.0)))}
        for s in config["scorers"]
        if draw(st.integers(0, 3))  # drop about one in four
    ]
    config["scorers"] = draw(st.permutations(scorers or config["scorers"][:1]))
    config["candidates"] = draw(st.integers(1, 6))
    config["tie_band"] = draw(st.sampled_from((0.0, 0.005, 0.05, 1.0)))
    return config


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Profile, RouteRequest, RoutingContext]:
    rng = random.Random(draw(st.integers(0, 2**32)))
    views = tuple(_endpoint(rng, i) for i in range(draw(st.integers(1, 12))))
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
    return profile_from_config(draw(_profiles())), request, ctx


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_every_decision_is_the_weighted_sum_of_its_plugins_verdicts(
    case: tuple[Profile, RouteRequest, RoutingContext],
) -> None:
    profile, request, ctx = case
    decision = profile.decide(request, ctx)
    snapshot = ctx.snapshot
    mean_load = (snapshot.total_load + ctx.inflight_total) / (len(snapshot.preferred) or 1)
    holders = ctx.prefix_index.holders(request.block_hashes) if ctx.prefix_index else {}
    host_holders = ctx.snapshot.host_holders(request.block_hashes)
    cycle = Cycle(request, ctx, holders, host_holders, mean_load, {})

    if not decision.endpoint_id:
        assert not decision.eligible
        saturation = {f.name for f in profile.filters if isinstance(f, SATURATION)}
        assert decision.saturated == (decision.refusal in saturation)
        return
    eligible = list(decision.eligible)
    picked = eligible[decision.chosen]
    assert picked.endpoint_id == decision.endpoint_id not in request.exclude
    # The built-in filters judge each candidate alone: every eligible one passes them all.
    for view in eligible:
        assert all(f.filter(cycle, [view]) == [view] for f in profile.filters)
    assert set(decision.rejected) <= {f.name for f in profile.filters}
    assert all(count > 0 for count in decision.rejected.values())

    # Each column is its scorer's verdict on the eligible candidates; each total their sum.
    for ws, column in zip(profile.scorers, decision.scores, strict=True):
        assert [clamp(s) for s in ws.scorer.score(cycle, eligible)] == list(column)
        assert all(0.0 <= score <= 1.0 for score in column)
    weights = [ws.weight for ws in profile.scorers]
    rows = list(zip(*decision.scores, strict=True))
    assert list(decision.totals) == [sum(map(mul, weights, row)) for row in rows]
    terms = profile.terms(decision)
    for view, total in zip(eligible, decision.totals, strict=True):
        assert math.isclose(sum(terms[view.endpoint_id].values()), total, abs_tol=1e-9)

    totals = decision.totals
    first = totals.index(max(totals))  # MaxScore's pick: the first of the highest
    assert decision.score == totals[decision.chosen]
    if not profile.tie_band or eligible[first].endpoint_id == request.primary_owner:
        assert decision.chosen == first
        return
    assert totals[decision.chosen] >= totals[first] - profile.tie_band
    affinity = [i for i, ws in enumerate(profile.scorers) if isinstance(ws.scorer, PrefixAffinity)]
    if affinity:  # a spread pick never trades cached tokens for balance
        column = decision.scores[affinity[0]]
        assert column[decision.chosen] == column[first]


def test_a_refusal_by_saturation_may_wait_and_a_refusal_by_anything_else_may_not() -> None:
    critical = EndpointState(pool="p", endpoint_id="c", address="http://c", model="m",
                             watermark=WatermarkState.CRITICAL)  # fmt: skip
    config = default_config()
    config["filters"] = ["role-model-adapter", {"type": "watermark-below-critical", "name": "w"}]
    profile = profile_from_config(config)
    ctx = RoutingContext(PoolSnapshot.of("p", [critical]), 0.0)
    full = profile.decide(RouteRequest("r", "m", 10, 10), ctx)
    assert (full.refusal, full.saturated) == ("w", True)
    foreign = profile.decide(RouteRequest("r", "x", 10, 10), ctx)
    assert (foreign.refusal, foreign.saturated) == ("role-model-adapter", False)
