"""The built-in plugins fused into one pass over the shortlist.

Running the plugins costs a call, a list and often a cost-model call per plugin per
decision, which is most of a decision's time over a shortlist of a few endpoints. A
profile made only of built-in filters (any subset, any order), built-in scorers (each at
most once, in the canonical order of `default_config`, sharing one cost model) and the
max-score picker is compiled once into a `FusedPipeline` that evaluates every filter
predicate and every scorer term per candidate in a single loop.

It decides exactly as the plugins do: the same kept candidates, bit-identical totals (the
weighted sum is added in scorer order, as `sum(map(mul, ...))` does on Python 3.11, and an
absent scorer contributes `0.0 * score`, which leaves a non-negative sum unchanged), the
same pick and the same rejection counts (built-in filters judge each candidate alone, so
running them in sequence counts a candidate against the first one it fails), near-ties
spread alike (`framework.spread_ties` over the same totals and prefix-affinity scores).
tests/router/test_fused.py compares the two over random pools.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import cast

from controlplane.contract import Role, WatermarkState
from controlplane.routing.cost import CostModel
from controlplane.routing.filters import (
    BoundedLoad,
    LeaseValid,
    NotDraining,
    RoleModelAdapterMatch,
    WatermarkBelowCritical,
)
from controlplane.routing.framework import (
    _NO_REJECTIONS,
    Decision,
    DecisionReason,
    Filter,
    Picker,
    WeightedScorer,
    spread_ties,
)
from controlplane.routing.pickers import MaxScore
from controlplane.routing.scorers import (
    KVPressureScorer,
    LoadScorer,
    PrefixAffinity,
    QueueScorer,
    SLORiskScorer,
    TransferScorer,
)
from controlplane.routing.snapshot import EndpointView, RouteRequest, RoutingContext

_SCORER_ORDER: tuple[type, ...] = (
    PrefixAffinity,
    QueueScorer,
    KVPressureScorer,
    SLORiskScorer,
    LoadScorer,
    TransferScorer,
)
_BuiltinScorer = (
    PrefixAffinity | QueueScorer | KVPressureScorer | SLORiskScorer | LoadScorer | TransferScorer
)
# The built-in filters in the order of the fused loop's per-candidate pass flags.
_FILTER_CHECKS: tuple[type, ...] = (
    LeaseValid,
    NotDraining,
    RoleModelAdapterMatch,
    WatermarkBelowCritical,
    BoundedLoad,
)
_CRITICAL = WatermarkState.CRITICAL.rank
_NEVER = -math.inf  # a lease deadline every endpoint beats: lease-valid not in the profile
# `FusedPipeline._constants`, in the order `decide` unpacks them.
_Constants = tuple[
    bool, bool, float, bool, float,  # draining, match, max rank, lease, load factor
    int, int, float,  # block tokens, owner tokens, max wait
    float, float, float, float, float, float, float, int, float,  # the cost model's
    float, float, float, float, float, float,  # weights
    float, float, float, float, float, float,  # halves
    float, float, float, float,  # shared terms
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class FusedPipeline:
    """A profile's built-in filters, scorers and picker as constants of one loop."""

    # (index into the per-candidate pass flags, filter name), in the profile's order.
    filter_order: tuple[tuple[int, str], ...]
    check_lease: bool
    check_draining: bool
    check_match: bool
    check_watermark: bool
    load_factor: float  # 0: bounded-load is not in the profile
    cost: CostModel
    block_tokens: int  # prefix affinity's
    owner_tokens: int  # the tokens the primary owner is credited with
    max_wait_s: float
    weights: tuple[float, float, float, float, float, float]
    halves: tuple[float, float, float, float, float, float]
    tie_band: float = 0.0  # the profile's
    has_affinity: bool = True  # prefix affinity is one of the profile's scorers
    _constants: _Constants = field(init=False, repr=False, compare=False)
    # Pass flags with a failure -> the profile's first filter among those failed.
    _blame: Mapping[tuple[bool, ...], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cost, weights, halves = self.cost, self.weights, self.halves
        w_slo, w_load, w_transfer = weights[3], weights[4], weights[5]
        h_slo, h_load, h_transfer = halves[3], halves[4], halves[5]
        constants: _Constants = (
            self.check_draining,
            self.check_match,
            _CRITICAL if self.check_watermark else math.inf,
            self.check_lease,
            self.load_factor,
            self.block_tokens,
            self.owner_tokens,
            self.max_wait_s,
            cost.prefill_tokens_per_s,
            cost.queued_request_s,
            cost.expected_output_fraction,
            cost.kv_penalty_s,
            cost.kv_penalty_s * 1e3,
            cost.ttft_slo_s,
            cost.load_penalty_s,
            cost.kv_bytes_per_token,
            cost.transfer_bytes_per_s,
            *weights,
            *halves,
            # The weighted terms most candidates share whatever the request, as the plugins
            # compute them: no SLO risk, no load above the mean, nothing shipped (a prefill
            # request's term for a non-prefill endpoint) and a non-prefill request's term.
            w_slo * (h_slo / (h_slo + 0.0)),
            w_load * (h_load / (h_load + 0.0)),
            w_transfer * (h_transfer / (h_transfer + 0.0)),
            w_transfer * 1.0,
        )
        object.__setattr__(self, "_constants", constants)
        blame = {}
        for passes in product((True, False), repeat=len(_FILTER_CHECKS)):
            failed = [name for check, name in self.filter_order if not passes[check]]
            if failed:
                blame[passes] = failed[0]
        object.__setattr__(self, "_blame", blame)

    def decide(
        self,
        request: RouteRequest,
        ctx: RoutingContext,
        holders: Mapping[str, int],
        mean_load: float,
        shortlist: Sequence[EndpointView],
    ) -> Decision:
        # Per-decision terms, computed once (the plugins compute them once per plugin);
        # the profile's own constants come unpacked from one tuple.
        (
            check_draining, check_match, max_rank, lease_checked, load_factor,
            block, owner_tokens, max_wait,
            rate, per_request, output_fraction, kv_penalty, kv_full, slo, load_penalty,
            kv_bytes, transfer_rate,
            w_prefix, w_queue, w_kv, w_slo, w_load, w_transfer,
            h_prefix, h_queue, h_kv, h_slo, h_load, h_transfer,
            slo_met, load_under, transfer_unshipped, transfer_mixed,
        ) = self._constants  # fmt: skip
        inflight, blame = ctx.inflight, self._blame
        ready = len(ctx.snapshot.preferred) or 1
        bound = (
            math.ceil(load_factor * (mean_load * ready + 1.0) / ready) if load_factor else math.inf
        )
        lease_now = ctx.now if lease_checked else _NEVER
        model, role, adapter = request.model, request.role, request.adapter
        prompt, tokens, deadline = request.prompt_tokens, request.max_new_tokens, request.deadline_s
        owners = request.owners
        first_owner = owners[0] if owners else None
        second_owner = owners[1] if len(owners) > 1 else None
        own = prompt + tokens * output_fraction
        base = prompt / rate - slo
        load_scale = load_penalty / (mean_load + 1.0)
        # The prefix score of a candidate with no cache credit, as the plugins compute it.
        affinity_uncached = h_prefix / (h_prefix + (prompt / rate if prompt > 0 else 0.0))
        band = self.tie_band
        affinities: list[float] = []  # each kept candidate's, when near-ties are spread
        if role is Role.PREFILL:
            shipped = prompt * kv_bytes / transfer_rate
            transfer_prefill = w_transfer * (h_transfer / (h_transfer + shipped))
            transfer_other = transfer_unshipped
        else:
            transfer_prefill = transfer_other = transfer_mixed

        kept: list[EndpointView] = []
        totals: list[float] = []
        rejected: dict[str, int] | None = None
        chosen, best, runner_up = 0, -math.inf, -math.inf
        for view in shortlist:
            endpoint_id = view.endpoint_id
            extra = inflight.get(endpoint_id, 0) if inflight else 0
            load = view.reported_load + extra
            state = view.state
            passes = (
                view.lease_deadline > lease_now,
                view.routable or not check_draining,
                not check_match
                or (
                    state.model == model
                    and state.role is role
                    and (not adapter or adapter in state.adapters)
                ),
                view.watermark_rank < max_rank,
                load < bound,
            )
            # Sequential filters count a candidate against the first one it fails (a check
            # of a filter the profile lacks fails only on a NaN or -inf lease: kept, as the
            # plugins keep it).
            if False in passes and (name := blame.get(passes)) is not None:
                if rejected is None:
                    rejected = {}
                rejected[name] = rejected.get(name, 0) + 1
                continue

            queue = (
                view.waiting_prefill_tokens / rate + (view.queued_requests + extra) * per_request
            )
            cached = holders.get(endpoint_id, 0) * block if holders else 0
            if endpoint_id == first_owner and cached < owner_tokens:
                cached = owner_tokens
            if endpoint_id == second_owner and cached < owner_tokens // 2:
                cached = owner_tokens // 2
            if cached and not queue > max_wait:  # a long queue voids cache credit
                uncached = (prompt - cached) / rate if cached < prompt else 0.0
                affinity = h_prefix / (h_prefix + uncached)
            else:
                affinity = affinity_uncached
            capacity = view.kv_capacity_tokens
            if capacity > 0 and (c := (view.kv_committed_tokens + own) / capacity) < 1.0:
                kv = kv_penalty * c * c / (1.0 - c)
            else:
                kv = kv_full
            late = queue + base + view.predicted_ttft_s
            if deadline <= 0:
                risk = late if late > 0.0 else 0.0
            else:
                missed = late + slo + tokens * view.predicted_tpot_s - deadline
                risk = (late if late > 0.0 else 0.0) + (missed if missed > 0.0 else 0.0)
            total = (
                w_prefix * affinity
                + w_queue * (h_queue / (h_queue + queue))
                + w_kv * (h_kv / (h_kv + kv))
                + (w_slo * (h_slo / (h_slo + risk)) if risk else slo_met)
                + (
                    w_load * (h_load / (h_load + load_scale * (load - mean_load)))
                    if load > mean_load
                    else load_under
                )
                + (transfer_prefill if view.is_prefill else transfer_other)
            )
            if total > best or not kept:  # MaxScore: the first of the highest
                chosen, best, runner_up = len(kept), total, best
            elif total > runner_up:
                runner_up = total
            kept.append(view)
            totals.append(total)
            if band:
                affinities.append(affinity)

        if rejected is not None and len(rejected) > 1:  # in filter order, as the plugins count
            counts = rejected
            rejected = {name: counts[name] for _, name in self.filter_order if name in counts}
        if not kept:
            return Decision(
                "", DecisionReason.NO_CANDIDATE, False, rejected=rejected or _NO_REJECTIONS
            )
        if band and runner_up >= best - band:  # a near-tie: rare, so checked first
            chosen = spread_ties(
                request, kept, totals, affinities if self.has_affinity else None, chosen, band
            )
        return Decision.of(request, kept, totals, chosen, rejected)


def fuse(
    filters: Sequence[Filter],
    scorers: Sequence[WeightedScorer],
    picker: Picker,
    tie_band: float = 0.0,
) -> FusedPipeline | None:
    """The fused form of these plugins, or None when any is not one it reproduces."""
    picker_type: type = type(picker)
    if picker_type is not MaxScore or not scorers:
        return None
    if any(type(f) not in _FILTER_CHECKS for f in filters):
        return None
    if len({type(f) for f in filters}) < len(filters):
        return None
    kinds: list[type] = [type(ws.scorer) for ws in scorers]
    if any(kind not in _SCORER_ORDER for kind in kinds):
        return None
    positions = [_SCORER_ORDER.index(kind) for kind in kinds]
    if positions != sorted(set(positions)):  # a repeat or another order: its own float sum
        return None
    present = cast(list[_BuiltinScorer], [ws.scorer for ws in scorers])
    costs = {scorer.cost for scorer in present}
    if len(costs) != 1:
        return None
    (cost,) = costs
    if not cost.prefill_tokens_per_s > 0:  # the fused loop divides by it for every term
        return None
    # Absent scorers keep their defaults and weigh 0.
    weights = [0.0] * len(_SCORER_ORDER)
    terms: list[_BuiltinScorer] = [kind(cost=cost) for kind in _SCORER_ORDER]
    for position, weighted, scorer in zip(positions, scorers, present, strict=True):
        if not math.isfinite(weighted.weight):  # inf * a zero score: leave it to the plugins
            return None
        weights[position] = weighted.weight
        terms[position] = scorer
    affinity = terms[0]
    assert isinstance(affinity, PrefixAffinity)
    by_type: dict[type, Filter] = {type(f): f for f in filters}
    bounded = by_type.get(BoundedLoad)
    return FusedPipeline(
        filter_order=tuple((_FILTER_CHECKS.index(type(f)), f.name) for f in filters),
        check_lease=LeaseValid in by_type,
        check_draining=NotDraining in by_type,
        check_match=RoleModelAdapterMatch in by_type,
        check_watermark=WatermarkBelowCritical in by_type,
        load_factor=bounded.factor if isinstance(bounded, BoundedLoad) else 0.0,
        cost=cost,
        block_tokens=affinity.block_tokens,
        owner_tokens=affinity.owner_blocks * affinity.block_tokens,
        max_wait_s=affinity.max_wait_s,
        weights=(weights[0], weights[1], weights[2], weights[3], weights[4], weights[5]),
        halves=(
            terms[0].half_at_s,
            terms[1].half_at_s,
            terms[2].half_at_s,
            terms[3].half_at_s,
            terms[4].half_at_s,
            terms[5].half_at_s,
        ),
        tie_band=tie_band,
        has_affinity=PrefixAffinity in kinds,
    )
