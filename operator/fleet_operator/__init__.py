"""The InferencePool operator.

Pure parts (no I/O): `spec` reads a pool and derives its `PoolPolicy`, `rendering` builds
its children, `status` and `scaling` decide conditions and replica counts from
observations. Edges: `fleet` reads and writes the control plane (Redis), `applying`,
`reconciling` and `observing` talk to the Kubernetes API, and `handlers` registers it all
with kopf (`build_registry`; run it with `weir operator`). `docs` generates the reference
documents and `dashboards` loads the Grafana dashboards' PromQL.
"""

from fleet_operator.config import OperatorConfig
from fleet_operator.dashboards import DashboardQuery, dashboard_queries, promql_metrics
from fleet_operator.fleet import (
    ControlPlane,
    ControlPlaneUnreachableError,
    FleetObservation,
    RedisControlPlane,
)
from fleet_operator.spec import InvalidPoolError, Pool, PoolSpec, parse_pool

__all__ = [
    "ControlPlane",
    "ControlPlaneUnreachableError",
    "DashboardQuery",
    "FleetObservation",
    "InvalidPoolError",
    "OperatorConfig",
    "Pool",
    "PoolSpec",
    "RedisControlPlane",
    "dashboard_queries",
    "parse_pool",
    "promql_metrics",
]
