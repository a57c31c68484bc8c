"""The router: an OpenAI- and SGLang-compatible HTTP front for one pool.

A request travels: API key → tenant (401; on a router without keys, a declared
`x-weir-tenant` or `default`, 403 for an undeclared one) → validation (400; 404 for a model
or a `lora_path` adapter that no endpoint serves) → the
tenant's quota (429, when enforced; 403 for a tenant without one) → a decode handoff credit (prefill pools, whose requests are P/D pairs: `controlplane.router.pd`) → the pool snapshot (503
when stale) → a routing decision, or the tenant-fair queue when every candidate is
saturated (429 `overload` when full or timed out, 504 past its deadline) → the picked
endpoint. An overload or a
connection failure before the first byte moves the request to the next fallback (the
secondary owner first). After bytes were streamed, a dead engine or a `weir.preempted`
event resumes the request as a continuation elsewhere, spliced into the same client
stream (`controlplane.stream`). A client that goes away aborts the request upstream
at once (the connection is closed and `/abort_request` is sent for its rid).

Where a request goes, when it waits, and when it is refused is the dispatch core's
(`controlplane.routing.Dispatcher`, which the fleet simulator drives too): the router
feeds it arrivals, attempts' outcomes, ends and reports, and turns its events into
answers. Waiting is the router's: a future per placement, and one timer for the core's
next wakeup. Decisions are pure and synchronous over the in-memory snapshot; besides the
upstream call, the hot path's only I/O is the quota charge (and a prefill pool's credit).

This module is the router's admission and dispatch glue; its settings are
`controlplane.router.config`, the upstream half of each request (attempts, relay, ending,
accounting) `controlplane.router.exchange`, and the status and debug routes
`controlplane.router.status`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from aiohttp import web

from controlplane.contract import (
    CacheIdentity,
    EngineAPI,
)
from controlplane.contract import headers as wire
from controlplane.ownership import block_hashes, prefix_key
from controlplane.router.config import RouterConfig
from controlplane.router.credits import HandoffGate
from controlplane.router.errors import RouterError, body_refused, refusal_error
from controlplane.router.exchange import API_PATHS, Exchange, Exchanges
from controlplane.router.metrics import RouterMetrics
from controlplane.router.pd import Pairing
from controlplane.router.pool import PoolView, new_reports
from controlplane.router.quotas import QuotaGate
from controlplane.router.requests import ClientRequest, decode_body, parse_client_request
from controlplane.router.status import StatusRoutes
from controlplane.router.tenants import TenantKeys
from controlplane.routing import (
    Decision,
    Dispatcher,
    EndpointView,
    Placed,
    PoolSnapshot,
    PrefixIndex,
    Profile,
    RouteRequest,
    RoutingContext,
    default_config,
    profile_from_config,
)
from controlplane.routing.dispatch import Event
from controlplane.rules.fairness import tenant_weights
from controlplane.stream import Asks, Splicer
from controlplane.trace.middleware import REQUEST_ID, request_ids
from controlplane.trace.trail import Trail
from controlplane.transport import (
    HTTPClient,
)
from controlplane.transport.guard import BodyError, RequestGuard

MAX_HASHED_BLOCKS = 256
# A report that reaches the router was taken at most this long before: what the router
# sent earlier had reached the endpoint and is in it.
REPORT_LAG_S = 0.1


class _CountedProfile:
    """The pool's profile with every decision timed and counted
    (`weir_router_decision_seconds`, `weir_router_decisions_total`)."""

    def __init__(self, profile: Profile, metrics: RouterMetrics, pool: str, trail: Trail) -> None:
        self.profile = profile
        self.metrics = metrics
        self.pool = pool
        self.trail = trail
        self._seconds = metrics.decision_seconds.labels(pool)
        self._counters: dict[tuple[str, bool], Any] = {}

    def decide(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        return self._observed(self.profile.decide, request, ctx, "route")

    def decide_resume(self, request: RouteRequest, ctx: RoutingContext) -> Decision:
        return self._observed(self.profile.decide_resume, request, ctx, "route_resume")

    def placed(self, request: RouteRequest, endpoint_id: str, prefix_index: PrefixIndex) -> None:
        self.profile.placed(request, endpoint_id, prefix_index)

    def _observed(
        self,
        decide: Callable[[RouteRequest, RoutingContext], Decision],
        request: RouteRequest,
        ctx: RoutingContext,
        event: str,
    ) -> Decision:
        started = time.perf_counter()
        decision = decide(request, ctx)
        self._seconds.observe(time.perf_counter() - started)
        self._record(event, request, decision)
        key = (decision.reason if decision.endpoint_id else decision.refusal, decision.owner_hit)
        counter = self._counters.get(key)
        if counter is None:  # label lookups cost more than the count: once per outcome
            counter = self.metrics.decisions.labels(self.pool, key[0], str(key[1]).lower())
            self._counters[key] = counter
        counter.inc()
        return decision

    def _record(self, event: str, request: RouteRequest, decision: Decision) -> None:
        """The decision as the request's trail keeps it: the pick and why, each filter's
        count of rejected candidates, and with decision logs on every candidate's total
        and each scorer's weighted term of it."""
        fields: dict[str, Any] = {
            "endpoint": decision.endpoint_id or None,
            "reason": decision.reason if decision.endpoint_id else decision.refusal,
            "owners": list(request.owners),
            "owner_hit": decision.owner_hit,
            "rejected": dict(decision.rejected),
        }
        if request.exclude:
            fields["excluded"] = sorted(request.exclude)
        if decision.endpoint_id:
            fields["score"] = round(decision.score, 4)
        if self.trail.detailed:
            terms = self.profile.terms(decision)
            fields["candidates"] = {
                view.endpoint_id: {
                    "total": round(total, 4),
                    "terms": {
                        name: round(term, 4) for name, term in terms[view.endpoint_id].items()
                    },
                }
                for view, total in zip(decision.eligible, decision.totals, strict=True)
            }
        self.trail.record(request.request_id, event, **fields)


