"""The router's HTTP edge: an OpenAI- and SGLang-compatible gateway for one pool.

`serve_gateway(config, ...)` starts one in the running event loop and returns a
`RunningGateway` (`.url`, `.gateway`, `await .close()`). The pool comes either from the
control plane (`redis_url`: the change feed, leases, ownership) or from a fixed list of
engine URLs (`endpoints`). Routes: `POST /v1/chat/completions`, `/v1/completions`,
`/generate`; `GET /v1/models`, `/health`, `/ready`, `/metrics`, `/weir/v1/pool`. Request
fields and headers are documented in `controlplane.gateway.requests`; errors in
`controlplane.gateway.errors`.
"""

from controlplane.gateway.app import Gateway, GatewayConfig
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.pool import PoolView, StoreFeed, static_endpoints
from controlplane.gateway.requests import ClientRequest, Limits
from controlplane.gateway.serve import RunningGateway, serve_gateway
from controlplane.gateway.tenants import TenantKeys

__all__ = [
    "ClientRequest",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "Limits",
    "PoolView",
    "RunningGateway",
    "StoreFeed",
    "TenantKeys",
    "serve_gateway",
    "static_endpoints",
]
