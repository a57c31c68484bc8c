"""The pure routing pipeline: filters, the cost-model scorers, the picker, profiles from
configuration, the prefix index and the fair queue, over hand-built snapshots."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.contract import EndpointState, Lifecycle, Role, WatermarkState
from controlplane.routing import (
    Cycle,
    Decision,
    DecisionReason,
    EndpointView,
    FairQueue,
    InFlight,
    PoolSnapshot,
    PrefixIndex,
    Profile,
    ProfileError,
    QueueFullError,
    RouteRequest,
    RoutingContext,
    WeightedScorer,
    default_config,
    profile_from_config,
)
from controlplane.routing.cost import CostModel
from controlplane.routing.pickers import MaxScore
from controlplane.routing.scorers import PrefixAffinity
from controlplane.rules.fairness import UNKNOWN_TPOT_S, kv_cost, kv_cost_estimate


def _state(endpoint_id: str, **fields: object) -> EndpointState:
    base: dict[str, object] = {
        "pool": "p",
        "endpoint_id": endpoint_id,
        "address": f"http://{endpoint_id}",
        "model": "m",
        "kv_capacity_tokens": 100_000,
    }
    base.update(fields)
    return EndpointState(**base)  # type: ignore[arg-type]


def _request(**fields: object) -> RouteRequest:
    base: dict[str, object] = {
        "request_id": "r1",
        "model": "m",
        "prompt_tokens": 2048,
        "max_new_tokens": 128,
    }
    base.update(fields)
    return RouteRequest(**base)  # type: ignore[arg-type]


PROFILE = profile_from_config(default_config())


def _decide(
    states: list[EndpointState], request: RouteRequest, now: float = 0.0, **ctx: object
) -> Decision:
    return _decide_with(PROFILE, states, request, now, **ctx)


def _decide_with(
    profile: Profile,
    states: list[EndpointState],
    request: RouteRequest,
    now: float = 0.0,
    **ctx: object,
) -> Decision:
    snapshot = PoolSnapshot.of("p", states, lease_deadline=10.0)
    return profile.decide(request, RoutingContext(snapshot, now, **ctx))  # type: ignore[arg-type]


def test_an_idle_primary_owner_wins_and_the_secondary_is_the_first_fallback() -> None:
    states = [_state(f"e{i}") for i in range(6)]
    decision = _decide(states, _request(owners=("e3", "e5")))
    assert decision.endpoint_id == "e3"
    assert decision.reason == DecisionReason.PRIMARY_OWNER
    assert decision.owner_hit
    assert decision.fallbacks[0] == "e5"
    assert set(decision.fallbacks) == {"e0", "e1", "e2", "e4", "e5"}


def test_a_near_critical_owner_loses_to_the_secondary() -> None:
    states = [
        _state("hot", watermark=WatermarkState.PRESSURE, kv_used_tokens=80_000,
               kv_reserved_growth_tokens=12_000),
        _state("second"),
        _state("other", running_requests=3),
    ]  # fmt: skip
    decision = _decide(states, _request(owners=("hot", "second")))
    assert decision.endpoint_id == "second"
    assert decision.reason == DecisionReason.SECONDARY_OWNER
    assert not decision.owner_hit


def test_critical_draining_expired_and_foreign_endpoints_are_filtered_with_reasons() -> None:
    snapshot = PoolSnapshot(
        "p",
        (
            *PoolSnapshot.of("p", [
                _state("critical", watermark=WatermarkState.CRITICAL),
                _state("draining", lifecycle=Lifecycle.DRAINING),
                _state("other-model", model="x"),
                _state("prefill", role=Role.PREFILL),
            ], lease_deadline=10.0).endpoints,
            *PoolSnapshot.of("p", [_state("expired")], lease_deadline=5.0).endpoints,
        ),
    )  # fmt: skip
    # Small pools are scanned whole, so every filter sees (and counts) every endpoint.
    scan_all = profile_from_config({**default_config(), "candidates": 8})
    decision = scan_all.decide(_request(), RoutingContext(snapshot, now=6.0))
    assert decision.endpoint_id == ""
    assert decision.reason == DecisionReason.NO_CANDIDATE
    assert decision.rejected == {
        "lease-valid": 1,
        "not-draining": 1,
        "role-model-adapter": 2,
        "watermark-below-critical": 1,
    }
    assert decision.refusal == "role-model-adapter"


def test_two_instances_of_one_filter_are_named_apart_and_counted_apart() -> None:
    """A profile may hold two filters of one type; each counts its own rejections under
    its instance's name (one name for both would let the second overwrite the first)."""
    config = default_config()
    config["candidates"] = 8
    config["filters"] = [
        {"type": "bounded-load", "name": "load-cap", "factor": 2.0},
        {"type": "bounded-load", "name": "tight-load", "factor": 1.0},
    ]
    profile = profile_from_config(config)
    states = [_state(f"e{i}", running_requests=n) for i, n in enumerate((60, 25, 10, 5, 0))]
    decision = _decide_with(profile, states, _request())
    # A mean of 20 requests: the cap (below 41) drops e0, the tight bound (21) then e1.
    assert decision.rejected == {"load-cap": 1, "tight-load": 1}
    assert decision.endpoint_id in {"e2", "e3", "e4"}
    only_e0 = _request(exclude=frozenset({"e1", "e2", "e3", "e4"}))
    refused = _decide_with(profile, states, only_e0)
    assert (refused.rejected, refused.saturated) == ({"load-cap": 1}, True)
    assert [f.name for f in profile_from_config(default_config()).filters][-1] == "bounded-load"


