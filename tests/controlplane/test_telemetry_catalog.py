"""The metric catalogue: well-formed names, and docs/metrics.md generated from it."""

from __future__ import annotations

import re
from pathlib import Path

from controlplane.telemetry import CATALOG, MetricKind, metric_names
from controlplane.telemetry.catalog import LENGTH_BUCKETS, length_bucket, render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_names_are_unique_and_follow_prometheus_conventions() -> None:
    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))
    for spec in CATALOG:
        assert re.fullmatch(r"weir_(sidecar|router)_[a-z0-9_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind is MetricKind.COUNTER), spec.name
        assert (spec.kind is MetricKind.HISTOGRAM) == bool(spec.buckets), spec.name
        assert list(spec.buckets) == sorted(spec.buckets), spec.name


def test_histograms_expand_to_their_series() -> None:
    assert "weir_router_decision_seconds_bucket" in metric_names()
    assert "weir_router_decision_seconds" not in metric_names()
    assert "weir_sidecar_kv_used_tokens" in metric_names()


def test_metrics_doc_is_generated_from_the_catalogue() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert doc == render_markdown(), (
        "regenerate: python -m controlplane.telemetry > docs/metrics.md"
    )


def test_router_and_sidecar_label_lengths_alike() -> None:
    """One labelling for both hops (`input_bucket`, `output_bucket`), so series join."""
    lengths = (1, 256, 257, 1024, 4096, 16384, 16385)
    assert [length_bucket(n) for n in lengths] == [
        "le256", "le256", "le1024", "le1024", "le4096", "le16384", "gt16384",
    ]  # fmt: skip
    assert set(map(length_bucket, lengths)) == set(LENGTH_BUCKETS)
