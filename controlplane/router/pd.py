"""A prefill pool's router serves each request as a P/D pair (docs/disaggregation.md).

One request, two legs, one client stream, as SGLang's router does it: the same body, with
`bootstrap_host` (the prefill endpoint's host), `bootstrap_port` (the bootstrap server its
engine advertises) and a random `bootstrap_room`, goes to a prefill endpoint, whose answer
(its one token) is only waited for, and to a decode endpoint, whose answer is the
client's. Weir's additions:

- **A decode credit first.** A handoff credit for the prompt's KV on the decode pool is
  taken before either leg starts (`HandoffGate`: 429 `decode_credit` while the decode
  pool has no room, so a prefill waits for room instead of prefilling into a decode
  queue). It is consumed when the handoff lands — the prefill leg's answer, which its
  engine sends once the KV is on the decode side, or the decode leg's first event, which
  its engine sends only then — and released at once when the request ends before. A
  resume after the handoff takes a new one.
- **The decode endpoint** is chosen by the routing core (the pool's profile, over the
  decode pool's snapshot, which this router follows too) at once: when no decode
  endpoint can take the request now it is refused with 429, not queued behind a prefill
  (`controlplane.routing.pairing`, which the fleet simulator pairs its flights with).
- **A cancel reaches both legs.** A client that leaves aborts the prefill leg here and
  the decode leg in the router (each sidecar's `/abort_request`, and its connection
  closed), so both pools free the KV; SGLang's router drops the decode stream only.
- **Failures.** Until the client has a byte, a leg that fails ends the other and the
  pair is tried again: on another decode endpoint when the decode side refused or
  failed, on another prefill endpoint (the router's fallbacks) when the prefill side
  did. A decode stream that breaks, or that its sidecar migrates, mid-answer resumes as a
  new pair from what the client holds (the router's resume): a prefill endpoint
  computes the prompt and the answer so far, a decode endpoint continues the stream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from controlplane.contract import headers as wire
from controlplane.contract.vocabulary import PREEMPTED_EVENT
from controlplane.router.credits import HandoffGate
from controlplane.router.errors import RouterError, refusal_error
from controlplane.router.metrics import RouterMetrics
from controlplane.router.pool import PoolView, new_reports
from controlplane.routing import Dispatcher, EndpointView, PoolSnapshot, PrefixIndex, Refusal
from controlplane.routing.pairing import decode_attempts_spent, decode_route, place_decode
from controlplane.stream.events import opens_answer
from controlplane.trace.trail import Trail
from controlplane.transport import HTTPClient, Response, SSEEvent, TransportError

if TYPE_CHECKING:
    from controlplane.router.exchange import Exchange

log = logging.getLogger(__name__)

_JSON = {"Content-Type": "application/json"}
# A report that reaches the router was taken at most this long before (as the router's).
_REPORT_LAG_S = 0.1


class PairHost(Protocol):
    """What a pair needs of the router serving its client."""

    prefix_index: PrefixIndex

    def upstream(self) -> HTTPClient: ...

    async def relay(
        self, request: web.Request, ex: Exchange, upstream: Response, first: list[SSEEvent]
    ) -> tuple[str, web.StreamResponse | None]: ...

    def unary_answer(
        self, ex: Exchange, endpoint_id: str, raw: bytes, status: int, content_type: str
    ) -> web.Response: ...

    async def answer_refusal(self, ex: Exchange, exc: RouterError) -> web.StreamResponse: ...


@dataclass(slots=True)
class _Pair:
    """One request's P/D state across its attempts."""

    credit: str = ""  # held and not yet consumed: released if the request ends first
    taken: int = 0  # credits taken so far (names the next one)
    failed: set[str] = field(default_factory=set)  # decode endpoints that failed it


@dataclass(frozen=True, slots=True)
class _Attempt:
    """What an attempt keeps across its pairs: the router, the client's request, the
    prefill endpoint the router picked, and what goes upstream."""

    host: PairHost
    request: web.Request
    ex: Exchange
    prefill: EndpointView
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    path: str


# How one pair ended, besides the router's outcomes ("done", "refused", "preempted"):
# the decode side refused or failed before the client had a byte; another decode endpoint
# takes the pair again.
_DECODE_FAILED = "decode_failed"