class Router:
    """One pool's router: admits each client request (tenant, validation, quota, credit)
    and drives the dispatch core for it; `exchanges` serves it upstream once placed."""

    def __init__(
        self,
        config: RouterConfig,
        view: PoolView,
        keys: TenantKeys | None = None,
        clock: Callable[[], float] = time.monotonic,
        quotas: QuotaGate | None = None,
        credits: HandoffGate | None = None,
        decode_view: PoolView | None = None,
    ) -> None:
        """A prefill pool's router (`credits` on the decode pool, whose endpoints
        `decode_view` follows) serves every request as a P/D pair."""
        self.config = config
        self.view = view
        self.keys = (keys or TenantKeys()).declaring(t.name for t in config.quotas.tenants)
        self.quotas = quotas
        self.clock = clock
        self.profile = profile_from_config(config.profile or default_config(config.routing))
        self.prefix_index = PrefixIndex()
        self.metrics = RouterMetrics(config.pool)
        self.trail = Trail("router")
        self.dispatch: Dispatcher[Exchange] = Dispatcher(
            _CountedProfile(self.profile, self.metrics, config.pool, self.trail),
            config.routing,
            self.prefix_index,
            tenant_weights(config.quotas.tenants),
        )
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at = 0.0
        self._versions: dict[str, int] = {}  # each endpoint's last report seen
        self.http: HTTPClient | None = None  # the endpoints' client, once the app started
        self._background: set[asyncio.Task[None]] = set()
        self.pairing: Pairing | None = None
        if (credits is None) != (decode_view is None):
            raise ValueError("a P/D router needs both handoff credits and the decode pool's view")
        if credits is not None and decode_view is not None:
            decide = _CountedProfile(self.profile, self.metrics, decode_view.pool, self.trail)
            self.pairing = Pairing(
                credits, decode_view, Dispatcher(decide, config.routing, PrefixIndex()), clock,
                self.metrics, config.pool, self.trail, self.spawn, config.routing.max_attempts,
            )  # fmt: skip
        self._served = self._models_of(view.snapshot)
        self._adapters = _adapters_of(view.snapshot)
        # Whether the pool's /generate streams carry each event's ids only (SGLang 0.5.5)
        # or all so far (0.5.23): learnt from the first stream that shows it.
        self.ids_delta: bool | None = None
        view.on_change(self._snapshot_changed)
        self.guard = RequestGuard(
            config.server.for_context(config.limits.context_length),
            lambda exc: body_refused(exc).response(),
            lambda limit: self.metrics.client_limits.labels(config.pool, limit).inc(),
        )
        self.exchanges = Exchanges(self)

    # -- lifecycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        ids = request_ids(
            frozenset(API_PATHS.values()), (wire.CLIENT_REQUEST_ID,), "weir.router.request"
        )
        app = web.Application(
            client_max_size=self.guard.limits.max_body_bytes,
            middlewares=[ids, self.guard.middleware],
        )
        for api, path in API_PATHS.items():
            app.router.add_post(path, self._entry(api))
        StatusRoutes(self).add_to(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.http = HTTPClient(
            connect_timeout_s=self.config.upstream.connect_timeout_s,
            read_timeout_s=self.config.upstream.chunk_timeout_s,
            max_connections_per_origin=self.config.upstream.max_connections,
        )

    async def _stop(self, _app: web.Application) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.http is not None:
            await self.http.close()

    # -- routing ---------------------------------------------------------------------

    def route_request(
        self, client: ClientRequest, tenant: str, request_id: str = ""
    ) -> RouteRequest:
        """The routing view of a request: block hashes and owners of its prefix
        (`request_id`: the request's, else a fresh one)."""
        policy = self.config.routing
        identity = CacheIdentity(
            model=client.model,
            adapter=client.adapter,
            security_domain=tenant if policy.tenant_isolated_cache else "",
        )
        tokens: Any = client.prompt_ids or client.prompt_text.encode("utf-8")
        block = policy.prefix_block_tokens
        if not client.prompt_ids:  # text prompts are hashed by bytes
            block = max(1, round(block * self.config.limits.bytes_per_token))
        hashes = tuple(block_hashes(identity, tokens, block, MAX_HASHED_BLOCKS))
        owner_blocks = policy.prefix_blocks_for_owner
        if hashes:
            key = hashes[min(owner_blocks, len(hashes)) - 1]
        else:
            key = prefix_key(identity, tokens, block, owner_blocks)
        return RouteRequest(
            request_id=request_id or uuid.uuid4().hex,
            model=client.model,
            prompt_tokens=client.prompt_tokens,
            max_new_tokens=client.max_new_tokens,
            tenant=tenant,
            adapter=client.adapter,
            role=self.config.role,
            priority=client.priority,
            deadline_s=client.deadline_s,
            block_hashes=hashes,
            owners=self.view.owners(key),
        )

    async def _admit(self, ex: Exchange) -> str:
        """The endpoint a new request goes to first: at once, or once it has waited in
        the fair queue. Raises `RouterError` when it is refused."""
        now = self.clock()
        snapshot = self.view.current(now)
        placed = self._placement(ex)
        self._deliver(self.dispatch.arrive(ex.route, ex, now, snapshot))
        return await self._placed(ex, placed, now)

    async def redispatch(self, ex: Exchange, outcome: str) -> str:
        """Where the request goes after an attempt that did not end it: `refused` (the
        endpoint did not take it, nothing of the attempt reached the client), `broken` or
        `preempted` (its stream stopped mid-answer: a resume)."""
        now = self.clock()
        snapshot = self._routable(now)
        placed = self._placement(ex)
        rid = ex.route.request_id
        if outcome == "refused":
            events = self.dispatch.refused(rid, now, snapshot, ex.retry_after_s)
        else:
            broken = outcome == "broken"
            target = _target_of(ex.continuation) if ex.continuation else ""
            events = self.dispatch.handed_back(
                rid, ex.splicer.generated, now, snapshot, broken=broken, target=target
            )
        self._deliver(events)
        return await self._placed(ex, placed, now)

    def finish(self, ex: Exchange) -> None:
        """The request is over for the router: its reservation, any wait, its charge and
        its handoff credit are settled, and the room it leaves goes to what waits."""
        if self.pairing is not None:
            self.pairing.ended(ex)
        now = self.clock()
        self._deliver(
            self.dispatch.finished(
                ex.route.request_id, ex.splicer.generated, now, self._routable(now)
            )
        )

    def _placement(self, ex: Exchange) -> asyncio.Future[str]:
        ex.placed = asyncio.get_running_loop().create_future()
        return ex.placed

    async def _placed(self, ex: Exchange, placed: asyncio.Future[str], since: float) -> str:
        if placed.done():
            return placed.result()
        try:
            return await placed
        finally:
            self.metrics.queue_seconds.labels(self.config.pool, str(ex.route.priority)).observe(
                self.clock() - since
            )

    def _deliver(self, events: list[Event[Exchange]]) -> None:
        """The core's decisions to the requests that wait on them (a request whose
        client left meanwhile has its reservation given back by `_finish`)."""
        for event in events:
            placed = event.payload.placed
            if placed is None or placed.done():
                continue
            if isinstance(event, Placed):
                placed.set_result(event.endpoint_id)
            else:
                placed.set_exception(refusal_error(event.refusal))
        self._arm_wakeup()

    def _arm_wakeup(self) -> None:
        """One timer for the core's next wakeup (a wait that ends, an endpoint avoided
        by a resume that may be asked again), moved earlier when needed."""
        when = self.dispatch.next_wakeup()
        if when is None or (self._wakeup is not None and self._wakeup_at <= when):
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = when
        loop = asyncio.get_running_loop()
        self._wakeup = loop.call_later(max(0.0, when - self.clock()), self._wake)

    def _wake(self) -> None:
        self._wakeup = None
        now = self.clock()
        self._deliver(self.dispatch.pump(now, self._routable(now)))

    def _routable(self, now: float) -> PoolSnapshot | None:
        """The snapshot to place requests on, None while it is too stale."""
        try:
            return self.view.current(now)
        except RouterError:
            return None

    def _snapshot_changed(self, snapshot: PoolSnapshot, removed: tuple[EndpointView, ...]) -> None:
        self._served = self._models_of(snapshot)
        self._adapters = _adapters_of(snapshot)
        now = self.clock()
        # A new report shows what reached its endpoint before it was taken, which is
        # what was sent up to a moment before it arrived here.
        shown = now - REPORT_LAG_S
        for endpoint_id in new_reports(self._versions, snapshot, removed):
            self.dispatch.reported(endpoint_id, shown)
        expired = 0
        for view in removed:
            self.prefix_index.forget(view.endpoint_id)
            expired += view.lease_deadline <= now
        if expired:
            self.metrics.lease_expiries.labels(self.config.pool).inc(expired)
        self._deliver(self.dispatch.pump(now, self._routable(now)))

    # -- request handling ------------------------------------------------------------

    def _entry(self, api: EngineAPI) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._handle(api, request)

        return handler

    def served_models(self) -> frozenset[str]:
        return self._served

    def _models_of(self, snapshot: PoolSnapshot) -> frozenset[str]:
        return frozenset({self.config.model, *(e.state.model for e in snapshot.endpoints)})

    async def _handle(self, api: EngineAPI, request: web.Request) -> web.StreamResponse:
        started = self.clock()
        tenant = "unknown"
        try:
            tenant = self.keys.tenant(request.headers)
            client = parse_client_request(
                api,
                await self.guard.read(request, decode_body),
                request.headers,
                models=self.served_models(),
                default_model=self.config.model,
                limits=self.config.limits,
            )
            if client.adapter:
                self._check_adapter(client.model, client.adapter)
            route = self.route_request(client, tenant, request[REQUEST_ID])
            self.trail.record(
                route.request_id, "received", tenant=tenant, model=client.model,
                api=api.value, prompt_tokens=client.prompt_tokens,
                max_new_tokens=client.max_new_tokens, priority=client.priority,
            )  # fmt: skip
            if self.quotas is not None:
                await self.quotas.charge(
                    tenant, route.request_id, client.prompt_tokens, client.max_new_tokens
                )
        except RouterError as exc:
            return self._refuse(exc, tenant, request[REQUEST_ID])
        except BodyError as exc:
            return self._refuse(body_refused(exc), tenant, request[REQUEST_ID])
        splicer = Splicer(
            api, Asks.of(client.body), prompt_tokens=client.prompt_tokens, ids_delta=self.ids_delta
        )
        ex = Exchange(client, route, tenant, started, splicer)
        try:
            if self.pairing is not None:
                await self.pairing.admit(ex)
            endpoint_id = await self._admit(ex)
        except BaseException as exc:
            self.finish(ex)  # e.g. a client that left while its request was queued
            self.release_quota(route.request_id, 0, 0)
            if isinstance(exc, RouterError):
                return self._refuse(exc, tenant, route.request_id)
            raise
        return await self.exchanges.serve(request, ex, endpoint_id)

    def _check_adapter(self, model: str, adapter: str) -> None:
        """404 for a LoRA adapter (`lora_path`) that no endpoint of the model serves. With
        no endpoint of the model at all, routing answers (503: nothing can serve it now)."""
        if (model, adapter) in self._adapters or (model, "") not in self._adapters:
            return
        raise RouterError(
            404, "not_found_error", "unknown_adapter",
            f"no endpoint of pool {self.config.pool!r} serves the adapter 'lora_path' "
            f"{adapter!r} of model {model!r}", param="lora_path",
        )  # fmt: skip

    def _refuse(self, exc: RouterError, tenant: str, request_id: str) -> web.Response:
        self.note_refusal(request_id, exc)
        pool = self.config.pool
        if exc.status in (429, 503):
            self.metrics.overloads.labels(pool, exc.reason).inc()
        reason = "overload" if exc.status in (429, 503) else "error"
        self.metrics.requests.labels(pool, tenant, reason).inc()
        return exc.response()

    def note_refusal(self, request_id: str, exc: RouterError) -> None:
        self.trail.record(
            request_id, "refused", status=exc.status, reason=exc.reason, message=exc.message,
            upstream_reason=exc.upstream_reason,
        )  # fmt: skip

    def release_quota(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        if self.quotas is not None:
            self.spawn(self.quotas.release(request_id, input_tokens, output_tokens))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Held(msgspec.Struct):
    """Of a sidecar's continuation, only where room is held for it."""

    target: str = ""


def _target_of(continuation: bytes) -> str:
    """The endpoint that holds room for a sidecar's continuation ("" when none, or when
    the record is not one: the resume is then placed as any other)."""
    try:
        return msgspec.json.decode(continuation, type=_Held).target
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


def _adapters_of(snapshot: PoolSnapshot) -> frozenset[tuple[str, str]]:
    """(model, adapter) for each adapter an endpoint serves, and (model, "") for each
    model an endpoint serves."""
    return frozenset(
        (e.state.model, adapter) for e in snapshot.endpoints for adapter in ("", *e.state.adapters)
    )
