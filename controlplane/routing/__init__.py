"""Routing policy: which endpoint serves a request, and who waits when none can.

Pure over immutable snapshots with an injected clock, so the router runs it live and the
fleet simulator runs it in virtual time:

- `snapshot`: `PoolSnapshot`, `EndpointView`, `RouteRequest`, `RoutingContext`;
- `framework`: the `Filter` / `Scorer` / `Picker` protocols, the `PlacementHook` a
  plugin keeps its own state with, and the `Decision`;
- `filters`, `scorers`, `pickers`: the built-in plugins; `cost`: the cost model the
  scorers are made of;
- `profile`: the `Profile` pipeline (filters → weighted scorers → picker) that runs them;
  `registry`: plugins by name and profiles from configuration;
- `prefix_index`: the approximate per-endpoint block index;
- `fair_queue`: the bounded, tenant-fair admission queue (its rule:
  `controlplane.rules.fairness`);
- `inflight`: what a router sent that its snapshot does not show yet;
- `dispatch`: the `Dispatcher` that the router and the simulator both drive: route or
  queue, reserve, charge, pump, resume.
- `pairing`: a P/D pair's decode endpoint, picked over the decode pool's dispatch core
  before either leg starts (the router's `Pairing` and the simulator alike).
"""

from controlplane.routing.cost import CostModel
from controlplane.routing.dispatch import (
    Decider,
    Dispatcher,
    Placed,
    Refusal,
    Refused,
)
from controlplane.routing.fair_queue import FairQueue, QueueEntry, QueueFullError
from controlplane.routing.framework import (
    Cycle,
    Decision,
    DecisionReason,
    Filter,
    Picker,
    PlacementHook,
    Scorer,
    WeightedScorer,
)
from controlplane.routing.inflight import InFlight
from controlplane.routing.prefix_index import PrefixIndex
from controlplane.routing.profile import SATURATION, Profile
from controlplane.routing.registry import (
    PluginKind,
    ProfileError,
    default_config,
    profile_from_config,
    register,
    registered,
)
from controlplane.routing.snapshot import (
    EndpointView,
    PoolSnapshot,
    PrefixLookup,
    RouteRequest,
    RoutingContext,
)

__all__ = [
    "SATURATION",
    "CostModel",
    "Cycle",
    "Decider",
    "Decision",
    "DecisionReason",
    "Dispatcher",
    "EndpointView",
    "FairQueue",
    "Filter",
    "InFlight",
    "Picker",
    "Placed",
    "PlacementHook",
    "PluginKind",
    "PoolSnapshot",
    "PrefixIndex",
    "PrefixLookup",
    "Profile",
    "ProfileError",
    "QueueEntry",
    "QueueFullError",
    "Refusal",
    "Refused",
    "RouteRequest",
    "RoutingContext",
    "Scorer",
    "WeightedScorer",
    "default_config",
    "profile_from_config",
    "register",
    "registered",
]
