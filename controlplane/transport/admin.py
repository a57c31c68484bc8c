"""The admin routes' bearer token, as router and sidecar check it."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from controlplane.contract.vocabulary import error_body

Handler = Callable[[web.Request], Awaitable[web.Response]]


def admin_only(token: str, service: str, handler: Handler) -> Handler:
    """`handler` behind `token` (`Authorization: Bearer TOKEN`): 401 without it or with
    another. An empty `token` leaves the route open (the service warns at start)."""
    if not token:
        return handler
    expected = token.encode()

    async def guarded(request: web.Request) -> web.Response:
        given = request.headers.get("Authorization", "").strip()
        scheme, _, presented = given.partition(" ")
        # Compared in constant time, whatever the scheme (its check comes after).
        if hmac.compare_digest(presented.strip().encode(), expected) and (
            scheme.lower() == "bearer"
        ):
            return await handler(request)
        body = error_body(
            "unauthorized",
            f"this admin route needs the {service}'s admin token (Authorization: Bearer TOKEN)",
            reason="invalid_admin_token" if given else "missing_admin_token",
        )
        return web.Response(
            status=401,
            body=body,
            content_type="application/json",
            headers={"WWW-Authenticate": f'Bearer realm="weir-{service}"'},
        )

    return guarded