@pytest.mark.parametrize(
    "filters",
    [
        ["bounded-load", {"name": "bounded-load", "factor": 2.0}],
        ["not-draining", {"type": "lease-valid", "name": "not-draining"}],
    ],
)
def test_two_filters_of_one_name_are_refused(filters: list[object]) -> None:
    with pytest.raises(ProfileError, match="two filters are named"):
        profile_from_config({**default_config(), "filters": filters})


class _Wild:
    """A scorer that breaks the [0, 1] contract: its scores by endpoint id."""

    def __init__(self, scores: dict[str, float], name: str = "wild") -> None:
        self.scores = scores
        self.name = name

    def score(self, cycle: Cycle, candidates: Sequence[EndpointView]) -> list[float]:
        return [self.scores[v.endpoint_id] for v in candidates]


def test_scores_are_clamped_to_the_unit_range_so_no_scorer_outweighs_the_others() -> None:
    """A scorer's score above 1 counts as 1, below 0 (and NaN) as 0: the queue term still
    decides between endpoints a broken scorer ranks 1e9 and 1 apart."""
    states = [_state("busy", waiting_prefill_tokens=40_000), _state("idle"), _state("nan")]
    wild = _Wild({"busy": 1e9, "idle": 1.0, "nan": math.nan})
    queue = profile_from_config({"scorers": ["queue"]}).scorers[0].scorer
    profile = Profile(
        "clamped", (), (WeightedScorer(wild, 1.0), WeightedScorer(queue, 1.0)), MaxScore(),
        candidates=8,
    )  # fmt: skip
    decision = _decide_with(profile, states, _request())
    assert decision.endpoint_id == "idle"
    wild_column, _ = decision.scores
    assert dict(zip(["busy", "idle", "nan"], wild_column, strict=True)) == {
        "busy": 1.0, "idle": 1.0, "nan": 0.0,
    }  # fmt: skip
    assert all(0.0 <= score <= 2.0 for score in decision.totals)
    negative = _Wild({"busy": -5.0, "idle": 0.5, "nan": 0.25})
    alone = Profile("alone", (), (WeightedScorer(negative, 1.0),), MaxScore(), candidates=8)
    assert list(_decide_with(alone, states, _request()).totals) == [0.0, 0.5, 0.25]


def test_a_route_is_explained_by_each_scorer_s_weighted_term() -> None:
    states = [_state("e0", waiting_prefill_tokens=20_000), _state("e1")]
    decision = _decide(states, _request(owners=("e0",)))
    terms = PROFILE.terms(decision)
    names = [ws.scorer.name for ws in PROFILE.scorers]
    assert set(terms) == {"e0", "e1"}
    for view, total in zip(decision.eligible, decision.totals, strict=True):
        assert list(terms[view.endpoint_id]) == names
        assert sum(terms[view.endpoint_id].values()) == pytest.approx(total)
    # The owner's cache credit is its prefix term; its queue is why it lost.
    assert terms["e0"]["prefix-affinity"] > terms["e1"]["prefix-affinity"]
    assert terms["e0"]["queue"] < terms["e1"]["queue"]
    assert decision.endpoint_id == "e1"


