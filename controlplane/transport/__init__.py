"""The wire under the request path: a lean HTTP/1.1 client for engine streams and the
server-sent-event framing of their bodies, shared by the router and the sidecar.

`HTTPClient().request(method, url, body, headers)` returns a `Response` once its head has
arrived (`status`, `headers` with lower-case names, `content_type`); its body is read once,
with `read()`, `chunks()` or `events()` (lists of `SSEEvent`, a network read's worth at a
time), inside `async with response:`. Failures on the wire are `TransportError`, one
subclass per kind (`controlplane.transport.http` draws the tree), each naming itself in
`reason`.
"""

from controlplane.transport.http import (
    MAX_CONNECTIONS_PER_ORIGIN,
    TRANSPORT_REASONS,
    ClosedError,
    ConnectError,
    ConnectTimeoutError,
    HTTPClient,
    PoolTimeoutError,
    ProtocolError,
    ReadTimeoutError,
    Response,
    TransportError,
)
from controlplane.transport.sse import SSEEvent, SSEFramer

__all__ = [
    "MAX_CONNECTIONS_PER_ORIGIN",
    "TRANSPORT_REASONS",
    "ClosedError",
    "ConnectError",
    "ConnectTimeoutError",
    "HTTPClient",
    "PoolTimeoutError",
    "ProtocolError",
    "ReadTimeoutError",
    "Response",
    "SSEEvent",
    "SSEFramer",
    "TransportError",
]
