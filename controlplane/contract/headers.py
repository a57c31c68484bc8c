"""HTTP headers between clients, routers and sidecars: named once, here.

A client may send the first three (the router also accepts body fields, see
`controlplane.router.requests`); a router sets all of them on the request it forwards to a
sidecar, and a sidecar trusts them only from its router.
"""

from typing import Final

PRIORITY: Final = "x-weir-priority"
"""Integer in [-1000, 1000]; higher runs first."""
DEADLINE_MS: Final = "x-weir-deadline-ms"
"""Time budget in milliseconds, counted from when the receiver got the request."""
TENANT: Final = "x-weir-tenant"
"""The tenant the router resolved from the API key ("default" when keys are off)."""
REQUEST_ID: Final = "x-weir-request-id"
"""The router's id of the client request, stable across retries and resumes (a sidecar
answers with its own rid for it, which starts with that id)."""
CLIENT_REQUEST_ID: Final = "x-request-id"
"""The client's id for its request, kept when Weir can carry it (see
`controlplane.trace.trail`); every answer of router and sidecar names the id in it."""
MIGRATABLE: Final = "x-weir-migratable"
"""`1` when the router can splice a `weir.preempted` continuation into the client's stream."""
ENDPOINT: Final = "x-weir-endpoint"
"""Set on the router's reply: the endpoint that served the request."""
PREFIX_BLOCK: Final = "x-weir-prefix-block"
"""The last of the prompt's chained block hashes as the router keys it
(`controlplane.ownership.block_hashes`), 16 hex digits: a sidecar that moves the
request's pages to its engine's host tier publishes it (`EndpointState.host_prefixes`)."""