def test_a_lapsed_lease_takes_the_endpoint_out_at_its_deadline() -> None:
    snapshot = PoolSnapshot.of("p", [_state("only")], lease_deadline=10.0)
    assert PROFILE.decide(_request(), RoutingContext(snapshot, 9.9)).endpoint_id == "only"
    assert PROFILE.decide(_request(), RoutingContext(snapshot, 10.0)).endpoint_id == ""


def test_bounded_load_spills_a_hot_owner_and_counts_router_inflight() -> None:
    states = [_state(f"e{i}") for i in range(4)]
    # The router sent 6 requests to e0 since its last heartbeat; the mean is 1.5.
    decision = _decide(states, _request(owners=("e0", "e1")), inflight={"e0": 6}, inflight_total=6)
    assert decision.endpoint_id == "e1"
    assert "e0" not in decision.fallbacks


def test_a_resume_is_placed_where_only_saturation_would_refuse_it() -> None:
    """Saturation keeps new work off full endpoints; a resume continues an accepted stream,
    so it goes to the least pressured endpoint the other filters allow. What no endpoint
    may take (draining, another model, its old endpoint) stays refused."""
    states = [
        _state("critical", watermark=WatermarkState.CRITICAL, kv_used_tokens=90_000),
        _state("loaded", watermark=WatermarkState.PRESSURE, running_requests=40),
        _state("draining", lifecycle=Lifecycle.DRAINING),
        _state("old"),
    ]  # fmt: skip
    snapshot = PoolSnapshot.of("p", states, lease_deadline=10.0)
    request = _request(exclude=frozenset({"old"}))
    ctx = RoutingContext(snapshot, 0.0, inflight={"loaded": 4}, inflight_total=4)
    refused = PROFILE.decide(request, ctx)
    assert refused.endpoint_id == ""
    assert set(refused.rejected) == {"not-draining", "watermark-below-critical", "bounded-load"}
    resumed = PROFILE.decide_resume(request, ctx)
    assert resumed.endpoint_id == "loaded"  # below critical: less pressured than "critical"
    assert resumed.fallbacks == ("critical",)
    # Nothing but a draining endpoint and the old one: refused, saturation or not.
    alone = PoolSnapshot.of("p", states[2:], lease_deadline=10.0)
    assert PROFILE.decide_resume(request, RoutingContext(alone, 0.0)).endpoint_id == ""


def test_the_prefix_index_draws_repeated_prefixes_back_to_where_they_went() -> None:
    index = PrefixIndex(capacity_blocks=100)
    index.record("e2", (1, 2, 3, 4))
    assert index.holders((1, 2, 9)) == {"e2": 2}
    states = [_state(f"e{i}") for i in range(4)]
    request = _request(block_hashes=(1, 2, 3, 4), prompt_tokens=4 * 64 + 10)
    decision = _decide(states, request, prefix_index=index)
    assert decision.endpoint_id == "e2"
    index.forget("e2")
    assert index.holders((1, 2)) == {}


def _affinity(
    states: list[EndpointState], request: RouteRequest, index: PrefixIndex, weight: float = 0.75
) -> dict[str, float]:
    """The prefix-affinity score of each endpoint for `request`."""
    snapshot = PoolSnapshot.of("p", states, lease_deadline=10.0)
    ctx = RoutingContext(snapshot, 0.0, prefix_index=index)
    holders = index.holders(request.block_hashes)
    cycle = Cycle(request, ctx, holders, snapshot.host_holders(request.block_hashes), 0.0, {})
    scores = PrefixAffinity(host_weight=weight).score(cycle, snapshot.endpoints)
    return dict(zip((v.endpoint_id for v in snapshot.endpoints), scores, strict=True))


def test_a_host_tier_hit_is_credited_below_a_device_hit_and_above_none() -> None:
    """Four blocks: on the device at `device`, in host memory at `host` (it publishes their
    last block), nowhere at `none`. Credited at 0.75 a block, as Dynamo's router does."""
    index = PrefixIndex()
    index.record("device", (1, 2, 3, 4))
    states = [_state("device"), _state("host", host_prefixes=(9, 4)), _state("none")]
    request = _request(block_hashes=(1, 2, 3, 4), prompt_tokens=4 * 64)
    scores = _affinity(states, request, index)
    assert scores["device"] == 1.0 > scores["host"] > scores["none"]
    # The uncached prefill the host tier leaves is a quarter of the prompt's.
    rate = CostModel().prefill_tokens_per_s
    assert scores["host"] == pytest.approx(0.25 / (0.25 + 64 / rate))
    # Weighted 1, host memory counts as the device; weighted 0, as nothing.
    assert _affinity(states, request, index, weight=1.0)["host"] == 1.0
    assert _affinity(states, request, index, weight=0.0)["host"] == scores["none"]


