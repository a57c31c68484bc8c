"""The sidecar's error answers: the contract's error body, naming the request being
handled, with the status and headers a router acts on (429 and 503 try elsewhere)."""

from __future__ import annotations

from aiohttp import web

from controlplane.contract.vocabulary import error_body
from controlplane.trace.trail import handled_request
from controlplane.transport.guard import BodyError
from engine_sidecar.intake import RequestError

TOO_LARGE = "too_large"  # admission's reason for a request that can never fit


def error_json(kind: str, message: str, **extra: str | int) -> bytes:
    """The error body, naming the request being handled, if any."""
    return error_body(kind, message, **{"request_id": handled_request(), **extra})


def overload_response(reason: str, retry_after_s: int, message: str) -> web.Response:
    return web.Response(
        status=429,
        body=error_json("overload", message, reason=reason),
        content_type="application/json",
        headers={"Retry-After": str(retry_after_s)},
    )


def body_refused(exc: BodyError) -> web.Response:
    """A body the sidecar would not read: too large (413), too slow (408), or more bodies
    in flight than it holds at once (503, which a router takes as "try another")."""
    kind = "unavailable" if exc.status == 503 else "invalid_request"
    headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s else {}
    return web.Response(
        status=exc.status,
        body=error_json(kind, exc.message, reason=exc.reason),
        content_type="application/json",
        headers=headers,
    )


def bad_request(exc: RequestError) -> web.Response:
    extra = {"reason": exc.reason, **({"param": exc.param} if exc.param else {})}
    return web.Response(
        status=exc.status,
        body=error_json(exc.kind, str(exc), **extra),
        content_type="application/json",
    )
