"""Reading a Prometheus exposition in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def by_label(exposition: str | bytes, sample: str, label: str) -> dict[str, float]:
    """The values of the samples named `sample`, keyed by their `label`."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    }
