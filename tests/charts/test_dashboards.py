"""Every query of every dashboard reads only metrics Weir exports (the telemetry catalogue),
and every dashboard is well formed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from controlplane.telemetry.catalog import CATALOG, metric_names
from fleet_operator.dashboards import DASHBOARDS, DashboardQuery, dashboard_queries, promql_metrics
from tests.tiers import unavailable

QUERIES = dashboard_queries()


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.dashboard}: {q.panel}")
def test_every_query_reads_exported_metrics(query: DashboardQuery) -> None:
    assert query.metrics, query.expr
    assert query.metrics <= metric_names(), query.metrics - metric_names()


def test_the_required_views_are_there() -> None:
    titles = {json.loads(p.read_text())["title"] for p in DASHBOARDS.glob("*.json")}
    assert titles == {"Weir / Fleet overview", "Weir / Latency", "Weir / Tenants"}


def test_every_family_weir_exports_is_on_a_dashboard() -> None:
    """A family no panel reads is one an operator cannot see without writing PromQL."""
    read = frozenset().union(*(q.metrics for q in QUERIES))
    unseen = [spec.name for spec in CATALOG if read.isdisjoint(spec.series_names())]
    assert unseen == []


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    for path in DASHBOARDS.glob("*.json"):
        board = json.loads(path.read_text())
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, (path.name, panel["title"])
            if panel["type"] != "row":
                assert panel["description"], (path.name, panel["title"])


def test_metric_extraction_and_expansion() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, tenant) (rate(weir_router_ttft_seconds_bucket"
        '{pool=~"$pool", tenant=~"$tenant"}[$__rate_interval]))) / on(pool) group_left '
        "max by (pool) (weir_router_ring_version)"
    )
    assert promql_metrics(expr) == {"weir_router_ttft_seconds_bucket", "weir_router_ring_version"}
    assert promql_metrics("label_values(weir_router_requests_total, tenant)") == {
        "weir_router_requests_total"
    }
    expanded = DashboardQuery("d", "p", expr).expanded()
    assert "$" not in expanded
    assert "[1m]" in expanded


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """Prometheus' own parser (promtool, from the prometheus package) accepts every panel
    query once Grafana's variables are substituted."""
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("Prometheus", "promtool is not installed; run scripts/bootstrap.sh dev")
    promql = [q for q in QUERIES if q.is_promql]
    assert len(promql) >= 40
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [
                    {"record": f"weir:dashboard_query:{i}", "expr": q.expanded()}
                    for i, q in enumerate(promql)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(promql)} rules found" in out.stdout
