"""The PromQL behind Weir's Grafana dashboards (charts/weir/dashboards/*.json), in a form
tests and the end-to-end check can load: every panel target's `expr` and every templating
variable's query, with the metric names each one reads.

`DashboardQuery.expanded()` substitutes Grafana's variables so a query can be sent to a
plain Prometheus: `$pool` and `$tenant` match everything, `$__rate_interval` becomes a
fixed window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "weir" / "dashboards"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
# PromQL functions, aggregations and keywords (the identifiers that are not metrics).
_NOT_METRICS = frozenset(
    [
        "abs",
        "absent",
        "absent_over_time",
        "acos",
        "acosh",
        "and",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "avg",
        "avg_over_time",
        "bool",
        "bottomk",
        "by",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "count",
        "count_over_time",
        "count_values",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "deg",
        "delta",
        "deriv",
        "exp",
        "floor",
        "group",
        "group_left",
        "group_right",
        "histogram_quantile",
        "holt_winters",
        "hour",
        "idelta",
        "ignoring",
        "increase",
        "inf",
        "irate",
        "label_join",
        "label_replace",
        "last_over_time",
        "ln",
        "log10",
        "log2",
        "max",
        "max_over_time",
        "min",
        "min_over_time",
        "minute",
        "month",
        "nan",
        "offset",
        "on",
        "or",
        "predict_linear",
        "present_over_time",
        "quantile",
        "quantile_over_time",
        "rad",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sin",
        "sinh",
        "sort",
        "sort_desc",
        "sqrt",
        "stddev",
        "stddev_over_time",
        "stdvar",
        "stdvar_over_time",
        "sum",
        "sum_over_time",
        "tan",
        "tanh",
        "time",
        "timestamp",
        "topk",
        "unless",
        "vector",
        "without",
        "year",
    ]
)


@dataclass(frozen=True, slots=True)
class DashboardQuery:
    dashboard: str
    panel: str
    expr: str

    @property
    def metrics(self) -> frozenset[str]:
        return promql_metrics(self.expr)

    @property
    def is_promql(self) -> bool:
        """False for Grafana's own `label_values(...)` variable queries."""
        return not _LABEL_VALUES.match(self.expr.strip())

    def expanded(self, variables: Mapping[str, str] | None = None) -> str:
        values = {"pool": ".+", "tenant": ".*", "__rate_interval": "1m", **(variables or {})}
        expr = self.expr
        for name in sorted(values, key=len, reverse=True):
            expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
        return expr


def promql_metrics(expr: str) -> frozenset[str]:
    """Metric names an expression reads (also from `label_values(metric, label)`)."""
    found = set(_LABEL_VALUES.findall(expr))
    if found:
        return frozenset(found)
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return frozenset(name for name in _IDENT.findall(text) if name not in _NOT_METRICS)


def _targets(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        for target in panel.get("targets") or []:
            if target.get("expr"):
                yield panel.get("title", ""), target["expr"]
        yield from _targets(panel.get("panels") or [])


def dashboard_queries(directory: Path = DASHBOARDS) -> list[DashboardQuery]:
    """Every query of every dashboard in `directory`, in file and panel order."""
    queries = []
    for path in sorted(directory.glob("*.json")):
        board = json.loads(path.read_text())
        title = board.get("title", path.stem)
        queries += [DashboardQuery(title, panel, expr) for panel, expr in _targets(board["panels"])]
        for variable in (board.get("templating") or {}).get("list") or []:
            query = variable.get("query")
            text = query.get("query") if isinstance(query, dict) else None
            if variable.get("type") == "query" and text:
                queries.append(DashboardQuery(title, f"variable {variable['name']}", text))
    return queries
