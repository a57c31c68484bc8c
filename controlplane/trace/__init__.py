"""One request, one story: its id across the hops, and what each hop decided about it.

See `controlplane.trace.trail` (request ids, decision records, log context) and
`controlplane.trace.spans` (OpenTelemetry)."""
