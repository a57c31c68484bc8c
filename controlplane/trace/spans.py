"""OpenTelemetry spans on the request path: the router's request and its upstream
attempts, the sidecar's request and its engine segments, one trace across the hops.

Off by default: until an SDK is installed the API's tracer makes non-recording spans, so
the request path pays a few hundred nanoseconds a span. `configure_tracing` installs the
SDK with an OTLP/HTTP exporter when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the SDK reads the other standard variables
itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, headers).
Context crosses each hop in W3C `traceparent`/`tracestate` headers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context

TRACER = trace.get_tracer("weir")
SERVER = trace.SpanKind.SERVER
CLIENT = trace.SpanKind.CLIENT

log = logging.getLogger(__name__)

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def incoming(headers: Mapping[str, str]) -> Context:
    """The trace context a request arrived with (a fresh one without `traceparent`)."""
    return propagate.extract(headers)


def outgoing(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`headers` with the current span's context added, for the next hop."""
    propagate.inject(headers)
    return headers


def configure_tracing(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Export spans over OTLP/HTTP when an OTLP endpoint is configured; False (spans off)
    when none is."""
    if not any(env.get(name) for name in _ENDPOINT_VARIABLES):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, names the service instead.
    named = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(named))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing: spans exported over OTLP/HTTP as service %s", service)
    return True
