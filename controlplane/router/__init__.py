"""The router's HTTP edge: an OpenAI- and SGLang-compatible router for one pool.

`serve_router(config, ...)` starts one in the running event loop and returns a
`RunningRouter` (`.url`, `.router`, `await .close()`). The pool comes either from the
control plane (`redis_url`: the change feed, leases, ownership) or from a fixed list of
engine URLs (`endpoints`). Routes: `POST /v1/chat/completions`, `/v1/completions`,
`/generate`; `GET /v1/models`, `/health`, `/ready`, `/metrics`, `/weir/v1/pool`. Request
fields and headers are documented in `controlplane.router.requests`; errors in
`controlplane.router.errors`; the settings (`RouterConfig` and its groups) in
`controlplane.router.config`.
"""

from controlplane.router.app import Router
from controlplane.router.config import (
    HandoffSettings,
    QuotaSettings,
    RouterConfig,
    SettingError,
    UpstreamSettings,
)
from controlplane.router.errors import RouterError
from controlplane.router.pool import PoolView, StoreFeed, static_endpoints
from controlplane.router.requests import ClientRequest, RequestLimits
from controlplane.router.serve import RunningRouter, serve_router
from controlplane.router.tenants import TenantKeys

__all__ = [
    "ClientRequest",
    "HandoffSettings",
    "PoolView",
    "QuotaSettings",
    "RequestLimits",
    "Router",
    "RouterConfig",
    "RouterError",
    "RunningRouter",
    "SettingError",
    "StoreFeed",
    "TenantKeys",
    "UpstreamSettings",
    "serve_router",
    "static_endpoints",
]
