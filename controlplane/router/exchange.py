"""The exchange: one client request served upstream once the dispatch core placed it.

Each attempt calls the picked endpoint (or, in a prefill pool, a P/D pair:
`controlplane.router.pd`) and relays its answer; an attempt that did not end the request
goes back to the router for the next placement (a fallback, or a resume spliced into the
same client stream). When the request ends, its stream is closed, a client that left has
its request aborted upstream, and the request is accounted (trail and metrics).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from controlplane.contract import Continuation, EngineAPI
from controlplane.contract import headers as wire
from controlplane.contract.vocabulary import DONE_FRAME, error_body, sse
from controlplane.router.errors import RouterError
from controlplane.router.requests import ClientRequest, resume_body
from controlplane.router.tenants import TENANT_HEADER
from controlplane.routing import RouteRequest
from controlplane.stream import MalformedEventError, Splicer, ask_for_counts
from controlplane.stream.relay import Ending, Relay, SegmentWatch
from controlplane.telemetry.catalog import length_bucket
from controlplane.trace.spans import CLIENT, TRACER, outgoing
from controlplane.transport import HTTPClient, Response, SSEEvent, TransportError
from controlplane.transport.event_stream import DirectWriter

if TYPE_CHECKING:
    from controlplane.router.app import Router

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}
CONTINUE_PATH = "/weir/v1/continue"
API_PATHS = {
    EngineAPI.GENERATE: "/generate",
    EngineAPI.COMPLETIONS: "/v1/completions",
    EngineAPI.CHAT: "/v1/chat/completions",
}


class _ClientGoneError(Exception):
    """The client closed its connection while we wrote to it."""


class _FirstToken(SegmentWatch):
    """The router's part in relaying a segment: when its client had the first token."""

    def __init__(self, ex: Exchange, clock: Callable[[], float]) -> None:
        self._ex = ex
        self._clock = clock

    def delivered(self) -> None:
        ex = self._ex
        if not ex.first_token_at and ex.splicer.generated:
            ex.first_token_at = self._clock()


@dataclass(slots=True)
class Exchange:
    """One client request in flight."""

    client: ClientRequest
    route: RouteRequest
    tenant: str
    started: float
    splicer: Splicer  # what the client has received
    out: DirectWriter | None = None  # the client's stream, once one started
    endpoint: str = ""
    address: str = ""
    upstream_rid: str = ""
    first_token_at: float = 0.0
    finish: str = "error"
    retry_after_s: float = 0.0  # the last upstream refusal's
    upstream_refusal: str = ""  # the last endpoint's reason for refusing it
    placed: asyncio.Future[str] | None = None  # where the dispatch core sends it next
    continuation: bytes = b""  # a migrating sidecar's continuation, for the next sidecar

    @property
    def response(self) -> web.StreamResponse | None:
        return self.out.response if self.out is not None else None