def test_an_endpoint_is_credited_by_the_deepest_block_it_holds_in_host_memory() -> None:
    """A prompt that extends an offloaded one (its follow-up) matches up to that prompt's
    last block; the index's device blocks beyond what went to host memory count in full."""
    index = PrefixIndex()
    states = [_state("a", host_prefixes=(2,)), _state("b", host_prefixes=(7,))]
    snapshot = PoolSnapshot.of("p", states, lease_deadline=10.0)
    assert snapshot.host_holders((1, 2, 3)) == {"a": 2}
    assert snapshot.host_holders((5, 6)) == {}
    index.record("a", (1, 2, 3))
    request = _request(block_hashes=(1, 2, 3), prompt_tokens=3 * 64)
    rate = CostModel().prefill_tokens_per_s
    uncached = 3 * 64 - (2 * 0.75 + 1) * 64
    assert _affinity(states, request, index)["a"] == pytest.approx(0.25 / (0.25 + uncached / rate))
    # A draining endpoint's host pages are no route to it.
    draining = _state("a", host_prefixes=(2,), lifecycle=Lifecycle.DRAINING)
    assert PoolSnapshot.of("p", [draining], lease_deadline=10.0).host_holders((1, 2)) == {}


def test_a_continuation_goes_to_the_endpoint_holding_its_pages_in_host_memory() -> None:
    """A router that never placed the prompt (another replica did, or it restarted) sends
    the continuation of an offloaded request where its host pages are, over equal endpoints
    without them, and past the request-dependent window of a large pool."""
    request = _request(block_hashes=(11, 12, 13, 14), prompt_tokens=4 * 64 + 10)
    states = [_state(f"e{i}") for i in range(16)]
    states[9] = _state("e9", host_prefixes=(14,))
    assert _decide(states, request, prefix_index=PrefixIndex()).endpoint_id == "e9"
    # Where another endpoint has the prompt on its device, that one wins.
    index = PrefixIndex()
    index.record("e3", (11, 12, 13, 14))
    assert _decide(states, request, prefix_index=index).endpoint_id == "e3"


def test_the_prefix_index_is_bounded_in_lru_order() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.record("a", (1, 2))
    index.record("b", (3,))
    index.record("a", (1,))  # refreshes block 1
    index.record("c", (4,))  # evicts block 2, the least recently used
    assert len(index) == 3
    assert index.holders((1, 2)) == {"a": 1}


def test_the_anti_hotspot_max_wait_withdraws_cache_credit_from_a_long_queue() -> None:
    states = [_state("owner", waiting_prefill_tokens=200_000), _state("idle")]
    decision = _decide(states, _request(owners=("owner",), prompt_tokens=8000))
    assert decision.endpoint_id == "idle"


def test_a_large_pool_decides_over_a_bounded_candidate_set() -> None:
    states = [_state(f"e{i:04d}", running_requests=i % 7) for i in range(1000)]
    decision = _decide(states, _request(owners=("e0500", "e0501")))
    assert decision.endpoint_id in {"e0500", "e0501"}
    assert len(decision.fallbacks) <= PROFILE.candidates + 1


