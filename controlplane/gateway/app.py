"""The gateway: an OpenAI- and SGLang-compatible HTTP front for one pool.

A request travels: API key → tenant (401; on a gateway without keys, a declared
`x-weir-tenant` or `default`, 403 for an undeclared one) → validation (400; 404 for a model
or a `lora_path` adapter that no endpoint serves) → the
tenant's quota (429, when enforced; 403 for a tenant without one) → a decode handoff credit (prefill pools, whose requests are P/D pairs: `controlplane.gateway.pd`) → the pool snapshot (503
when stale) → a routing decision, or the tenant-fair queue when every candidate is
saturated (429 `overload` when full or timed out, 504 past its deadline) → the picked
endpoint. An overload or a
connection failure before the first byte moves the request to the next fallback (the
secondary owner first). After bytes were streamed, a dead engine or a `weir.preempted`
event resumes the request as a continuation elsewhere, spliced into the same client
stream (`controlplane.stream`). A client that goes away aborts the request upstream
at once (the connection is closed and `/abort_request` is sent for its rid).

Where a request goes, when it waits, and when it is refused is the dispatch core's
(`controlplane.routing.Dispatcher`, which the fleet simulator drives too): the gateway
feeds it arrivals, attempts' outcomes, ends and reports, and turns its events into
answers. Waiting is the gateway's: a future per placement, and one timer for the core's
next wakeup. Decisions are pure and synchronous over the in-memory snapshot; besides the
upstream call, the hot path's only I/O is the quota charge (and a prefill pool's credit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from controlplane.contract import (
    CacheIdentity,
    Continuation,
    EngineAPI,
    KVPolicy,
    PoolPolicy,
    Role,
    RoutingPolicy,
    TenantQuota,
)
from controlplane.contract import headers as wire
from controlplane.contract.vocabulary import DONE_FRAME, error_body, sse
from controlplane.gateway.credits import HandoffGate
from controlplane.gateway.errors import GatewayError, body_refused, refusal_error, unavailable
from controlplane.gateway.metrics import RouterMetrics
from controlplane.gateway.pd import Pairing
from controlplane.gateway.pool import PoolView, new_reports
from controlplane.gateway.quotas import QuotaGate
from controlplane.gateway.requests import ClientRequest, Limits, decode_body, parse, resume_body
from controlplane.gateway.tenants import TENANT_HEADER, TenantKeys
from controlplane.ownership import block_hashes, prefix_key
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
from controlplane.stream import Asks, MalformedEventError, Splicer, ask_for_counts
from controlplane.stream.relay import Ending, Relay, SegmentWatch
from controlplane.telemetry.catalog import length_bucket
from controlplane.trace.middleware import REQUEST_ID, request_ids
from controlplane.trace.spans import CLIENT, TRACER, outgoing
from controlplane.trace.trail import Trail
from controlplane.transport import (
    MAX_CONNECTIONS_PER_ORIGIN,
    HTTPClient,
    Response,
    SSEEvent,
    TransportError,
)
from controlplane.transport.admin import admin_only
from controlplane.transport.event_stream import DirectWriter
from controlplane.transport.guard import BodyError, RequestGuard, ServerLimits

log = logging.getLogger(__name__)

MAX_HASHED_BLOCKS = 256
# A report that reaches the router was taken at most this long before: what the router
# sent earlier had reached the endpoint and is in it.
REPORT_LAG_S = 0.1
_JSON = {"Content-Type": "application/json"}
CONTINUE_PATH = "/weir/v1/continue"
_API_PATHS = {
    EngineAPI.GENERATE: "/generate",
    EngineAPI.COMPLETIONS: "/v1/completions",
    EngineAPI.CHAT: "/v1/chat/completions",
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How one gateway serves one pool. `max_resumes` bounds continuations after the
    first byte (an engine or sidecar lost, a migration); the fair queue's size and time to
    live, the tries before the first byte and how long a resume waits for an endpoint are
    the pool policy's (`routing`), shared with the simulator.
    `max_upstream_connections` caps the connections open to one endpoint: past it a
    request waits for one to come free, up to `connect_timeout_s`, then tries another
    endpoint. Its default is the router's own connection cap (`server.max_connections`'s
    default): a client connection has at most one request upstream at a time, so the cap
    binds only on requests no client waits for (aborts) piling up on one endpoint."""

    pool: str = "default"
    model: str = "reference"
    host: str = "127.0.0.1"
    port: int = 0
    limits: Limits = field(default_factory=Limits)
    # What the router reads from clients: body size (by default sized to the context
    # length), bytes in flight, header/body/idle timeouts, connections.
    server: ServerLimits = field(default_factory=lambda: ServerLimits(max_connections=8192))
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    profile: Mapping[str, Any] | None = None
    max_resumes: int = 4
    connect_timeout_s: float = 2.0
    chunk_timeout_s: float = 120.0
    max_upstream_connections: int = MAX_CONNECTIONS_PER_ORIGIN
    enforce_quotas: bool = False
    # A prefill pool (role PREFILL) takes a handoff credit on its decode pool's class.
    role: Role = Role.MIXED
    decode_pool: str = ""
    kv_bytes_per_token: int = 131_072
    credit_ttl_s: float = 30.0
    # A decode pool's router publishes its handoff budget as its sidecars would admit.
    kv: KVPolicy = field(default_factory=KVPolicy)
    # Tenant quotas this router publishes to the control plane at start (the pool
    # policy's); with quotas enforced, a tenant without one is refused with 403.
    tenants: tuple[TenantQuota, ...] = ()
    # Bearer token of the debug route (GET /weir/v1/requests/{id}), and the one it shows
    # the sidecars to read theirs; empty leaves the route open.
    admin_token: str = field(default="", repr=False)

    @classmethod
    def from_policy(cls, policy: PoolPolicy, **overrides: Any) -> GatewayConfig:
        """The router settings of a pool policy (the operator's `<pool>-policy`
        ConfigMap): pool, model, context length, routing, role and tenant quotas, which
        are enforced when the policy declares any. `overrides` win."""
        fields: dict[str, Any] = {
            "pool": policy.pool,
            "model": policy.model,
            "limits": Limits(context_length=policy.context_length),
            "routing": policy.routing,
            "role": policy.role,
            "decode_pool": policy.decode_pool,
            "kv": policy.kv,
            "tenants": policy.tenants,
            "enforce_quotas": bool(policy.tenants),
        }
        fields.update(overrides)
        return cls(**fields)


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


