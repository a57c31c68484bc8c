"""Each request's id, set where a service first sees the request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

from controlplane.contract import headers as wire
from controlplane.trace.spans import SERVER, TRACER, incoming
from controlplane.trace.trail import carried_request_id, current_request

REQUEST_ID = web.RequestKey("weir_request_id", str)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_ids(
    paths: Collection[str], id_headers: tuple[str, ...], span: str
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that gives each request on `paths` its id — from the first of the
    `id_headers` it carries, when Weir can carry it, else a fresh one — stores it at
    `request[REQUEST_ID]`, names it in the log lines written while the request is handled
    (and by the tasks it starts), answers with it in `x-request-id` (a streamed response
    sets the header itself, before it starts), and handles the request in a server span
    named `span`, a child of the trace the request arrived with."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        given = next((v for h in id_headers if (v := request.headers.get(h))), None)
        request_id = carried_request_id(given)
        request[REQUEST_ID] = request_id
        token = current_request.set(request_id)
        try:
            with TRACER.start_as_current_span(
                span,
                context=incoming(request.headers),
                kind=SERVER,
                attributes={"weir.request_id": request_id, "http.route": request.path},
            ) as current:
                response = await handler(request)
                current.set_attribute("http.response.status_code", response.status)
        finally:
            current_request.reset(token)
        if not response.prepared:
            response.headers[wire.CLIENT_REQUEST_ID] = request_id
        return response

    return middleware
