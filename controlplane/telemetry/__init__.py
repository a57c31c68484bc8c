"""The catalogue of every metric family Weir exports.

Sidecars and routers create their Prometheus collectors from this catalogue (never ad hoc),
dashboards may only query names listed here, and a test checks both directions. Names
follow Prometheus conventions: counters end in `_total`, units are in the name.
"""

from controlplane.telemetry.catalog import CATALOG, MetricKind, MetricSpec, metric_names

__all__ = ["CATALOG", "MetricKind", "MetricSpec", "metric_names"]