class Exchanges:
    """The router's upstream half: it serves each placed request, and is the host of
    its P/D pairs (`controlplane.router.pd.PairHost`)."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self.prefix_index = router.prefix_index

    async def serve(
        self, request: web.Request, ex: Exchange, endpoint_id: str
    ) -> web.StreamResponse:
        body = ex.client.body
        resumes = 0
        try:
            while True:
                outcome, result = await self.attempt(request, ex, endpoint_id, body)
                if outcome == "done":
                    assert result is not None
                    return result
                if outcome != "refused":
                    # Broken or preempted after bytes reached the client: resume elsewhere.
                    if ex.splicer.finish or resumes >= self._router.config.upstream.max_resumes:
                        return await self.end_stream(ex, complete=bool(ex.splicer.finish))
                    resumes += 1
                    self._router.metrics.resumes.labels(self._router.config.pool, outcome).inc()
                    self._router.trail.record(
                        ex.route.request_id, "resume", cause=outcome, away_from=ex.endpoint,
                        generated_tokens=ex.splicer.generated,
                    )  # fmt: skip
                    if not (outcome == "preempted" and ex.continuation):
                        # Rebuilt from what the client holds. A sidecar's own continuation
                        # (exact token ids, a stream that already continues the client's)
                        # instead goes to the next sidecar as it came.
                        ex.continuation = b""
                        try:
                            body = resume_body(self.continuation(ex))
                        except RouterError as exc:  # e.g. a prompt the router cannot rebuild
                            return await self.end_stream(ex, complete=False, refusal=exc)
                        ex.splicer.next_segment()
                try:
                    endpoint_id = await self._router.redispatch(ex, outcome)
                except RouterError as exc:
                    return await self.answer_refusal(ex, exc)
        except (asyncio.CancelledError, _ClientGoneError):
            ex.finish = "cancelled"
            self.abort_upstream(ex)
            if ex.response is not None:
                return ex.response
            raise
        finally:
            self._router.finish(ex)
            self._router.release_quota(
                ex.route.request_id, ex.client.prompt_tokens, ex.splicer.generated
            )
            self.account(ex)
            if ex.splicer.ids_delta is not None:
                self._router.ids_delta = ex.splicer.ids_delta

    async def answer_refusal(self, ex: Exchange, exc: RouterError) -> web.StreamResponse:
        """No endpoint took the request: its client is told, in the stream it has (a
        resume no endpoint took in time) or in the answer."""
        if ex.response is not None:
            return await self.end_stream(ex, complete=False, refusal=exc)
        ex.finish = "overload"  # every endpoint tried refused it
        self._router.metrics.overloads.labels(self._router.config.pool, exc.reason).inc()
        exc.upstream_reason = ex.upstream_refusal or None
        self._router.note_refusal(ex.route.request_id, exc)
        return exc.response()

    def continuation(self, ex: Exchange) -> Continuation:
        """What the client holds, as the contract's continuation record."""
        client, splicer = ex.client, ex.splicer
        return Continuation(
            request_id=ex.route.request_id,
            tenant=ex.tenant,
            model=client.model,
            api=client.api,
            body=client.body,
            prompt_ids=client.prompt_ids,
            generated_ids=tuple(splicer.exact_ids()),
            generated_text=splicer.generated_text(),
            generated_tokens=splicer.generated,
            max_new_tokens=client.max_new_tokens,
            priority=client.priority,
        )

    async def attempt(
        self, request: web.Request, ex: Exchange, endpoint_id: str, body: Mapping[str, Any]
    ) -> tuple[str, web.StreamResponse | None]:
        """One upstream call: ("done", response) | ("refused", None) when the endpoint
        did not take it (refused, unreachable; nothing of this call reached the client)
        | ("broken" or "preempted", None) after bytes of it reached the client."""
        view = self._router.view.snapshot.by_id.get(endpoint_id)
        if view is None:  # it left the pool since the decision
            return ("refused" if ex.response is None else "broken"), None
        ex.endpoint, ex.address = endpoint_id, view.state.address
        ex.upstream_rid = uuid.uuid4().hex
        client = ex.client
        sent = dict(body)
        if client.stream:  # counted from the engine's own counts (`controlplane.stream`)
            ask_for_counts(client.api, sent, token_ids=False)
        if ex.continuation:  # a sidecar's continuation: its next sidecar resumes it
            payload, path = ex.continuation, CONTINUE_PATH
        else:
            payload = msgspec.json.encode({**sent, "rid": ex.upstream_rid, "stream": client.stream})
            path = API_PATHS[client.api]
        headers = {
            "Content-Type": "application/json",
            TENANT_HEADER: ex.tenant,
            wire.REQUEST_ID: ex.route.request_id,
            wire.PRIORITY: str(client.priority),
        }
        if client.stream:  # the router can resume it: a sidecar may migrate it away
            headers[wire.MIGRATABLE] = "1"
        if ex.route.block_hashes:  # what an offload publishes its host pages by
            headers[wire.PREFIX_BLOCK] = f"{ex.route.block_hashes[-1]:016x}"
        if client.deadline_s:
            left = client.deadline_s - (self._router.clock() - ex.started)
            headers[wire.DEADLINE_MS] = str(max(1, int(left * 1000)))
        url = view.state.address + path
        with TRACER.start_as_current_span(
            "weir.router.attempt", kind=CLIENT,
            attributes={"weir.endpoint": endpoint_id, "http.route": path},
        ):  # fmt: skip
            if self._router.pairing is not None:  # a P/D pair: this endpoint prefills
                outcome = await self._router.pairing.attempt(
                    self, request, ex, view, sent, outgoing(headers), path
                )
            else:
                outcome = await self._call(
                    request, ex, endpoint_id, url, payload, outgoing(headers)
                )
        self._router.trail.record(
            ex.route.request_id, "attempt", endpoint=endpoint_id, outcome=outcome[0],
            upstream_rid=ex.upstream_rid, **({"refusal": ex.upstream_refusal}
                                             if outcome[0] == "refused" else {}),
        )  # fmt: skip
        return outcome

    async def _call(
        self,
        request: web.Request,
        ex: Exchange,
        endpoint_id: str,
        url: str,
        payload: bytes,
        headers: Mapping[str, str],
    ) -> tuple[str, web.StreamResponse | None]:
        """The upstream call of `attempt`, and the relay of what it answers."""
        http = self.upstream()
        client = ex.client
        pool = self._router.config.pool
        relaying = False
        try:
            async with await http.request("POST", url, payload, headers) as upstream:
                # A sidecar names its request: its abort matches that even for a
                # continuation, which carries no rid of the router's.
                ex.upstream_rid = upstream.headers.get(wire.REQUEST_ID) or ex.upstream_rid
                if upstream.status in (429, 503):
                    ex.retry_after_s = max(ex.retry_after_s, _retry_after(upstream))
                    ex.upstream_refusal = f"{endpoint_id}: {_refusal_reason(await upstream.read())}"
                    self._router.metrics.retries.labels(pool, f"upstream_{upstream.status}").inc()
                    return "refused", None
                # The profile's hooks learn it once this task next waits: indexing a long
                # prompt's blocks is not worth delaying its first byte for.
                asyncio.get_running_loop().call_soon(
                    self._router.dispatch.reached, ex.route, endpoint_id
                )
                if not client.stream:
                    raw = await upstream.read()
                    return "done", self.unary_answer(
                        ex, endpoint_id, raw, upstream.status, upstream.content_type
                    )
                if upstream.status != 200:
                    if ex.response is not None:
                        return "broken", None
                    raw = await upstream.read()
                    ex.finish = "error"
                    return "done", web.Response(
                        status=upstream.status, body=raw, content_type=upstream.content_type
                    )
                relaying = True
                return await self._relay(request, ex, upstream)
        except MalformedEventError as exc:  # read by the relay: the client's stream began
            log.info("endpoint %s sent an unreadable stream: %s", endpoint_id, exc)
            return "broken", None
        except TransportError as exc:
            log.info("endpoint %s failed: %s", endpoint_id, exc)
            if not relaying:
                ex.upstream_refusal = f"{endpoint_id}: {exc.reason}"
                # Nothing reached the client: another endpoint may take it, whatever went
                # wrong here. The label says what did (a refused connect, a timeout, a
                # malformed answer, ...: `TransportError.reason`).
                self._router.metrics.retries.labels(pool, exc.reason).inc()
                return "refused", None
            return "broken", None

    def upstream(self) -> HTTPClient:
        """The client of the endpoints (the app has started)."""
        assert self._router.http is not None
        return self._router.http

    def unary_answer(
        self, ex: Exchange, endpoint_id: str, raw: bytes, status: int, content_type: str
    ) -> web.Response:
        """An endpoint's whole answer, counted and passed on."""
        ex.finish = "error"
        if status == 200:  # a whole answer that names no finish: "stop"
            ex.finish = ex.splicer.take_answer(raw) or "stop"
        return web.Response(
            status=status, body=raw, content_type=content_type,
            headers={wire.ENDPOINT: endpoint_id},
        )  # fmt: skip

    async def relay(
        self, request: web.Request, ex: Exchange, upstream: Response, first: list[SSEEvent]
    ) -> tuple[str, web.StreamResponse | None]:
        """A stream's relay whose first events were read already (a P/D decode leg's)."""
        return await self._relay(request, ex, upstream, first)

    async def _relay(
        self,
        request: web.Request,
        ex: Exchange,
        upstream: Response,
        first: list[SSEEvent] | None = None,
    ) -> tuple[str, web.StreamResponse | None]:
        if ex.out is None:
            ex.out = await DirectWriter.open(
                request, {wire.ENDPOINT: ex.endpoint, wire.CLIENT_REQUEST_ID: ex.route.request_id}
            )
        out = ex.out
        relay = Relay(ex.splicer, _FirstToken(ex, self._router.clock))
        try:
            ending = await relay.run(upstream.push_events, out, first)
            if ending is Ending.DONE:
                splicer = ex.splicer
                ex.finish = splicer.finish or ("error" if splicer.failed else "stop")
                await out.response.write_eof(DONE_FRAME)
                return "done", out.response
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            raise _ClientGoneError() from exc
        if ending is Ending.PREEMPTED:
            ex.continuation = relay.continuation
            return "preempted", None
        return "broken", None  # the upstream stream ended without [DONE]

    async def end_stream(
        self, ex: Exchange, *, complete: bool, refusal: RouterError | None = None
    ) -> web.StreamResponse:
        """Close a stream that cannot continue: `[DONE]` when the last event already
        carried a finish reason, else an error event naming why (`refusal`: the resume
        itself was refused)."""
        response = ex.response
        assert response is not None
        if complete:
            ex.finish = ex.splicer.finish
        else:
            ex.finish = "error"
            reason, message = (
                (refusal.reason, str(refusal))
                if refusal is not None
                else ("resume_failed", "the engine failed and no endpoint could resume")
            )
            error = error_body(
                "unavailable", message, reason=reason, request_id=ex.route.request_id
            )
            await _write(response, sse(error))
        await _write(response, DONE_FRAME)
        await response.write_eof()
        return response

    def abort_upstream(self, ex: Exchange) -> None:
        """Tell the endpoint the client left: its rid (the sidecar's, where it named one)
        is aborted at once. Closing the upstream connection says the same to a server
        that cancels handlers on disconnect; behind a proxy, or to one that does not,
        only this call does."""
        if not ex.address or self._router.http is None:
            return
        http, url, rid = self._router.http, ex.address + "/abort_request", ex.upstream_rid
        body = msgspec.json.encode({"rid": rid})

        async def abort() -> None:
            try:
                async with await http.request("POST", url, body, JSON) as reply:
                    await reply.read()
            except TransportError as exc:
                log.info("abort of %s at %s failed: %s", rid, url, exc)

        self._router.spawn(abort())

    def account(self, ex: Exchange) -> None:
        m, pool, tenant = self._router.metrics, self._router.config.pool, ex.tenant
        now = self._router.clock()
        out = ex.splicer.generated
        self._router.trail.record(
            ex.route.request_id, "end", finish=ex.finish, endpoint=ex.endpoint or None,
            output_tokens=out, e2e_s=round(now - ex.started, 6),
            ttft_s=round(ex.first_token_at - ex.started, 6) if ex.first_token_at else None,
        )  # fmt: skip
        buckets = (length_bucket(ex.client.prompt_tokens), length_bucket(out))
        m.requests.labels(pool, tenant, ex.finish).inc()
        m.tokens.labels(pool, tenant, "input").inc(ex.client.prompt_tokens)
        m.tokens.labels(pool, tenant, "output").inc(out)
        m.kv_token_seconds.labels(pool, tenant).inc(
            (ex.client.prompt_tokens + out) * (now - ex.started)
        )
        m.e2e.labels(pool, tenant, *buckets).observe(now - ex.started)
        if ex.first_token_at:
            m.ttft.labels(pool, tenant, *buckets).observe(ex.first_token_at - ex.started)
            if out > 1:
                m.tpot.labels(pool, tenant, *buckets).observe((now - ex.first_token_at) / (out - 1))


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        raise _ClientGoneError() from exc


def _refusal_reason(raw: bytes) -> str:
    """The reason an endpoint's refusal names (`{"error": {"reason": ...}}`)."""
    try:
        error = msgspec.json.decode(raw).get("error") or {}
        return str(error.get("reason") or error.get("type") or "refused")
    except (msgspec.DecodeError, AttributeError):
        return "refused"


def _retry_after(upstream: Response) -> float:
    try:
        return float(upstream.headers.get("retry-after", "1"))
    except ValueError:
        return 1.0
