"""Errors the router answers with: an HTTP status, an OpenAI-shaped body, and for refusals
a reason and a Retry-After.

Every refusal names its reason in `{"error": {"type", "reason", "message"}}` so a client
(and `weir_router_overloads_total`) can tell a full quota from a stale snapshot; a refused
body also names the parameter at fault (`"param"`, as OpenAI's errors do).
"""

from __future__ import annotations

import math

from aiohttp import web

from controlplane.contract.vocabulary import error_body
from controlplane.routing import Refusal
from controlplane.rules.request_checks import RequestCheckError
from controlplane.trace.trail import handled_request
from controlplane.transport.guard import BodyError


class RouterError(Exception):
    """A request the router answers itself, without reaching an engine."""

    def __init__(
        self,
        status: int,
        error_type: str,
        reason: str,
        message: str,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param
        # Why the last endpoint tried refused it, when endpoints refused it.
        self.upstream_reason: str | None = None

    def response(self) -> web.Response:
        body = error_body(
            self.error_type, self.message, reason=self.reason, param=self.param,
            upstream_reason=self.upstream_reason, request_id=handled_request(),
        )  # fmt: skip
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.Response(
            status=self.status,
            body=body,
            content_type="application/json",
            headers=headers,
        )


def bad_request(reason: str, message: str) -> RouterError:
    return RouterError(400, "invalid_request_error", reason, message)


def refused(exc: RequestCheckError) -> RouterError:
    """A body the shared request checks refused, as OpenAI's error types name it."""
    error_type = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return RouterError(exc.status, error_type, exc.reason, exc.message, param=exc.param)


def overload(reason: str, message: str, retry_after_s: float) -> RouterError:
    """A retryable refusal before admission (finish reason `overload`)."""
    return RouterError(429, "overload", reason, message, retry_after_s)


def unavailable(reason: str, message: str, retry_after_s: float = 1.0) -> RouterError:
    """Nothing can serve the request right now, through no fault of the client's quota."""
    return RouterError(503, "unavailable", reason, message, retry_after_s)


# The error types of the dispatch core's refusals, by status.
_REFUSAL_TYPES = {429: "overload", 503: "unavailable", 504: "deadline"}


def refusal_error(refusal: Refusal) -> RouterError:
    """The dispatch core's refusal (`controlplane.routing.Refusal`) as the router answers:
    429 `overload` (queue full or timed out, every endpoint tried refused), 503
    `unavailable` (nothing could serve it, a resume nobody took), 504 `deadline`."""
    return RouterError(
        refusal.status,
        _REFUSAL_TYPES[refusal.status],
        refusal.reason,
        refusal.message,
        refusal.retry_after_s,
    )


def body_refused(exc: BodyError) -> RouterError:
    """A body the server would not read: too large (413), too slow (408), or more bodies
    in flight than the server holds at once (503, retryable)."""
    if exc.status == 503:
        return unavailable(exc.reason, exc.message, exc.retry_after_s or 1.0)
    return RouterError(exc.status, "invalid_request_error", exc.reason, exc.message)
