"""Every Grafana dashboard query returns data from a real Prometheus scraping a local fleet.

The fleet is `weir up`'s (real Redis, reference engines, sidecars, router as processes); the
traffic covers what the panels show: streamed requests from two tenants, a client that
disconnects mid-stream, and a request the router refuses. Queries are sent as Grafana would,
with `$pool` and `$tenant` matching everything.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from openai import OpenAI

from fleet_operator.dashboards import DashboardQuery, dashboard_queries
from weir.local.fleet import FleetConfig, LocalFleet
from weir.local.prometheus import PrometheusServer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

QUERIES = dashboard_queries()


def _target(url: str) -> str:
    return urlsplit(url).netloc


def _traffic(fleet: LocalFleet) -> None:
    with OpenAI(base_url=fleet.router_url + "/v1", api_key="unused", max_retries=0) as client:
        for i in range(6):
            stream = client.chat.completions.create(
                model=fleet.model,
                messages=[{"role": "user", "content": f"dashboard request {i} " * (1 + 40 * i)}],
                max_tokens=16 + 8 * i,
                stream=True,
                extra_headers={"x-weir-tenant": "batch" if i % 2 else "interactive"},
                extra_body={"ignore_eos": True},
            )
            assert sum(len(c.choices[0].delta.content or "") for c in stream if c.choices) > 0
    # A client that leaves mid-stream: the cancel path (router → sidecar → engine abort).
    leaving = _post(fleet, {"model": fleet.model, "prompt": "leave early", "max_tokens": 4000,
                            "stream": True, "ignore_eos": True})  # fmt: skip
    with urllib.request.urlopen(leaving, timeout=30) as response:
        assert response.read(64)
    # A request the router refuses: an unknown model.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(_post(fleet, {"model": "nope", "prompt": "x", "max_tokens": 1}))
    assert refused.value.code == 404
    refused.value.close()


def _post(fleet: LocalFleet, body: dict[str, object]) -> urllib.request.Request:
    return urllib.request.Request(
        fleet.router_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


@pytest.fixture(scope="module")
def scraped() -> Iterator[PrometheusServer]:
    with LocalFleet(FleetConfig(engines=2, router_port=0, speed_factor=20)) as fleet:
        jobs = {
            "weir-router": [_target(fleet.router_url)],
            "weir-sidecar": [_target(url) for url in fleet.sidecar_urls],
        }
        with PrometheusServer(jobs, scrape_interval_s=0.5) as prometheus:
            prometheus.wait_for_scrapes()
            _traffic(fleet)
            time.sleep(2.0)  # four scrape intervals: rates need two samples after the traffic
            prometheus.wait_for_scrapes(scrapes=4)
            yield prometheus


def test_every_fleet_process_is_scraped(scraped: PrometheusServer) -> None:
    assert len(scraped.targets_up()) == 3
    assert all(scraped.targets_up().values())


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.dashboard}: {q.panel}" for q in QUERIES])
def test_dashboard_query_returns_data(scraped: PrometheusServer, query: DashboardQuery) -> None:
    expr = query.expanded({"__rate_interval": "1m"})
    # A Grafana variable's `label_values(metric, label)` lists the label values of `metric`.
    expr = re.sub(r"^label_values\(\s*([^,)]+).*\)$", r"\1", expr)
    assert scraped.query(expr), f"no data for {query.dashboard} / {query.panel}: {expr}"
