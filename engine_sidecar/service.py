"""The sidecar's HTTP service: the proxy in front of the engine, and its control surface.

Routes:

- `POST /generate`, `/v1/completions`, `/v1/chat/completions` — validated, admitted
  locally (429 `overload` with Retry-After when KV cannot take them now; 400 `too_large`
  when it never can, except for a continuation, which stays 429), forwarded with a
  unique fixed-length rid, tracked through the request state machine while they stream;
- `POST /weir/v1/continue` — a `Continuation` from another endpoint (through the router),
  streamed as the continuation of the client's stream (cumulative fields include what was
  generated before);
- `GET /v1/models`, `GET /health`, `GET /metrics`;
- admin: `GET /weir/v1/state` (every request and tenant), `POST /weir/v1/preempt`
  `{"rid", "mode"}` and `POST /weir/v1/drain` `{"deadline_s"}` — the same actions the
  control-plane commands trigger — and `POST /weir/v1/reserve` (a `RoomReservation`:
  another sidecar's relief asks this one to hold room for a continuation it is about to
  migrate here; 409 `no_room` with the room there is). With an admin token configured
  they need `Authorization: Bearer TOKEN` (401 otherwise); without one they are open;
- `POST /abort_request` `{"rid"}` — SGLang's: cancels the requests the client sent with
  that `rid` (or with that sidecar rid), as if their clients had left. It and
  `/weir/v1/continue` are the router's: reachable only from the pool's network.

Request headers a router sets: `x-weir-tenant` (default "default"), `x-weir-migratable: 1`
(the router can splice a `weir.preempted` continuation), `x-weir-deadline-ms` (relative).

The requests' state machine is `engine_sidecar.segments`, the actions on them (preempt,
relief, commands, drain) `engine_sidecar.actions`.

A streamed request may be preempted at any time: the sidecar aborts its rid in the engine;
when the engine's stream ends with the abort, the request either resumes in place (its
prompt plus what the client has received, as a fresh engine request, once admission
allows) or — when the router marked it migratable (`x-weir-migratable: 1`) — ends this
response with an SSE `weir.preempted` event carrying the continuation for the router. A
resume in place that finds no room here within the local queue's wait is handed back the
same way when it is migratable (else its stream ends with an `overload` error).
A client that disconnects is cancelled: the engine request is aborted at once and its KV
released.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from controlplane.contract import (
    Command,
    Continuation,
    EndpointState,
    EngineAPI,
    PoolPolicy,
    PreemptionMode,
    Role,
    RoomReservation,
    SchemaError,
    decode_json,
    encode_json,
)
from controlplane.stream import Splicer
from controlplane.trace.trail import Trail
from controlplane.transport.admin import Handler, admin_only
from controlplane.transport.guard import BodyError, RequestGuard, ServerLimits
from engine_sidecar.actions import Actions
from engine_sidecar.engine import EngineAdapter, EngineInfo
from engine_sidecar.errors import bad_request, body_refused, error_json
from engine_sidecar.intake import (
    ENGINE_PATH,
    IntakeLimits,
    RequestError,
    from_continuation,
    parse_intake,
    parse_json,
)
from engine_sidecar.ledger import Ledger, Preemption
from engine_sidecar.metrics import SidecarMetrics
from engine_sidecar.policy import H200_LLAMA_8B, HostPrefixes, ReliefCosts, Reservation
from engine_sidecar.quota import KVQuota
from engine_sidecar.segments import Origin, Segments

CONTINUE_PATH = "/weir/v1/continue"
RESERVE_PATH = "/weir/v1/reserve"
_MODES = tuple(Preemption)


class SidecarService:
    """One endpoint's sidecar: its HTTP routes over the requests in flight (`segments`)
    and what it does to them (`actions`)."""

    # Where requests (and so request ids) arrive.
    REQUEST_PATHS = frozenset((*ENGINE_PATH.values(), CONTINUE_PATH))

    def __init__(
        self,
        engine: EngineAdapter,
        info: EngineInfo,
        policy: PoolPolicy,
        pool: str,
        endpoint_id: str,
        admin_token: str = "",
        server_limits: ServerLimits | None = None,
    ) -> None:
        self.engine = engine
        self._admin_token = admin_token  # empty: the admin routes are open
        self.info = info
        self.policy = policy
        self.ledger = Ledger(policy, info.kv_capacity_tokens)
        self.ledger.on_reservation = self._reservation_event
        self.metrics = SidecarMetrics(self.ledger, pool, endpoint_id)
        self.trail = Trail(f"sidecar/{endpoint_id}")
        self.limits = IntakeLimits(
            model=policy.model or info.model,
            context_length=min(policy.context_length, info.context_length or policy.context_length),
        )
        limits = server_limits or ServerLimits().for_context(
            max(policy.context_length, info.context_length or 0)
        )
        self.guard = RequestGuard(
            limits,
            body_refused,
            lambda limit: self.metrics.count("weir_sidecar_client_limits_total", limit),
        )
        # A continuation carries the client's body and what was generated: twice the room.
        self.continuation_limit = 2 * limits.max_body_bytes
        self.draining = False
        self.engine_ok = True  # the engine answered its last load poll
        self.quota: KVQuota | None = None  # installed with the control-plane link
        self.on_drain: Callable[[], Awaitable[None]] | None = None  # the control-plane link
        modes = policy.scheduling.preemption_modes
        # A decode endpoint of a P/D pair resumes nothing in place: its engine takes a
        # request only with a prefill half, which the router pairs it with again.
        in_place = policy.role is not Role.DECODE
        self.may_recompute = in_place and PreemptionMode.RECOMPUTE in modes
        self.may_migrate = PreemptionMode.MIGRATE in modes
        # Offload is a resume in place whose pages wait in the engine's host tier: it
        # needs one, and relief weighs it against recompute and migrate by cost: the
        # engine's own figures where it says them (KV bytes a token, its page; its host
        # bandwidth once it has timed a copy, `observe_host_bandwidth`), else an H200's.
        self.costs = replace(
            H200_LLAMA_8B,
            kv_bytes_per_token=info.kv_bytes_per_token or H200_LLAMA_8B.kv_bytes_per_token,
            page_tokens=info.page_size,
        )
        self.host_tier_tokens = info.host_tier_tokens(self.costs.kv_bytes_per_token)
        self.may_offload = (
            in_place and PreemptionMode.OFFLOAD in modes and self.host_tier_tokens > 0
        )
        if not self.host_tier_tokens:
            self.costs = replace(self.costs, host_bytes_per_s=0.0)
        self.host_prefixes = HostPrefixes(self.host_tier_tokens)  # published in heartbeats
        self.segments = Segments(self)
        self.actions = Actions(self, self.segments)

    # -- routes ------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        def entry(api: EngineAPI) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
            async def handler(request: web.Request) -> web.StreamResponse:
                return await self.handle(request, api)

            return handler

        return [
            *(web.post(path, entry(api)) for api, path in ENGINE_PATH.items()),
            web.post(CONTINUE_PATH, self.handle_continue),
            web.post("/weir/v1/preempt", self._admin(self.handle_preempt)),
            web.post("/weir/v1/drain", self._admin(self.handle_drain)),
            web.post(RESERVE_PATH, self._admin(self.handle_reserve)),
            web.post("/abort_request", self.handle_abort),
            web.get("/weir/v1/state", self._admin(self.handle_state)),
            web.get("/weir/v1/requests/{request_id}", self._admin(self.handle_story)),
            web.get("/v1/models", self.handle_models),
            web.get("/health", self.handle_health),
            web.get("/metrics", self.handle_metrics),
        ]

    def _admin(self, handler: Handler) -> Handler:
        return admin_only(self._admin_token, "sidecar", handler)

    async def handle(self, request: web.Request, api: EngineAPI) -> web.StreamResponse:
        try:
            body = await self.guard.read(request, parse_json)
            intake = parse_intake(api, body, self.limits, self.ledger.prompt_sizer)
        except RequestError as exc:
            return bad_request(exc)
        except BodyError as exc:
            return body_refused(exc)
        rid = body.get("rid")
        origin = Origin(intake.body, intake.prompt_ids)
        return await self.segments.serve(
            request, intake, origin, client_rid=rid if isinstance(rid, str) else ""
        )

    async def handle_continue(self, request: web.Request) -> web.StreamResponse:
        try:
            cont = await self.guard.read(
                request, _decode_continuation, limit=self.continuation_limit
            )
            intake = from_continuation(cont, self.limits, self.ledger.prompt_sizer)
        except SchemaError as exc:
            return bad_request(RequestError(str(exc)))
        except RequestError as exc:
            return bad_request(exc)
        except BodyError as exc:
            return body_refused(exc)
        reader = Splicer(
            cont.api,
            offset_tokens=cont.generated,
            prefix_ids=list(cont.generated_ids),
            prefix_text=cont.generated_text,
            prompt_ids=list(cont.prompt_ids),
            client_id=cont.response_id,
            client_created=cont.created,
            prompt_tokens=cont.prompt_tokens,
            cached_tokens=cont.cached_tokens,
        )
        origin = Origin(dict(cont.body), cont.prompt_ids)
        return await self.segments.serve(
            request, intake, origin, reader, cont.preemptions, resumed=True,
            reservation=cont.reservation,
        )  # fmt: skip

    async def handle_models(self, request: web.Request) -> web.Response:
        model = {"id": self.limits.model, "object": "model", "owned_by": "weir"}
        return web.json_response({"object": "list", "data": [model]})

    async def handle_health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine_ok:
            return web.json_response({"status": "engine_unreachable"}, status=503)
        return web.json_response({"status": "ok"})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"content-type": "text/plain; version=0.0.4"}
        )

    async def handle_state(self, request: web.Request) -> web.Response:
        ledger = self.ledger
        return web.json_response(
            {
                "watermark": ledger.watermark.value,
                "capacity_tokens": ledger.capacity_tokens,
                "used_tokens": ledger.used_tokens,
                "own_used_tokens": ledger.own_used,
                "reserved_growth_tokens": ledger.reserved,
                "waiting_prefill_tokens": ledger.waiting_prefill,
                "queued": ledger.queued,
                "held_for_migrations_tokens": ledger.held_tokens,
                "admission_open": ledger.admission_open,
                "draining": self.draining,
                "preemptions": ledger.preemptions,
                "requests": {
                    rid: {
                        "state": f.record.state.value,
                        "tenant": f.record.tenant,
                        "prompt_tokens": f.record.prompt_tokens,
                        "generated_tokens": f.record.generated_tokens,
                        "preemptions": f.record.preemptions,
                    }
                    for rid, f in ledger.flights.items()
                },
            }
        )

    async def handle_story(self, request: web.Request) -> web.Response:
        """What this sidecar recorded about one request (by the router's request id)."""
        request_id = request.match_info["request_id"]
        story = self.trail.story(request_id)
        if story is None:
            return web.Response(
                status=404,
                body=error_json("not_found", f"no record of request {request_id} here"),
                content_type="application/json",
            )
        return web.json_response(story)

    async def handle_preempt(self, request: web.Request) -> web.Response:
        try:
            body = await self.guard.read(request, parse_json)
            rid, mode = body.get("rid"), body.get("mode", Preemption.RECOMPUTE)
            if not isinstance(rid, str) or mode not in _MODES:
                raise RequestError(
                    'expected {"rid": str, "mode": "recompute"|"offload"|"migrate"|"terminate"}'
                )
        except RequestError as exc:
            return bad_request(exc)
        except BodyError as exc:
            return body_refused(exc)
        if rid not in self.ledger.flights:
            return web.Response(
                status=404, body=error_json("not_found", f"no request {rid}"),
                content_type="application/json",
            )  # fmt: skip
        done = await self.preempt(rid, Preemption(mode), "ordered through /weir/v1/preempt")
        return web.json_response({"preempted": done}, status=200 if done else 409)

    async def handle_abort(self, request: web.Request) -> web.Response:
        """SGLang's abort: 200 whether or not a request matched (as SGLang answers)."""
        try:
            rid = (await self.guard.read(request, parse_json)).get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestError('expected {"rid": str}')
        except RequestError as exc:
            return bad_request(exc)
        except BodyError as exc:
            return body_refused(exc)
        for flight in list(self.ledger.flights.values()):
            if rid in (flight.client_rid, flight.rid) and flight.task is not None:
                flight.task.cancel()
        return web.Response(status=200)

    async def handle_drain(self, request: web.Request) -> web.Response:
        try:
            body = await self.guard.read(request, _parse_json_or_empty)
            deadline = body.get("deadline_s", 30.0)
            if isinstance(deadline, bool) or not isinstance(deadline, int | float):
                raise RequestError("deadline_s must be a number")
            if not 0 <= deadline <= 3600:
                raise RequestError("deadline_s must be in [0, 3600]")
        except RequestError as exc:
            return bad_request(exc)
        except BodyError as exc:
            return body_refused(exc)
        return web.json_response(await self.drain(float(deadline)))

    async def handle_reserve(self, request: web.Request) -> web.Response:
        """Hold room for a continuation another sidecar is about to migrate here."""
        try:
            asked = await self.guard.read(request, _decode_reservation)
        except SchemaError as exc:
            return bad_request(RequestError(str(exc)))
        except BodyError as exc:
            return body_refused(exc)
        granted = (
            None
            if self.draining
            else self.ledger.reserve(asked.request_id, asked.tokens, asked.ttl_s)
        )
        if granted is None:
            room = 0 if self.draining else self.ledger.room_tokens()
            message = f"no room for {asked.tokens} tokens here ({room} reservable)"
            return web.Response(
                status=409,
                body=error_json("conflict", message, reason="no_room", room_tokens=room),
                content_type="application/json",
            )
        answer = msgspec.structs.replace(asked, reservation_id=granted.reservation_id)
        return web.Response(body=encode_json(answer), content_type="application/json")

    def _reservation_event(self, outcome: str, reservation: Reservation) -> None:
        """A reservation here was taken, refused, consumed or expired: counted, and
        recorded in the request's story."""
        self.metrics.count("weir_sidecar_migration_reservations_total", outcome)
        self.trail.record(
            reservation.request_id, f"reservation_{outcome}", tokens=reservation.tokens,
            reservation=reservation.reservation_id,
        )  # fmt: skip

    # -- what the server and the control-plane link drive -----------------------------

    async def preempt(self, rid: str, mode: Preemption, why: str) -> bool:
        return await self.actions.preempt(rid, mode, why)

    async def execute(self, command: Command) -> bool:
        return await self.actions.execute(command)

    async def relieve(self, peers: Sequence[EndpointState] = ()) -> list[str]:
        return await self.actions.relieve(peers)

    def relief_costs(self) -> ReliefCosts:
        return self.actions.relief_costs()

    def observe_host_bandwidth(self, bytes_per_s: float) -> None:
        """The engine's measured device-host bandwidth replaces the default (0: it has
        timed no copy yet)."""
        if bytes_per_s > 0 and self.host_tier_tokens:
            self.costs = replace(self.costs, host_bytes_per_s=bytes_per_s)

    async def drain(self, deadline_s: float) -> dict[str, int]:
        return await self.actions.drain(deadline_s)

    async def settled(self) -> None:
        """Wait for the background work requests left behind (quota releases, aborts)."""
        await self.segments.settled()


def _decode_continuation(raw: bytes) -> Continuation:
    return decode_json(raw, Continuation)


def _decode_reservation(raw: bytes) -> RoomReservation:
    return decode_json(raw, RoomReservation)


def _parse_json_or_empty(raw: bytes) -> dict[str, Any]:
    return parse_json(raw or b"{}")
