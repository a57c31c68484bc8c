"""The local Prometheus really scrapes and answers PromQL (the e2e dashboard check uses it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from weir.local.ports import free_port
from weir.local.prometheus import PrometheusServer


@pytest.fixture
def exporter() -> Iterator[int]:
    registry = CollectorRegistry()
    Counter("weir_probe_total", "A probe counter.", ["kind"], registry=registry).labels(
        kind="a"
    ).inc(3)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield port
    server.shutdown()
    server.server_close()
    thread.join()


def test_scrapes_an_exporter_and_evaluates_queries(exporter: int) -> None:
    with PrometheusServer({"probe": [f"127.0.0.1:{exporter}"]}, scrape_interval_s=0.5) as prom:
        prom.wait_for_scrapes()
        assert prom.targets_up() == {f"127.0.0.1:{exporter}": True}
        [sample] = prom.query('sum by (kind) (weir_probe_total{job="probe"})')
        assert sample["metric"] == {"kind": "a"}
        assert sample["value"][1] == "3"  # type: ignore[index]


def test_rejects_malformed_promql(exporter: int) -> None:
    with (
        PrometheusServer({"probe": [f"127.0.0.1:{exporter}"]}) as prom,
        pytest.raises(ValueError, match="rejected"),
    ):
        prom.query("sum(")
