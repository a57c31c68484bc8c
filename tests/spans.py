"""Spans recorded in memory by the OpenTelemetry SDK, for tests of Weir's tracing.

The SDK's provider can be installed once per process: it is installed at the first test
that asks, and records only while such a test runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class _WhileRecording(SimpleSpanProcessor):
    recording = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_PROCESSOR = _WhileRecording(_EXPORTER)


@contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(_PROCESSOR)
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _PROCESSOR.recording = True
    try:
        yield _EXPORTER
    finally:
        _PROCESSOR.recording = False
        _EXPORTER.clear()