def test_the_candidate_window_widens_with_the_requests_sent_since_the_last_reports() -> None:
    """Between two reports every request sees the same ranking: with the window fixed at
    twice `candidates`, a busy pool sent them all to its few best-ranked endpoints. Each
    request sent since (`inflight_total`) widens the window by one, so they spread."""
    states = [_state(f"e{i:03d}", running_requests=i // 10) for i in range(128)]
    window = 2 * PROFILE.candidates
    best = {f"e{i:03d}" for i in range(window)}  # the least loaded rank first

    def picks(sent: int) -> set[str]:
        return {
            _decide(states, _request(request_id=f"r{i}"), inflight_total=sent).endpoint_id
            for i in range(200)
        }

    assert picks(0) <= best
    assert len(picks(120) - best) > 10


_ENDPOINT = st.fixed_dictionaries(
    {
        "watermark": st.sampled_from(list(WatermarkState)),
        "lifecycle": st.sampled_from([Lifecycle.READY, Lifecycle.READY, Lifecycle.DRAINING]),
        "model": st.sampled_from(["m", "m", "m", "other"]),
        "running_requests": st.integers(0, 12),
        "kv_used_tokens": st.integers(0, 99_000),
        "waiting_prefill_tokens": st.integers(0, 50_000),
    }
)


_REPORT = st.fixed_dictionaries(
    {
        "watermark": st.sampled_from(list(WatermarkState)),
        "lifecycle": st.sampled_from([Lifecycle.READY, Lifecycle.READY, Lifecycle.DRAINING]),
        "running_requests": st.integers(0, 3),
        "kv_used_tokens": st.sampled_from([0, 25_000, 50_000]),  # ties on pressure too
        "host_prefixes": st.sampled_from([(), (), (7,), (7, 9)]),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    first=st.lists(_REPORT, min_size=1, max_size=12),
    reports=st.lists(st.tuples(st.integers(0, 15), _REPORT), max_size=30),
)
def test_a_snapshot_moved_one_report_at_a_time_is_the_snapshot_built_whole(
    first: list[dict[str, object]], reports: list[tuple[int, dict[str, object]]]
) -> None:
    """`replacing` (the simulator's update) gives what building the snapshot from every
    endpoint gives: the same ranking with the same tie-breaks, load and host tips,
    whether a report replaces an endpoint's view or adds one, and whether the reports
    move it one at a time or all at once."""
    views = {i: EndpointView(_state(f"e{i:02d}", **f), 10.0) for i, f in enumerate(first)}
    snapshot = start = PoolSnapshot("p", tuple(views.values()))
    moved = []
    for index, fields in reports:
        views[index] = EndpointView(_state(f"e{index:02d}", **fields), 10.0)
        moved.append(views[index])
        snapshot = snapshot.replacing([views[index]], taken_at=1.0)
        whole = PoolSnapshot("p", tuple(views.values()), taken_at=1.0)
        for derived in (snapshot, start.replacing(moved, taken_at=1.0)):
            assert derived == whole
            assert derived.preferred == whole.preferred
            assert dict(derived.by_id) == dict(whole.by_id)
            assert derived.total_load == whole.total_load
            assert dict(derived.host_tips) == dict(whole.host_tips)


@settings(max_examples=150, deadline=None)
@given(
    endpoints=st.lists(_ENDPOINT, min_size=12, max_size=60),
    expired=st.sets(st.integers(0, 59)),
    owner_picks=st.lists(st.integers(0, 59), min_size=0, max_size=2, unique=True),
    inflight=st.dictionaries(st.integers(0, 59), st.integers(1, 8), max_size=6),
    holder=st.integers(0, 59),
)
def test_the_shortlist_keeps_eligible_owners_and_never_picks_a_filtered_endpoint(
    endpoints: list[dict[str, object]],
    expired: set[int],
    owner_picks: list[int],
    inflight: dict[int, int],
    holder: int,
) -> None:
    """A large pool is decided over a shortlist, not scanned: whatever the shortlist
    drops, an owner that passes every filter stays a candidate, and the pick (and every
    fallback) passes every filter."""
    n = len(endpoints)
    ids = [f"e{i:02d}" for i in range(n)]
    views = [
        view
        for i, fields in enumerate(endpoints)
        for view in PoolSnapshot.of(
            "p", [_state(ids[i], **fields)], lease_deadline=5.0 if i in expired else 10.0
        ).endpoints
    ]
    snapshot = PoolSnapshot("p", tuple(views))
    owners = tuple(ids[i % n] for i in owner_picks)
    index = PrefixIndex()
    index.record(ids[holder % n], (1, 2, 3))
    load = {ids[i % n]: count for i, count in inflight.items()}
    ctx = RoutingContext(snapshot, 6.0, load, sum(load.values()), index)
    request = _request(owners=owners, block_hashes=(1, 2, 3))
    assert n > PROFILE.candidates + len(owners)  # the shortlist path, not a full scan
    decision = PROFILE.decide(request, ctx)

    mean = (snapshot.total_load + ctx.inflight_total) / (len(snapshot.preferred) or 1)
    bound = math.ceil(1.25 * (mean * len(snapshot.preferred) + 1.0) / len(snapshot.preferred))

    def eligible(endpoint_id: str) -> bool:
        view = snapshot.by_id[endpoint_id]
        return (
            view.lease_deadline > 6.0
            and view.routable
            and view.state.model == "m"
            and view.watermark_rank < WatermarkState.CRITICAL.rank
            and ctx.load(view) < bound
        )

    considered = {decision.endpoint_id, *decision.fallbacks} - {""}
    assert all(eligible(e) for e in considered)
    for owner in owners:
        if eligible(owner):
            assert owner in considered
    if owners and eligible(owners[0]) and decision.endpoint_id != owners[0]:
        assert decision.reason != DecisionReason.PRIMARY_OWNER
    if len(owners) > 1 and eligible(owners[1]) and decision.endpoint_id != owners[1]:
        assert decision.fallbacks[0] == owners[1]


def _bursts(band: float, routers: int, bursts: int = 24) -> list[list[str]]:
    """Bursts of one request per router over four idle, identical endpoints, each router
    deciding from the same snapshot and counting only its own dispatches: the picks."""
    config = default_config()
    config["tie_band"] = band
    profile = profile_from_config(config)
    snapshot = PoolSnapshot.of("p", [_state(f"e{i}") for i in range(4)], lease_deadline=10.0)
    picks = []
    for burst in range(bursts):
        inflight = [InFlight() for _ in range(routers)]
        chosen = []
        for i in range(3):
            own = inflight[i % routers]
            ctx = RoutingContext(snapshot, 0.0, own.counts, own.total)
            request_id = f"burst{burst}-{i}"
            decision = profile.decide(_request(request_id=request_id), ctx)
            own.add(decision.endpoint_id, request_id, 0.0)
            chosen.append(decision.endpoint_id)
        picks.append(chosen)
    return picks


# Totals this close count as a tie: KV pressures a percent or so apart, never a request
# queued or dispatched (a dispatch to an idle endpoint costs about 0.2 of its queue score).
TIE_BAND = 0.005


def test_routers_sharing_a_snapshot_spread_near_ties_instead_of_herding() -> None:
    """Three routers see the same idle pool: deciding alike, each sends its request to the
    same endpoint (three where one router sends one, then spreads). With a tie band
    (opt-in: the default profile has none) their picks decorrelate, while one router still never doubles up on an endpoint
    while an equal one is free."""
    herd = _bursts(band=0.0, routers=3)
    assert all(len(set(burst)) == 1 for burst in herd)
    spread = _bursts(band=TIE_BAND, routers=3)
    assert sum(len(set(burst)) == 1 for burst in spread) <= len(spread) // 4
    assert {e for burst in spread for e in burst} == {"e0", "e1", "e2", "e3"}
    for band in (0.0, TIE_BAND):
        assert all(len(set(burst)) == 3 for burst in _bursts(band, routers=1))


def test_a_tie_band_never_trades_cached_tokens_for_balance() -> None:
    """However wide the band, a pick is spread only among candidates credited with the same
    cached prefix: the owner of a prefix keeps it over equally idle endpoints, and over
    its secondary too where a short prompt credits both with all of it."""
    config = default_config()
    config["tie_band"] = 1.0
    profile = profile_from_config(config)
    snapshot = PoolSnapshot.of("p", [_state(f"e{i}") for i in range(4)], lease_deadline=10.0)
    index = PrefixIndex()
    index.record("e1", (7, 8, 9))
    for i in range(20):
        owned = _request(request_id=f"r{i}", owners=("e2", "e0"))
        assert profile.decide(owned, RoutingContext(snapshot, 0.0)).endpoint_id == "e2"
        short = _request(request_id=f"s{i}", prompt_tokens=100, owners=("e3", "e1"))
        assert profile.decide(short, RoutingContext(snapshot, 0.0)).endpoint_id == "e3"
        held = _request(request_id=f"h{i}", block_hashes=(7, 8, 9))
        ctx = RoutingContext(snapshot, 0.0, prefix_index=index)
        assert profile.decide(held, ctx).endpoint_id == "e1"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"scorers": [{"name": "nope"}]}, "unknown scorer 'nope'"),
        ({"scorers": [{"name": "queue", "weight": -1}]}, "weight must be a finite number >= 0"),
        (
            {"scorers": [{"name": "queue", "weight": math.nan}]},
            "weight must be a finite number >= 0",
        ),
        ({"scorers": [{"name": "queue", "bogus": 1}]}, "scorer 'queue'"),
        ({"scorers": []}, "at least one scorer"),
        ({"filters": [{"name": "bounded-load", "factor": 0.5}], "scorers": ["queue"]}, ">= 1"),
        ({"scorers": ["queue"], "candidates": 0}, "positive integer"),
        ({"scorers": ["queue"], "cost": {"warp": 9}}, "profile 'cost'"),
        ({"scorers": ["queue"], "tie_band": -0.1}, "tie_band"),
        ({"scorers": ["queue"], "tie_band": math.inf}, "tie_band"),
        ({"scorers": ["queue"], "tie_band": "wide"}, "tie_band"),
        ({"scorers": ["queue"], "tie_band": True}, "tie_band"),
        ({"scorers": [{"name": "prefix-affinity", "host_weight": 1.5}]}, "host_weight"),
        ([], "must be a mapping"),
    ],
)
def test_bad_profiles_are_refused_naming_the_entry(config: object, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        profile_from_config(config)  # type: ignore[arg-type]


def test_the_fair_queue_serves_bands_by_priority_and_tenants_by_cost() -> None:
    queue: FairQueue[str] = FairQueue(capacity_per_band=10, max_wait_s=5.0)
    for i in range(3):
        queue.offer(f"big{i}", "big", 0, 0.0, f"big{i}")
    queue.offer("small0", "small", 0, 0.0, "small0")
    queue.offer("small1", "small", 0, 0.0, "small1")
    queue.offer("urgent", "big", 5, 0.0, "urgent")
    cost = {"big": 1000.0, "small": 10.0}
    order = []
    while (head := queue.peek()) is not None:
        popped = queue.pop(cost[head.tenant])
        assert popped is head
        order.append(head.key)
    assert order[0] == "urgent"
    # After "big" is charged for its urgent request, the small tenant catches up first.
    assert order[1:3] == ["small0", "small1"]
    assert order[3:] == ["big0", "big1", "big2"]


def test_a_request_is_charged_the_kv_it_pins_not_its_tokens() -> None:
    """Two requests of 2,000 tokens each: the long answer holds its KV through 1,000
    decode steps, the short one through 100, and is charged for it."""
    long_answer = kv_cost_estimate(1000, 2000, ttft_s=0.0, tpot_s=0.02)
    short_answer = kv_cost_estimate(1800, 400, ttft_s=0.0, tpot_s=0.02)
    # Half the limit expected: 2,000 tokens held 20 s, against 2,000 held 4 s.
    assert (long_answer, short_answer) == (pytest.approx(2000 * 20.0), pytest.approx(2000 * 4.0))
    # Time to the first token counts; an endpoint that publishes no TPOT is assumed at
    # the sidecar's own starting estimate.
    assert kv_cost_estimate(100, 0, ttft_s=1.5, tpot_s=0.0) == pytest.approx(150)
    assert kv_cost_estimate(0, 100, ttft_s=0.0, tpot_s=0.0) == pytest.approx(
        50 * 50 * UNKNOWN_TPOT_S
    )
    # Settled with what it generated, held from dispatch to end.
    assert kv_cost(1000, 1500, 12.0) == 2500 * 12.0
    assert kv_cost(1000, 0, 0.0) == 0.0
    with pytest.raises(ValueError, match="time >= 0"):
        kv_cost(1000, 10, -1.0)


def test_the_fair_queue_is_bounded_and_expires_with_a_retry_after() -> None:
    queue: FairQueue[int] = FairQueue(capacity_per_band=2, max_wait_s=5.0)
    queue.offer("a", "t", 0, 0.0, 1)
    queue.offer("b", "t", 0, 1.0, 2)
    with pytest.raises(QueueFullError) as refused:
        queue.offer("c", "t", 0, 2.0, 3)
    assert refused.value.retry_after_s == pytest.approx(3.0)
    assert [e.key for e in queue.expire(5.5)] == ["a"]
    assert queue.remove("b") is not None
    assert len(queue) == 0
    assert queue.counter("t") == 0.0  # nothing was served, nothing charged


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["offer", "pop", "remove", "expire"]), st.integers(0, 9)),
        max_size=80,
    )
)
def test_the_fair_queue_expires_what_a_scan_of_it_would(ops: list[tuple[str, int]]) -> None:
    """The queue's expiry heap against a scan of what waits: the same next expiry after
    every operation, and the same entries expired, in the order they were offered."""
    queue: FairQueue[int] = FairQueue(capacity_per_band=64, max_wait_s=5.0)
    waiting: dict[str, float] = {}  # what waits, by key in offer order: its expiry
    now = 0.0
    for op, n in ops:
        now += 0.25 * n
        key = f"k{n}"
        if op == "offer" and key not in waiting:
            entry = queue.offer(key, f"t{n % 3}", n % 2, now, n, max_wait_s=0.5 + n)
            waiting[key] = entry.expires_at
        elif op == "pop" and (taken := queue.pop(1.0)) is not None:
            del waiting[taken.key]
        elif op == "remove" and queue.remove(key) is not None:
            del waiting[key]
        elif op == "expire":
            due = [k for k, expires_at in waiting.items() if expires_at <= now]
            assert [e.key for e in queue.expire(now)] == due
            for k in due:
                del waiting[k]
        assert len(queue) == len(waiting)
        assert queue.next_expiry() == min(waiting.values(), default=None)