class _ClientGoneError(Exception):
    """The client closed its connection while we wrote to it."""


class _FirstToken(SegmentWatch):
    """The router's part in relaying a segment: when its client had the first token."""

    def __init__(self, ex: _Exchange, clock: Callable[[], float]) -> None:
        self._ex = ex
        self._clock = clock

    def delivered(self) -> None:
        ex = self._ex
        if not ex.first_token_at and ex.splicer.generated:
            ex.first_token_at = self._clock()


@dataclass(slots=True)
class _Exchange:
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


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        view: PoolView,
        keys: TenantKeys | None = None,
        clock: Callable[[], float] = time.monotonic,
        quotas: QuotaGate | None = None,
        credits: HandoffGate | None = None,
        decode_view: PoolView | None = None,
    ) -> None:
        """A prefill pool's gateway (`credits` on the decode pool, whose endpoints
        `decode_view` follows) serves every request as a P/D pair."""
        self.config = config
        self.view = view
        self.keys = (keys or TenantKeys()).declaring(t.name for t in config.tenants)
        self.quotas = quotas
        self.clock = clock
        self.profile = profile_from_config(config.profile or default_config(config.routing))
        self.prefix_index = PrefixIndex()
        self.metrics = RouterMetrics(config.pool)
        self.trail = Trail("router")
        self.dispatch: Dispatcher[_Exchange] = Dispatcher(
            _CountedProfile(self.profile, self.metrics, config.pool, self.trail),
            config.routing,
            self.prefix_index,
        )
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at = 0.0
        self._versions: dict[str, int] = {}  # each endpoint's last report seen
        self._http: HTTPClient | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.pairing: Pairing | None = None
        if (credits is None) != (decode_view is None):
            raise ValueError("a P/D gateway needs both handoff credits and the decode pool's view")
        if credits is not None and decode_view is not None:
            decide = _CountedProfile(self.profile, self.metrics, decode_view.pool, self.trail)
            self.pairing = Pairing(
                credits, decode_view, Dispatcher(decide, config.routing, PrefixIndex()), clock,
                self.metrics, config.pool, self.trail, self._spawn, config.routing.max_attempts,
            )  # fmt: skip
        self._served = self._models_of(view.snapshot)
        self._adapters = _adapters_of(view.snapshot)
        # Whether the pool's /generate streams carry each event's ids only (SGLang 0.5.5)
        # or all so far (0.5.23): learnt from the first stream that shows it.
        self._ids_delta: bool | None = None
        view.on_change(self._snapshot_changed)
        self.guard = RequestGuard(
            config.server.for_context(config.limits.context_length),
            lambda exc: body_refused(exc).response(),
        )

    # -- lifecycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        ids = request_ids(
            frozenset(_API_PATHS.values()), (wire.CLIENT_REQUEST_ID,), "weir.router.request"
        )
        app = web.Application(
            client_max_size=self.guard.limits.max_body_bytes,
            middlewares=[ids, self.guard.middleware],
        )
        for api, path in _API_PATHS.items():
            app.router.add_post(path, self._entry(api))
        app.router.add_get(
            "/weir/v1/requests/{request_id}",
            admin_only(self.config.admin_token, "router", self._story),
        )
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/weir/v1/pool", self._pool_status)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._http = HTTPClient(
            connect_timeout_s=self.config.connect_timeout_s,
            read_timeout_s=self.config.chunk_timeout_s,
            max_connections_per_origin=self.config.max_upstream_connections,
        )

    async def _stop(self, _app: web.Application) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

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

    async def _admit(self, ex: _Exchange) -> str:
        """The endpoint a new request goes to first: at once, or once it has waited in
        the fair queue. Raises `GatewayError` when it is refused."""
        now = self.clock()
        snapshot = self.view.current(now)
        placed = self._placement(ex)
        self._deliver(self.dispatch.arrive(ex.route, ex, now, snapshot))
        return await self._placed(ex, placed, now)

    async def _redispatch(self, ex: _Exchange, outcome: str) -> str:
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

    def _finish(self, ex: _Exchange) -> None:
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

    def _placement(self, ex: _Exchange) -> asyncio.Future[str]:
        ex.placed = asyncio.get_running_loop().create_future()
        return ex.placed

    async def _placed(self, ex: _Exchange, placed: asyncio.Future[str], since: float) -> str:
        if placed.done():
            return placed.result()
        try:
            return await placed
        finally:
            self.metrics.queue_seconds.labels(self.config.pool, str(ex.route.priority)).observe(
                self.clock() - since
            )

    def _deliver(self, events: list[Event[_Exchange]]) -> None:
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
        except GatewayError:
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
            client = parse(
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
        except GatewayError as exc:
            return self._refuse(exc, tenant, request[REQUEST_ID])
        except BodyError as exc:
            return self._refuse(body_refused(exc), tenant, request[REQUEST_ID])
        splicer = Splicer(
            api, Asks.of(client.body), prompt_tokens=client.prompt_tokens, ids_delta=self._ids_delta
        )
        ex = _Exchange(client, route, tenant, started, splicer)
        try:
            if self.pairing is not None:
                await self.pairing.admit(ex)
            endpoint_id = await self._admit(ex)
        except BaseException as exc:
            self._finish(ex)  # e.g. a client that left while its request was queued
            self._release_quota(route.request_id, 0, 0)
            if isinstance(exc, GatewayError):
                return self._refuse(exc, tenant, route.request_id)
            raise
        return await self._serve(request, ex, endpoint_id)

    def _check_adapter(self, model: str, adapter: str) -> None:
        """404 for a LoRA adapter (`lora_path`) that no endpoint of the model serves. With
        no endpoint of the model at all, routing answers (503: nothing can serve it now)."""
        if (model, adapter) in self._adapters or (model, "") not in self._adapters:
            return
        raise GatewayError(
            404, "not_found_error", "unknown_adapter",
            f"no endpoint of pool {self.config.pool!r} serves the adapter 'lora_path' "
            f"{adapter!r} of model {model!r}", param="lora_path",
        )  # fmt: skip

    def _refuse(self, exc: GatewayError, tenant: str, request_id: str) -> web.Response:
        self._note_refusal(request_id, exc)
        pool = self.config.pool
        if exc.status in (429, 503):
            self.metrics.overloads.labels(pool, exc.reason).inc()
        reason = "overload" if exc.status in (429, 503) else "error"
        self.metrics.requests.labels(pool, tenant, reason).inc()
        return exc.response()

    def _note_refusal(self, request_id: str, exc: GatewayError) -> None:
        self.trail.record(
            request_id, "refused", status=exc.status, reason=exc.reason, message=exc.message,
            upstream_reason=exc.upstream_reason,
        )  # fmt: skip

    async def _serve(
        self, request: web.Request, ex: _Exchange, endpoint_id: str
    ) -> web.StreamResponse:
        body = ex.client.body
        resumes = 0
        try:
            while True:
                outcome, result = await self._attempt(request, ex, endpoint_id, body)
                if outcome == "done":
                    assert result is not None
                    return result
                if outcome != "refused":
                    # Broken or preempted after bytes reached the client: resume elsewhere.
                    if ex.splicer.finish or resumes >= self.config.max_resumes:
                        return await self._end_stream(ex, complete=bool(ex.splicer.finish))
                    resumes += 1
                    self.metrics.resumes.labels(self.config.pool, outcome).inc()
                    self.trail.record(
                        ex.route.request_id, "resume", cause=outcome, away_from=ex.endpoint,
                        generated_tokens=ex.splicer.generated,
                    )  # fmt: skip
                    if not (outcome == "preempted" and ex.continuation):
                        # Rebuilt from what the client holds. A sidecar's own continuation
                        # (exact token ids, a stream that already continues the client's)
                        # instead goes to the next sidecar as it came.
                        ex.continuation = b""
                        try:
                            body = resume_body(self._continuation(ex))
                        except GatewayError as exc:  # e.g. a prompt the router cannot rebuild
                            return await self._end_stream(ex, complete=False, refusal=exc)
                        ex.splicer.next_segment()
                try:
                    endpoint_id = await self._redispatch(ex, outcome)
                except GatewayError as exc:
                    return await self.answer_refusal(ex, exc)
        except (asyncio.CancelledError, _ClientGoneError):
            ex.finish = "cancelled"
            self._abort_upstream(ex)
            if ex.response is not None:
                return ex.response
            raise
        finally:
            self._finish(ex)
            self._release_quota(ex.route.request_id, ex.client.prompt_tokens, ex.splicer.generated)
            self._account(ex)
            if ex.splicer.ids_delta is not None:
                self._ids_delta = ex.splicer.ids_delta

    async def answer_refusal(self, ex: _Exchange, exc: GatewayError) -> web.StreamResponse:
        """No endpoint took the request: its client is told, in the stream it has (a
        resume no endpoint took in time) or in the answer."""
        if ex.response is not None:
            return await self._end_stream(ex, complete=False, refusal=exc)
        ex.finish = "overload"  # every endpoint tried refused it
        self.metrics.overloads.labels(self.config.pool, exc.reason).inc()
        exc.upstream_reason = ex.upstream_refusal or None
        self._note_refusal(ex.route.request_id, exc)
        return exc.response()

    def _continuation(self, ex: _Exchange) -> Continuation:
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

    async def _attempt(
        self, request: web.Request, ex: _Exchange, endpoint_id: str, body: Mapping[str, Any]
    ) -> tuple[str, web.StreamResponse | None]:
        """One upstream call: ("done", response) | ("refused", None) when the endpoint
        did not take it (refused, unreachable; nothing of this call reached the client)
        | ("broken" or "preempted", None) after bytes of it reached the client."""
        view = self.view.snapshot.by_id.get(endpoint_id)
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
            path = _API_PATHS[client.api]
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
            left = client.deadline_s - (self.clock() - ex.started)
            headers[wire.DEADLINE_MS] = str(max(1, int(left * 1000)))
        url = view.state.address + path
        with TRACER.start_as_current_span(
            "weir.router.attempt", kind=CLIENT,
            attributes={"weir.endpoint": endpoint_id, "http.route": path},
        ):  # fmt: skip
            if self.pairing is not None:  # a P/D pair: this endpoint prefills
                outcome = await self.pairing.attempt(
                    self, request, ex, view, sent, outgoing(headers), path
                )
            else:
                outcome = await self._call(
                    request, ex, endpoint_id, url, payload, outgoing(headers)
                )
        self.trail.record(
            ex.route.request_id, "attempt", endpoint=endpoint_id, outcome=outcome[0],
            upstream_rid=ex.upstream_rid, **({"refusal": ex.upstream_refusal}
                                             if outcome[0] == "refused" else {}),
        )  # fmt: skip
        return outcome

    async def _call(
        self,
        request: web.Request,
        ex: _Exchange,
        endpoint_id: str,
        url: str,
        payload: bytes,
        headers: Mapping[str, str],
    ) -> tuple[str, web.StreamResponse | None]:
        """The upstream call of `_attempt`, and the relay of what it answers."""
        assert self._http is not None
        client = ex.client
        pool = self.config.pool
        relaying = False
        try:
            async with await self._http.request("POST", url, payload, headers) as upstream:
                # A sidecar names its request: its abort matches that even for a
                # continuation, which carries no rid of the router's.
                ex.upstream_rid = upstream.headers.get(wire.REQUEST_ID) or ex.upstream_rid
                if upstream.status in (429, 503):
                    ex.retry_after_s = max(ex.retry_after_s, _retry_after(upstream))
                    ex.upstream_refusal = f"{endpoint_id}: {_refusal_reason(await upstream.read())}"
                    self.metrics.retries.labels(pool, f"upstream_{upstream.status}").inc()
                    return "refused", None
                # The profile's hooks learn it once this task next waits: indexing a long
                # prompt's blocks is not worth delaying its first byte for.
                asyncio.get_running_loop().call_soon(self.dispatch.reached, ex.route, endpoint_id)
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
                self.metrics.retries.labels(pool, exc.reason).inc()
                return "refused", None
            return "broken", None

    def upstream(self) -> HTTPClient:
        """The client of the endpoints (the app has started)."""
        assert self._http is not None
        return self._http

    def unary_answer(
        self, ex: _Exchange, endpoint_id: str, raw: bytes, status: int, content_type: str
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
        self, request: web.Request, ex: _Exchange, upstream: Response, first: list[SSEEvent]
    ) -> tuple[str, web.StreamResponse | None]:
        """A stream's relay whose first events were read already (a P/D decode leg's)."""
        return await self._relay(request, ex, upstream, first)

    async def _relay(
        self,
        request: web.Request,
        ex: _Exchange,
        upstream: Response,
        first: list[SSEEvent] | None = None,
    ) -> tuple[str, web.StreamResponse | None]:
        if ex.out is None:
            ex.out = await DirectWriter.open(
                request, {wire.ENDPOINT: ex.endpoint, wire.CLIENT_REQUEST_ID: ex.route.request_id}
            )
        out = ex.out
        relay = Relay(ex.splicer, _FirstToken(ex, self.clock))
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

    async def _end_stream(
        self, ex: _Exchange, *, complete: bool, refusal: GatewayError | None = None
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

    def _release_quota(self, request_id: str, input_tokens: int, output_tokens: int) -> None:
        if self.quotas is not None:
            self._spawn(self.quotas.release(request_id, input_tokens, output_tokens))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abort_upstream(self, ex: _Exchange) -> None:
        """Tell the endpoint the client left: its rid (the sidecar's, where it named one)
        is aborted at once. Closing the upstream connection says the same to a server
        that cancels handlers on disconnect; behind a proxy, or to one that does not,
        only this call does."""
        if not ex.address or self._http is None:
            return
        http, url, rid = self._http, ex.address + "/abort_request", ex.upstream_rid
        body = msgspec.json.encode({"rid": rid})

        async def abort() -> None:
            try:
                async with await http.request("POST", url, body, _JSON) as reply:
                    await reply.read()
            except TransportError as exc:
                log.info("abort of %s at %s failed: %s", rid, url, exc)

        self._spawn(abort())

    def _account(self, ex: _Exchange) -> None:
        m, pool, tenant = self.metrics, self.config.pool, ex.tenant
        now = self.clock()
        out = ex.splicer.generated
        self.trail.record(
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

    # -- plain endpoints -------------------------------------------------------------

    async def _models(self, _request: web.Request) -> web.Response:
        data = [
            {"id": model, "object": "model", "owned_by": "weir"}
            for model in sorted(self.served_models())
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, _request: web.Request) -> web.Response:
        try:
            snapshot = self.view.current(self.clock())
        except GatewayError as exc:
            return exc.response()
        if not snapshot.preferred:
            return unavailable("no_endpoint", "no ready endpoint in the pool").response()
        return web.json_response({"status": "ready", "endpoints": len(snapshot.preferred)})

    async def _metrics(self, _request: web.Request) -> web.Response:
        self._observe_snapshot()
        if self.quotas is not None:
            gauge = self.metrics.quota_utilization
            with contextlib.suppress(RedisError, OSError):  # scrape what is known
                for (tenant, resource), ratio in (await self.quotas.utilization()).items():
                    gauge.labels(self.config.pool, tenant, resource).set(ratio)
        return web.Response(
            body=self.metrics.exposition(), content_type="text/plain", charset="utf-8"
        )

    def _observe_snapshot(self) -> None:
        m, pool, snapshot = self.metrics, self.config.pool, self.view.snapshot
        m.snapshot_age.labels(pool).set(max(0.0, self.clock() - self.view.confirmed_at))
        m.ring_version.labels(pool).set(snapshot.ring_version)
        m.endpoints.clear()
        m.endpoint_kv.clear()
        counts: dict[tuple[str, str], int] = {}
        for e in snapshot.endpoints:
            s = e.state
            key = (s.lifecycle.value, s.watermark.value)
            counts[key] = counts.get(key, 0) + 1
            m.endpoint_kv.labels(pool, e.endpoint_id, "used").set(s.kv_used_tokens)
            m.endpoint_kv.labels(pool, e.endpoint_id, "reserved").set(s.kv_reserved_growth_tokens)
            m.endpoint_kv.labels(pool, e.endpoint_id, "capacity").set(s.kv_capacity_tokens)
        for (lifecycle, watermark), n in counts.items():
            m.endpoints.labels(pool, lifecycle, watermark).set(n)

    async def _story(self, request: web.Request) -> web.Response:
        """One request's whole story: what this router decided about it, and what each
        endpoint it went to recorded (read from their sidecars with the admin token)."""
        request_id = request.match_info["request_id"]
        story = self.trail.story(request_id)
        if story is None:
            return GatewayError(
                404, "not_found_error", "unknown_request",
                f"no record of request {request_id!r} here (unknown, or forgotten: the "
                f"router keeps its last {self.trail.max_requests} requests)",
            ).response()  # fmt: skip
        events = story["events"]
        endpoints = sorted(
            {e["endpoint"] for e in events if e["event"] == "attempt"}
            | {e["decode"] for e in events if e["event"] == "pair"}  # a P/D pair's decode legs
        )
        stories = await asyncio.gather(*(self._endpoint_story(e, request_id) for e in endpoints))
        return web.json_response({**story, "endpoints": dict(zip(endpoints, stories, strict=True))})

    async def _endpoint_story(self, endpoint_id: str, request_id: str) -> Any:
        """What `endpoint_id`'s sidecar recorded about the request, or why it cannot say."""
        view = self.view.snapshot.by_id.get(endpoint_id)
        if view is None and self.pairing is not None:
            view = self.pairing.view.snapshot.by_id.get(endpoint_id)
        if view is None or self._http is None:
            return {"unavailable": "the endpoint has left the pool"}
        headers = dict(_JSON)
        if self.config.admin_token:
            headers["Authorization"] = f"Bearer {self.config.admin_token}"
        url = f"{view.state.address}/weir/v1/requests/{request_id}"
        try:
            async with await self._http.request("GET", url, b"", headers) as reply:
                raw = await reply.read()
                if reply.status != 200:
                    return {"unavailable": f"the sidecar answered {reply.status}"}
                return msgspec.json.decode(raw)
        except (TransportError, msgspec.DecodeError) as exc:
            return {"unavailable": f"the sidecar did not answer: {exc}"}

    async def _pool_status(self, _request: web.Request) -> web.Response:
        """`GET /weir/v1/pool`: the fleet as this router sees it (`weir up`'s status view).

        Top level: `pool`, `version` (change-feed) and `ring_version` of the snapshot,
        `snapshot_age_s` since the control plane last confirmed it, `stale` (past the
        staleness bound: routing refuses), `error` (why the feed is failing; empty while it works),
        `queued` (requests in the fair queue) and `endpoints`, one object each:
        `endpoint_id`, `address`, `lifecycle`, `watermark`, `kv_used_tokens`,
        `kv_reserved_growth_tokens`, `kv_capacity_tokens`, `running_requests`,
        `queued_requests` (as last reported), `router_inflight` (sent by this router since
        that report) and `lease_left_s` (null for a fixed `--endpoint`). A prefill pool's
        router adds `decode`: its decode pool (`pool`, `stale`, `endpoints`) as it sees it."""
        now = self.clock()
        status = {
            "pool": self.config.pool,
            "version": self.view.snapshot.version,
            "ring_version": self.view.snapshot.ring_version,
            "snapshot_age_s": round(now - self.view.confirmed_at, 3),
            "stale": self.view.is_stale(now),
            "error": self.view.error,
            "queued": len(self.dispatch.queue),
            "endpoints": _endpoint_rows(self.view.snapshot, self.dispatch, now),
        }
        if self.pairing is not None:
            decode = self.pairing.view
            status["decode"] = {
                "pool": decode.pool,
                "stale": decode.is_stale(now),
                "endpoints": _endpoint_rows(decode.snapshot, self.pairing.dispatch, now),
            }
        return web.json_response(status)


def _endpoint_rows(
    snapshot: PoolSnapshot, dispatch: Dispatcher[_Exchange], now: float
) -> list[dict[str, Any]]:
    """Each endpoint of a snapshot, for `GET /weir/v1/pool`."""
    return [
        {
            "endpoint_id": e.endpoint_id,
            "address": e.state.address,
            "lifecycle": e.state.lifecycle.value,
            "watermark": e.state.watermark.value,
            "kv_used_tokens": e.state.kv_used_tokens,
            "kv_reserved_growth_tokens": e.state.kv_reserved_growth_tokens,
            "kv_capacity_tokens": e.state.kv_capacity_tokens,
            "running_requests": e.state.running_requests,
            "queued_requests": e.state.queued_requests,
            "router_inflight": dispatch.inflight.count(e.endpoint_id),
            "lease_left_s": None
            if e.lease_deadline == float("inf")
            else round(e.lease_deadline - now, 3),
        }
        for e in snapshot.endpoints
    ]


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