@dataclass
class Pairing:
    """The P/D pairs of a prefill pool's router: its decode pool's credits (`gate`), view
    and dispatch core, and the router's clock, metrics, trail and background tasks."""

    gate: HandoffGate
    view: PoolView
    dispatch: Dispatcher[Exchange]
    clock: Callable[[], float]
    metrics: RouterMetrics
    pool: str
    trail: Trail
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    max_attempts: int
    _pairs: dict[str, _Pair] = field(default_factory=dict)
    _versions: dict[str, int] = field(default_factory=dict)  # each endpoint's last report

    def __post_init__(self) -> None:
        self.view.on_change(self._reported)

    def _reported(self, snapshot: PoolSnapshot, removed: tuple[EndpointView, ...]) -> None:
        shown = self.clock() - _REPORT_LAG_S
        for endpoint_id in new_reports(self._versions, snapshot, removed):
            self.dispatch.reported(endpoint_id, shown)

    # -- credits -------------------------------------------------------------------------

    async def admit(self, ex: Exchange) -> None:
        """The request's first credit, before anything of it runs (a `RouterError` when
        the decode pool cannot promise room for it)."""
        pair = self._pairs.setdefault(ex.route.request_id, _Pair())
        await self._take(ex, pair)

    async def _take(self, ex: Exchange, pair: _Pair) -> None:
        rid = ex.route.request_id
        name = rid if not pair.taken else f"{rid}.{pair.taken}"
        # A resume ships the prompt and what the client holds so far.
        tokens = ex.client.prompt_tokens + ex.splicer.generated
        try:
            pair.credit = (await self.gate.take(name, tokens)).credit_id
        except RouterError:
            self.metrics.handoff_credits.labels(self.pool, "refused").inc()
            raise
        pair.taken += 1
        self.metrics.handoff_credits.labels(self.pool, "taken").inc()
        self.trail.record(rid, "credit", credit=name, kv_tokens=tokens)

    def _settle(self, rid: str, pair: _Pair, *, landed: bool) -> None:
        """Consume the credit (the handoff landed) or give it back (it never will)."""
        credit, pair.credit = pair.credit, ""
        if not credit:
            return

        async def settle() -> None:
            outcome = await self.gate.settle(credit, landed=landed)
            self.metrics.handoff_credits.labels(self.pool, outcome).inc()
            self.trail.record(rid, "credit_" + outcome, credit=credit)

        self.spawn(settle())

    def ended(self, ex: Exchange) -> None:
        """The request is over: a credit it still holds goes back at once."""
        pair = self._pairs.pop(ex.route.request_id, None)
        if pair is not None:
            self._settle(ex.route.request_id, pair, landed=False)

    # -- one attempt: a pair, and another while the decode side refuses --------------------

    async def attempt(
        self,
        host: PairHost,
        request: web.Request,
        ex: Exchange,
        prefill: EndpointView,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        path: str,
    ) -> tuple[str, web.StreamResponse | None]:
        """The request on `prefill` and a decode endpoint: the router's outcomes
        ("done", "refused": the prefill side did not take it, "preempted": resume it)."""
        pair = self._pairs.setdefault(ex.route.request_id, _Pair())
        call = _Attempt(host, request, ex, prefill, body, headers, path)
        try:
            if not pair.credit:  # a resume after a handoff: the new prompt's KV
                await self._take(ex, pair)
            for _ in range(self.max_attempts):
                decode = self._place(ex, pair)
                try:
                    outcome = await self._run(call, pair, decode)
                finally:
                    now = self.clock()
                    self.dispatch.finished(
                        ex.route.request_id, ex.splicer.generated, now, self._snapshot(now)
                    )
                if outcome[0] != _DECODE_FAILED:
                    return outcome
                pair.failed.add(decode.endpoint_id)
            raise refusal_error(decode_attempts_spent(self.max_attempts, ex.retry_after_s))
        except RouterError as exc:
            return "done", await host.answer_refusal(ex, exc)

    def _snapshot(self, now: float) -> PoolSnapshot | None:
        try:
            return self.view.current(now)
        except RouterError:
            return None

    def _place(self, ex: Exchange, pair: _Pair) -> EndpointView:
        """A decode endpoint for the request now, by the routing core; a `RouterError`
        when none can take it (a prefill is never started for a decode that would wait)."""
        now = self.clock()
        snapshot = self.view.current(now)
        route = decode_route(ex.route, ex.splicer.generated, pair.failed)
        placed = place_decode(self.dispatch, route, ex, now, snapshot)
        if isinstance(placed, Refusal):
            raise refusal_error(placed)
        return snapshot.by_id[placed]

    # -- one pair ------------------------------------------------------------------------

    async def _run(
        self, call: _Attempt, pair: _Pair, decode: EndpointView
    ) -> tuple[str, web.StreamResponse | None]:
        ex, prefill, body = call.ex, call.prefill, call.body
        rid = ex.route.request_id
        if not prefill.state.bootstrap_port:
            ex.upstream_refusal = f"{prefill.endpoint_id}: no bootstrap port advertised"
            return "refused", None
        room = secrets.randbits(63)
        bootstrap = {
            "bootstrap_host": urlsplit(prefill.state.address).hostname,
            "bootstrap_port": prefill.state.bootstrap_port,
            "bootstrap_room": room,
        }
        self.trail.record(
            rid, "pair", prefill=prefill.endpoint_id, decode=decode.endpoint_id, room=room
        )  # fmt: skip
        http = call.host.upstream()
        prefill_rid = uuid.uuid4().hex
        prefill_leg = asyncio.create_task(
            self._prefill_leg(
                http, prefill.state.address + call.path,
                msgspec.json.encode({**body, **bootstrap, "rid": prefill_rid, "stream": False}),
                call.headers,
            )
        )  # fmt: skip
        ex.endpoint, ex.address = decode.endpoint_id, decode.state.address
        payload = {**body, **bootstrap, "rid": ex.upstream_rid, "stream": ex.client.stream}
        try:
            outcome = await self._decode_leg(call, pair, prefill_leg, msgspec.json.encode(payload))
        finally:
            if prefill_leg.done():
                pass
            elif pair.credit:
                # The pair failed, or its client left, before the KV moved.
                prefill_leg.cancel()
                self._abort(http, prefill.state.address, prefill_rid)
            else:  # landed: the prefill's answer is on its way
                self.spawn(_drained(prefill_leg))
        if outcome[0] == "refused":
            self.metrics.retries.labels(self.pool, "prefill_failed").inc()
        elif outcome[0] == _DECODE_FAILED:
            self.metrics.retries.labels(self.pool, "decode_failed").inc()
        return outcome

    async def _decode_leg(
        self, call: _Attempt, pair: _Pair, prefill_leg: asyncio.Task[str], payload: bytes
    ) -> tuple[str, web.StreamResponse | None]:
        """The decode leg, watched together with the prefill leg until it answers."""
        host, ex, prefill = call.host, call.ex, call.prefill
        http = host.upstream()
        head = asyncio.ensure_future(
            http.request("POST", ex.address + call.path, payload, call.headers)
        )
        try:
            while not head.done():
                await asyncio.wait({head, prefill_leg}, return_when=asyncio.FIRST_COMPLETED)
                if not prefill_leg.done() or head.done():
                    continue
                failure = prefill_leg.result()
                if failure:
                    return self._prefill_failed(http, ex, prefill, failure)
                self._landed(host, ex, pair, prefill)  # the prefill answers once it has
                await asyncio.wait({head})
            upstream = head.result()
        except TransportError as exc:
            ex.upstream_refusal = f"{ex.endpoint}: {exc.reason}"
            return _DECODE_FAILED, None
        finally:
            if not head.done():
                head.cancel()
        async with upstream:
            ex.upstream_rid = upstream.headers.get(wire.REQUEST_ID) or ex.upstream_rid
            if upstream.status != 200 or not ex.client.stream:
                return await self._whole_answer(call, pair, prefill_leg, upstream)
            first = await _first_events(upstream)
            if not _has_started(first):
                # The decode engine gave up before its first token: the handoff failed,
                # on the prefill side when that leg says so already.
                failure = _failed_now(prefill_leg)
                if failure:
                    return self._prefill_failed(http, ex, prefill, failure)
                ex.upstream_refusal = f"{ex.endpoint}: the stream ended before its first token"
                return _DECODE_FAILED, None
            self._landed(host, ex, pair, prefill)
            try:
                outcome, response = await host.relay(call.request, ex, upstream, first)
            except TransportError as exc:  # the decode engine or its sidecar went away
                log.info("decode endpoint %s failed mid-stream: %s", ex.endpoint, exc)
                outcome, response = "broken", None
        if outcome in ("broken", "preempted"):
            # Resumed as a new pair, from what the client holds: a decode engine takes a
            # continuation only with its prefill half.
            ex.continuation = b""
            if outcome == "broken":
                pair.failed.add(ex.endpoint)
            return "preempted", None
        return outcome, response

    async def _whole_answer(
        self, call: _Attempt, pair: _Pair, prefill_leg: asyncio.Task[str], upstream: Response
    ) -> tuple[str, web.StreamResponse | None]:
        """A unary decode answer, or a refusal before a stream: the client's answer, or
        a failed pair to try again."""
        host, ex, prefill = call.host, call.ex, call.prefill
        raw = await upstream.read()
        status = upstream.status
        if status in (429, 503) or status >= 500:
            failure = _failed_now(prefill_leg)
            if failure:
                return self._prefill_failed(host.upstream(), ex, prefill, failure)
            ex.retry_after_s = max(ex.retry_after_s, _retry_after(upstream))
            ex.upstream_refusal = f"{ex.endpoint}: {status}"
            return _DECODE_FAILED, None
        if status == 200:
            self._landed(host, ex, pair, prefill)
        return "done", host.unary_answer(ex, ex.endpoint, raw, status, upstream.content_type)

    def _prefill_failed(
        self, http: HTTPClient, ex: Exchange, prefill: EndpointView, failure: str
    ) -> tuple[str, web.StreamResponse | None]:
        """The prefill leg failed before the client had a byte: the decode leg is ended
        and the router offers the request to its next prefill endpoint."""
        ex.upstream_refusal = f"{prefill.endpoint_id}: {failure}"
        self._abort(http, ex.address, ex.upstream_rid)
        return "refused", None

    def _landed(self, host: PairHost, ex: Exchange, pair: _Pair, prefill: EndpointView) -> None:
        """The KV is on the decode side: the credit is consumed, and the prompt is in the
        prefill endpoint's cache."""
        if not pair.credit:
            return
        self._settle(ex.route.request_id, pair, landed=True)
        if ex.route.block_hashes:
            host.prefix_index.record(prefill.endpoint_id, ex.route.block_hashes)
        self.trail.record(ex.route.request_id, "handoff", prefill=prefill.endpoint_id)

    async def _prefill_leg(
        self, http: HTTPClient, url: str, payload: bytes, headers: Mapping[str, str]
    ) -> str:
        """The prefill leg: "" once its engine answered (after the KV moved), else why
        it failed."""
        try:
            async with await http.request("POST", url, payload, headers) as reply:
                await reply.read()
                return "" if reply.status == 200 else f"answered {reply.status}"
        except TransportError as exc:
            return exc.reason

    def _abort(self, http: HTTPClient, address: str, rid: str) -> None:
        """Abort `rid` at the sidecar at `address` (its connection may already be closed:
        behind a proxy only this reaches it)."""
        body = msgspec.json.encode({"rid": rid})

        async def abort() -> None:
            try:
                async with await http.request(
                    "POST", address + "/abort_request", body, _JSON
                ) as reply:
                    await reply.read()
            except TransportError as exc:
                log.info("abort of %s at %s failed: %s", rid, address, exc)

        self.spawn(abort())


async def _first_events(upstream: Response) -> list[SSEEvent]:
    """The stream's first read of events ([] when it ended with none)."""
    first: list[SSEEvent] = []

    def take(events: list[SSEEvent]) -> bool:
        first.extend(events)
        return True

    await upstream.push_events(take)
    return first


def _has_started(events: list[SSEEvent]) -> bool:
    """The decode stream began with an answer (its first token, or a chat's role), not
    an error, an abort or a sidecar's hand-back."""
    for event in events:
        if event.event == PREEMPTED_EVENT or event.done:
            return False
        return opens_answer(event.data)
    return False


def _failed_now(leg: asyncio.Task[str]) -> str:
    """Why the prefill leg failed, if it has ended failing ("" while it runs or after it
    succeeded)."""
    return leg.result() if leg.done() and not leg.cancelled() else ""


async def _drained(leg: asyncio.Task[str]) -> None:
    await leg


def _retry_after(upstream: Response) -> float:
    try:
        return float(upstream.headers.get("retry-after", "1"))
    except ValueError:
        return 1.0