def test_the_fair_queue_forgets_the_expiries_of_what_left_it() -> None:
    """Entries taken long before their expiry do not pile up in the expiry heap."""
    queue: FairQueue[int] = FairQueue(max_wait_s=30.0)
    for i in range(1000):
        queue.offer(f"k{i}", "t", 0, i * 0.01, i)
        assert queue.pop(1.0) is not None
    assert queue.next_expiry() is None
    assert len(queue._expiries) <= 64 + 1
    queue.offer("last", "t", 0, 10.0, 0)
    assert queue.next_expiry() == 40.0
    assert [e.key for e in queue.expire(40.0)] == ["last"]


@pytest.mark.parametrize(
    ("slow", "fast"),
    [
        # The same learned prefill pace; one predicts a long wait before its prefill.
        ({"predicted_ttft_s": 3.0}, {"predicted_ttft_s": 0.1}),
        # No wait anywhere; one engine prefills 20x slower than the other.
        ({"predicted_prefill_s_per_token": 1e-3}, {"predicted_prefill_s_per_token": 5e-5}),
    ],
)
def test_the_endpoint_predicting_the_earlier_first_token_wins(
    slow: dict[str, float], fast: dict[str, float]
) -> None:
    """Two endpoints identical in everything they publish but their latency model's
    prediction: the SLO-risk term sends the request where it is predicted to make its
    TTFT objective, whichever way round they are listed."""
    model = {"predicted_prefill_s_per_token": 5e-5, "predicted_tpot_s": 0.02}
    for order in ((slow, fast), (fast, slow)):
        states = [
            _state(name, **{**model, **fields})
            for name, fields in zip(("a", "b"), order, strict=True)
        ]
        fast_one = "a" if order[0] is fast else "b"
        assert _decide(states, _request()).endpoint_id == fast_one


