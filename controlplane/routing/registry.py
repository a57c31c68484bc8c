"""Plugins by name, and profiles built from configuration.

A profile is plain data (JSON, YAML, a ConfigMap):

    {"name": "default", "candidates": 4, "tie_band": 0.005,
     "cost": {"prefill_tokens_per_s": 20000},
     "filters": ["lease-valid", "not-draining", {"name": "bounded-load", "factor": 1.25},
                 {"type": "bounded-load", "name": "hard-load-cap", "factor": 2.0}],
     "scorers": [{"name": "prefix-affinity", "weight": 2, "block_tokens": 64}],
     "picker": "max-score"}

An entry's `type` is the registered plugin and its `name` the instance's, by which its
rejections and scores are reported; either one alone gives both (a name alone is the
type, as above), so two instances of one type need a `name` each. Every scorer receives
the profile's `CostModel` as `cost`; other keys are passed to the plugin's constructor,
which validates them. `tie_band` (default 0: off) spreads near-ties by the request's
hash (`controlplane.routing.profile`). Unknown types or parameters, and two filters or
two scorers of one name, raise `ProfileError` naming the offending entry.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from controlplane.contract import RoutingPolicy
from controlplane.routing import filters, pickers, scorers
from controlplane.routing.cost import CostModel
from controlplane.routing.framework import Filter, Picker, Scorer, WeightedScorer
from controlplane.routing.profile import Profile


class PluginKind(enum.StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"


class ProfileError(ValueError):
    """A profile's configuration names an unknown plugin or passes bad parameters."""


_PLUGINS: dict[PluginKind, dict[str, Callable[..., Any]]] = {kind: {} for kind in PluginKind}


def register(kind: PluginKind, name: str, factory: Callable[..., Any]) -> None:
    """Make a plugin type available to profiles under `name` (e.g. from an extension).
    `factory` takes the entry's parameters as keywords, the instance's `name` among
    them."""
    if name in _PLUGINS[kind]:
        raise ProfileError(f"{kind} {name!r} is already registered")
    _PLUGINS[kind][name] = factory


def registered(kind: PluginKind) -> tuple[str, ...]:
    return tuple(sorted(_PLUGINS[kind]))


_BUILTIN_FILTERS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("lease-valid", filters.LeaseValid),
    ("not-draining", filters.NotDraining),
    ("role-model-adapter", filters.RoleModelAdapterMatch),
    ("watermark-below-critical", filters.WatermarkBelowCritical),
    ("bounded-load", filters.BoundedLoad),
)
_BUILTIN_SCORERS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("prefix-affinity", scorers.PrefixAffinity),
    ("queue", scorers.QueueScorer),
    ("kv-pressure", scorers.KVPressureScorer),
    ("slo-risk", scorers.SLORiskScorer),
    ("load", scorers.LoadScorer),
    ("transfer", scorers.TransferScorer),
)
for _name, _factory in _BUILTIN_FILTERS:
    register(PluginKind.FILTER, _name, _factory)
for _name, _factory in _BUILTIN_SCORERS:
    register(PluginKind.SCORER, _name, _factory)
register(PluginKind.PICKER, "max-score", pickers.MaxScore)


def default_config(policy: RoutingPolicy | None = None) -> dict[str, Any]:
    """The cost model of docs/architecture.md as a profile: every term one weighted scorer,
    affinity one term among them. Near-ties are not spread (`tie_band` 0): in the
    simulator's matrix a band of 0.005 cost long_long 11 % of its goodput while several
    routers' live figures did not move with it (docs/benchmarks.md); a pool with several
    routers and an idle, uniform fleet may still want it."""
    policy = policy or RoutingPolicy()
    return {
        "name": "default",
        "candidates": 4,
        "filters": [
            "lease-valid",
            "not-draining",
            "role-model-adapter",
            "watermark-below-critical",
            {"name": "bounded-load", "factor": policy.bounded_load_factor},
        ],
        "scorers": [
            {
                "name": "prefix-affinity",
                "weight": 1.0,
                "block_tokens": policy.prefix_block_tokens,
                "owner_blocks": policy.prefix_blocks_for_owner,
                "max_wait_s": policy.max_affinity_wait_s,
            },
            {"name": "queue", "weight": 1.0},
            {"name": "kv-pressure", "weight": 1.0},
            {"name": "slo-risk", "weight": 1.0},
            {"name": "load", "weight": 0.5},
            {"name": "transfer", "weight": 0.5},
        ],
        "picker": "max-score",
    }


def profile_from_config(config: Mapping[str, Any]) -> Profile:
    if not isinstance(config, Mapping):
        raise ProfileError(f"a profile must be a mapping, got {type(config).__name__}")
    cost_params = config.get("cost", {})
    if not isinstance(cost_params, Mapping):
        raise ProfileError("profile 'cost' must be a mapping")
    try:
        cost = CostModel(**cost_params)
    except TypeError as exc:
        raise ProfileError(f"profile 'cost': {exc}") from exc
    filter_list: Sequence[Filter] = [
        _build(PluginKind.FILTER, entry, {}) for entry in _entries(config, "filters")
    ]
    scorer_list = []
    for entry in _entries(config, "scorers"):
        params = dict(_as_mapping(entry))
        weight = params.pop("weight", 1.0)
        scorer: Scorer = _build(PluginKind.SCORER, params, {"cost": cost})
        try:
            scorer_list.append(WeightedScorer(scorer, float(weight)))
        except (TypeError, ValueError) as exc:
            raise ProfileError(str(exc)) from exc
    picker: Picker = _build(PluginKind.PICKER, config.get("picker", "max-score"), {})
    candidates = config.get("candidates", 4)
    if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1:
        raise ProfileError(f"profile 'candidates' must be a positive integer, got {candidates!r}")
    if not scorer_list:
        raise ProfileError("a profile needs at least one scorer")
    band = config.get("tie_band", 0.0)
    if not (
        isinstance(band, int | float)
        and not isinstance(band, bool)
        and math.isfinite(band)
        and band >= 0
    ):
        raise ProfileError(f"profile 'tie_band' must be a number >= 0, got {band!r}")
    try:
        return Profile(
            name=str(config.get("name", "default")),
            filters=tuple(filter_list),
            scorers=tuple(scorer_list),
            picker=picker,
            candidates=candidates,
            tie_band=float(band),
        )
    except ValueError as exc:  # e.g. two filters of one name
        raise ProfileError(str(exc)) from exc


def _entries(config: Mapping[str, Any], key: str) -> list[Any]:
    entries = config.get(key, [])
    if not isinstance(entries, list):
        raise ProfileError(f"profile {key!r} must be a list")
    return entries


def _as_mapping(entry: Any) -> Mapping[str, Any]:
    if isinstance(entry, str):
        return {"name": entry}
    if isinstance(entry, Mapping):
        plugin_type, name = entry.get("type", ""), entry.get("name", "")
        if isinstance(plugin_type, str) and isinstance(name, str) and (plugin_type or name):
            return entry
    raise ProfileError(
        f"a plugin entry must be a type name or a mapping with 'type' or 'name', got {entry!r}"
    )


def _build(kind: PluginKind, entry: Any, extra: Mapping[str, Any]) -> Any:
    params = dict(_as_mapping(entry))
    name = params.pop("name", "") or params["type"]
    plugin_type = params.pop("type", "") or name
    factory = _PLUGINS[kind].get(plugin_type)
    if factory is None:
        raise ProfileError(
            f"unknown {kind} {plugin_type!r}; registered: {', '.join(registered(kind))}"
        )
    try:
        return factory(**params, **extra, name=name)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{kind} {name!r}: {exc}") from exc