def test_slo_risk_reads_the_published_model_and_falls_back_to_the_calibration() -> None:
    cost = CostModel(prefill_tokens_per_s=20_000.0, ttft_slo_s=1.0)
    request = _request(prompt_tokens=10_000, max_new_tokens=100, deadline_s=5.0)
    modelled = EndpointView(
        _state("m", predicted_ttft_s=0.5, predicted_prefill_s_per_token=1e-4,
               predicted_tpot_s=0.05, waiting_prefill_tokens=400_000),
        10.0,
    )  # fmt: skip
    legacy = EndpointView(_state("l", predicted_tpot_s=0.05), 10.0)
    snapshot = PoolSnapshot("p", (modelled, legacy))
    ctx = RoutingContext(snapshot, 0.0, inflight={"m": 2})
    queue = cost.queue_s([modelled, legacy], ctx)
    risks = cost.slo_risk_s(request, [modelled, legacy], queue, ctx)
    # Modelled: the first token after 0.5 s + 2 sent since its heartbeat x 50 ms + 1 s of
    # prefill, 0.6 s past the objective; the answer 5 s later, 1.6 s past the deadline.
    # The calibrated queue (400K tokens waiting: 20 s) is the model's business, not added.
    assert risks[0] == pytest.approx(0.6 + 1.6)
    # Legacy: the prompt at the calibrated 20K tokens/s, 0.5 s, within the objective;
    # the answer at 5.5 s, past the deadline by 0.5 s.
    assert risks[1] == pytest.approx(0.5)
