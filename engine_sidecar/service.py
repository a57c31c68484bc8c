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

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from aiohttp import web

from controlplane.contract import (
    Command,
    CommandKind,
    Continuation,
    EndpointState,
    EngineAPI,
    FinishReason,
    PoolPolicy,
    PreemptionMode,
    Role,
    RoomReservation,
    SchemaError,
    decode_json,
    encode_json,
)
from controlplane.contract import headers as wire
from controlplane.contract.vocabulary import DONE_FRAME, error_body, preempted_frame, sse
from controlplane.stream import (
    Asks,
    MalformedEventError,
    Splicer,
    ask_for_counts,
    finish_reason,
)
from controlplane.stream.relay import Ending, Relay
from controlplane.telemetry.catalog import length_bucket
from controlplane.trace.middleware import REQUEST_ID
from controlplane.trace.trail import (
    Trail,
    carried_request_id,
    handled_request,
    request_id_of,
    sidecar_rid,
)
from controlplane.transport.admin import Handler, admin_only
from controlplane.transport.event_stream import DirectWriter
from controlplane.transport.guard import BodyError, RequestGuard, ServerLimits
from engine_sidecar.engine import EngineAdapter, EngineError, EngineInfo
from engine_sidecar.forward import LedgerWatch
from engine_sidecar.intake import (
    ENGINE_PATH,
    Intake,
    Limits,
    RequestError,
    from_continuation,
    parse,
    parse_json,
)
from engine_sidecar.ledger import COMMITTED, Flight, Ledger, OverloadError
from engine_sidecar.metrics import SidecarMetrics
from engine_sidecar.policy import (
    H200_LLAMA_8B,
    RESERVATION_TTL_S,
    HostPrefixes,
    ReliefCosts,
    RequestRecord,
    RequestState,
    Reservation,
    Rung,
    SequenceOutlook,
    TargetRooms,
    VictimChoice,
    engine_priority,
    growth_reserve,
    peer_rooms,
    plan_relief,
)
from engine_sidecar.quota import KVQuota

log = logging.getLogger("weir.sidecar")
_S = RequestState
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_RESUMABLE = frozenset({_S.DECODING, _S.DECODE_READY})
_MODES = ("recompute", "offload", "migrate", "terminate")
TOO_LARGE = "too_large"  # admission's reason for a request that can never fit


CONTINUE_PATH = "/weir/v1/continue"
RESERVE_PATH = "/weir/v1/reserve"
# Asks `peer` to hold room (a `RoomReservation` without id): the grant, or None and the
# room the peer says it has (0 when it did not answer).
Reserve = Callable[[EndpointState, RoomReservation], Awaitable[tuple[RoomReservation | None, int]]]


def _error(kind: str, message: str, **extra: str | int) -> bytes:
    """The error body, naming the request being handled, if any."""
    return error_body(kind, message, **{"request_id": handled_request(), **extra})


def overload_response(reason: str, retry_after_s: int, message: str) -> web.Response:
    return web.Response(
        status=429,
        body=_error("overload", message, reason=reason),
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
        body=_error(kind, exc.message, reason=exc.reason),
        content_type="application/json",
        headers=headers,
    )


def _bad(exc: RequestError) -> web.Response:
    extra = {"reason": exc.reason, **({"param": exc.param} if exc.param else {})}
    return web.Response(
        status=exc.status,
        body=_error(exc.kind, str(exc), **extra),
        content_type="application/json",
    )


@dataclass
class _Origin:
    """How the request first entered Weir, for building its continuation."""

    body: dict[str, Any]
    prompt_ids: tuple[int, ...]


class SidecarService:
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
        self.limits = Limits(
            model=policy.model or info.model,
            context_length=min(policy.context_length, info.context_length or policy.context_length),
        )
        limits = server_limits or ServerLimits().for_context(
            max(policy.context_length, info.context_length or 0)
        )
        self.guard = RequestGuard(limits, body_refused)
        # A continuation carries the client's body and what was generated: twice the room.
        self.continuation_limit = 2 * limits.max_body_bytes
        self.draining = False
        self.engine_ok = True  # the engine answered its last load poll
        self.quota: KVQuota | None = None  # installed with the control-plane link
        self.on_drain: Callable[[], Awaitable[None]] | None = None  # the control-plane link
        self._origins: dict[str, _Origin] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        modes = policy.scheduling.preemption_modes
        # A decode endpoint of a P/D pair resumes nothing in place: its engine takes a
        # request only with a prefill half, which the router pairs it with again.
        in_place = policy.role is not Role.DECODE
        self._may_recompute = in_place and PreemptionMode.RECOMPUTE in modes
        self._may_migrate = PreemptionMode.MIGRATE in modes
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
        self._may_offload = (
            in_place and PreemptionMode.OFFLOAD in modes and self.host_tier_tokens > 0
        )
        if not self.host_tier_tokens:
            self.costs = replace(self.costs, host_bytes_per_s=0.0)
        self.host_prefixes = HostPrefixes(self.host_tier_tokens)  # published in heartbeats
        # Whether the engine's /generate streams carry each event's ids only (SGLang
        # 0.5.5) or all so far (0.5.23): learnt from the first stream that shows it.
        self.ids_delta: bool | None = None

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
            intake = parse(api, body, self.limits)
        except RequestError as exc:
            return _bad(exc)
        except BodyError as exc:
            return body_refused(exc)
        rid = body.get("rid")
        origin = _Origin(intake.body, intake.prompt_ids)
        return await self._serve(
            request, intake, origin, client_rid=rid if isinstance(rid, str) else ""
        )

    async def handle_continue(self, request: web.Request) -> web.StreamResponse:
        try:
            cont = await self.guard.read(
                request, _decode_continuation, limit=self.continuation_limit
            )
            intake = from_continuation(cont, self.limits)
        except SchemaError as exc:
            return _bad(RequestError(str(exc)))
        except RequestError as exc:
            return _bad(exc)
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
        origin = _Origin(dict(cont.body), cont.prompt_ids)
        return await self._serve(
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
                body=_error("not_found", f"no record of request {request_id} here"),
                content_type="application/json",
            )
        return web.json_response(story)

    async def handle_preempt(self, request: web.Request) -> web.Response:
        try:
            body = await self.guard.read(request, parse_json)
            rid, mode = body.get("rid"), body.get("mode", "recompute")
            if not isinstance(rid, str) or mode not in _MODES:
                raise RequestError(
                    'expected {"rid": str, "mode": "recompute"|"offload"|"migrate"|"terminate"}'
                )
        except RequestError as exc:
            return _bad(exc)
        except BodyError as exc:
            return body_refused(exc)
        if rid not in self.ledger.flights:
            return web.Response(
                status=404, body=_error("not_found", f"no request {rid}"),
                content_type="application/json",
            )  # fmt: skip
        done = await self.preempt(rid, mode, "ordered through /weir/v1/preempt")
        return web.json_response({"preempted": done}, status=200 if done else 409)

    async def handle_abort(self, request: web.Request) -> web.Response:
        """SGLang's abort: 200 whether or not a request matched (as SGLang answers)."""
        try:
            rid = (await self.guard.read(request, parse_json)).get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestError('expected {"rid": str}')
        except RequestError as exc:
            return _bad(exc)
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
            return _bad(exc)
        except BodyError as exc:
            return body_refused(exc)
        return web.json_response(await self.drain(float(deadline)))

    async def handle_reserve(self, request: web.Request) -> web.Response:
        """Hold room for a continuation another sidecar is about to migrate here."""
        try:
            asked = await self.guard.read(request, _decode_reservation)
        except SchemaError as exc:
            return _bad(RequestError(str(exc)))
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
                body=_error("conflict", message, reason="no_room", room_tokens=room),
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

    # -- one request ---------------------------------------------------------------------

    async def _serve(
        self,
        request: web.Request,
        intake: Intake,
        origin: _Origin,
        reader: Splicer | None = None,
        preemptions: int = 0,
        client_rid: str = "",
        *,
        resumed: bool = False,
        reservation: str = "",
    ) -> web.StreamResponse:
        tenant = request.headers.get(wire.TENANT, "default")
        if not _TENANT.match(tenant):
            return _bad(RequestError(f"{wire.TENANT} must be a short name ([A-Za-z0-9_.:-])"))
        try:
            deadline_s = _deadline(request.headers.get(wire.DEADLINE_MS))
            prefix_block = _prefix_block(request.headers.get(wire.PREFIX_BLOCK))
        except RequestError as exc:
            return _bad(exc)
        if self.draining:
            self.metrics.count("weir_sidecar_admission_rejections_total", "draining")
            return overload_response("draining", 5, "this endpoint is draining")
        now = self.ledger.clock()
        streamed = intake.stream
        record = RequestRecord(
            rid=sidecar_rid(request.get(REQUEST_ID) or carried_request_id(None)),
            tenant=tenant,
            model=intake.model,
            prompt_tokens=intake.prompt_tokens,
            # A prefill endpoint computes the first token only: that is all it grows by.
            max_new_tokens=1 if self.policy.role is Role.PREFILL else intake.max_new_tokens,
            arrived_at=now,
            state_since=now,
            deadline_at=now + deadline_s if deadline_s else 0.0,
            priority=intake.priority,
            preemptions=preemptions,
            # A completion prompted by token ids extends by the ids the engine reports.
            recomputable=streamed
            and (intake.recomputable or self.info.openai_token_ids)
            and (self._may_recompute or self._may_offload),
            migratable=streamed
            and self._may_migrate
            and request.headers.get(wire.MIGRATABLE) == "1",
        )
        flight = Flight(
            intake, record, arrived_mono=now, client_rid=client_rid, resumed=resumed,
            reservation=reservation, prefix_block=prefix_block,
        )  # fmt: skip
        flight.task = asyncio.current_task()
        self.ledger.add(flight)
        self._origins[record.rid] = origin
        try:
            if self.quota is not None:
                retry_after = await self.quota.charge(flight)
                if retry_after is not None:
                    self._end(flight, _S.REJECTED, FinishReason.OVERLOAD, "tenant_kv_quota")
                    return overload_response(
                        "tenant_kv_quota", retry_after, f"tenant {tenant} is out of KV quota"
                    )
            if resumed:
                self._note(flight, "continuation", offset_tokens=record.prompt_tokens)
            try:
                await self.ledger.admit(flight)
            except OverloadError as exc:
                self._note_admission(flight, exc)
                if exc.reason == TOO_LARGE and not resumed:
                    # Never fits, whenever it is retried: the client's error, not overload.
                    # A continuation keeps the overload answer: the router places it
                    # elsewhere or ends the stream it already started.
                    self._end(flight, _S.REJECTED, FinishReason.ERROR, exc.reason)
                    return self._too_large(flight)
                self._end(flight, _S.REJECTED, FinishReason.OVERLOAD, exc.reason)
                return overload_response(exc.reason, exc.retry_after_s, str(exc))
            self._note_admission(flight)
            if streamed:
                return await self._stream(request, flight, reader or Splicer(intake.api))
            return await self._unary(flight)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away. The cancellation runs to its end even if this handler
            # is cancelled again meanwhile.
            await asyncio.shield(self._spawn(self._cancel(flight)))
            raise
        except Exception:
            log.exception("request %s failed", record.rid)
            if flight.record.state is _S.WAITING_ADMISSION:
                # Failed before admission (the quota's charge, say): the engine never saw it.
                self._end(flight, _S.REJECTED, FinishReason.ERROR, "internal_error")
            elif not flight.record.state.is_final:
                await asyncio.shield(self._spawn(self._abort_and_end(flight)))
            raise
        finally:
            self._origins.pop(record.rid, None)

    async def _abort_and_end(self, flight: Flight) -> None:
        await self._abort_engine(flight)
        self._end(flight, _S.ABORTED, FinishReason.ERROR, "internal_error")

    def _engine_body(
        self,
        flight: Flight,
        reader: Splicer,
        segment: int,
        resume: Continuation | None,
    ) -> tuple[EngineAPI, dict[str, Any]]:
        """The engine API and body of the request's next segment: the client's body first
        (or a continuation's), then `resume`'s."""
        rec = flight.record
        if resume is None:
            api, body = flight.intake.engine_api or flight.intake.api, dict(flight.intake.body)
        else:
            api, body = resume.resume_api, resume.engine_body()
        flight.engine_rid = f"{rec.rid}s{segment:03d}"
        body["rid"] = flight.engine_rid
        body["stream"] = flight.intake.stream
        if flight.intake.stream:
            ask_for_counts(api, body, token_ids=self.info.openai_token_ids)
        if self.policy.scheduling.priority_scheduling:
            now = self.ledger.clock()
            slack = rec.deadline_at - now if rec.deadline_at else None
            body["priority"] = engine_priority(
                rec.priority, now - rec.arrived_at, slack, self.policy.scheduling.aging_per_second
            )
        return api, body

    async def continuation(self, flight: Flight, reader: Splicer) -> Continuation:
        """Everything another engine request needs to carry on where the client is: token
        ids wherever they are known (the engine then resumes token for token), else text."""
        rec = flight.record
        origin = self._origins[rec.rid]
        ids = reader.exact_ids()
        return Continuation(
            request_id=rec.rid,
            tenant=rec.tenant,
            model=rec.model,
            api=flight.intake.api,
            body=origin.body,
            prompt_ids=await self._prompt_ids(flight, reader) if ids else (),
            generated_ids=tuple(ids),
            generated_text=reader.generated_text(),
            generated_tokens=reader.generated,
            max_new_tokens=reader.generated + rec.remaining_tokens,
            priority=rec.priority,
            preemptions=rec.preemptions,
            response_id=reader.client_id,
            created=reader.client_created,
            prompt_tokens=reader.prompt_tokens,
            cached_tokens=reader.cached_tokens,
            target=flight.target,
            reservation=flight.target_reservation,
        )

    async def _prompt_ids(self, flight: Flight, reader: Splicer) -> tuple[int, ...]:
        """The prompt as the engine tokenized it: the client's ids, the ids the engine
        reported, or (a /generate text prompt) the engine's own tokenization of it, kept
        only if it has as many tokens as the engine counted."""
        origin = self._origins[flight.rid]
        if origin.prompt_ids:
            return origin.prompt_ids
        if reader.prompt_ids:
            return tuple(reader.prompt_ids)
        text = origin.body.get("text")
        if flight.intake.api is not EngineAPI.GENERATE or not isinstance(text, str):
            return ()
        try:
            ids = await self.engine.tokenize(text)
        except EngineError as exc:
            log.info("request %s resumes from text: %s", flight.rid, exc)
            return ()
        return tuple(ids) if len(ids) == reader.prompt_tokens else ()

    def _note_tokens(self, flight: Flight, generated_here: int) -> None:
        if generated_here <= flight.generated:
            return
        state = flight.state
        if state is _S.PREFILL_RUNNING:
            self.ledger.move(flight, _S.DECODE_READY)
            state = _S.DECODE_READY
        if state is _S.DECODE_READY:
            self.ledger.move(flight, _S.DECODING)
            if not flight.first_token_mono:
                flight.first_token_mono = self.ledger.clock()
                self.metrics.observe(
                    "weir_sidecar_ttft_seconds",
                    flight.first_token_mono - flight.arrived_mono,
                    length_bucket(flight.record.prompt_tokens),
                    length_bucket(flight.record.max_new_tokens),
                )
        self.ledger.add_tokens(flight, generated_here)

    async def _stream(
        self, request: web.Request, flight: Flight, reader: Splicer
    ) -> web.StreamResponse:
        reader.incremental_text = self.info.incremental_streaming
        reader.ids_delta = self.ids_delta
        reader.asks = Asks.of(flight.intake.body)
        reader.engine_api = flight.intake.engine_api
        base = reader.offset_tokens
        response: web.StreamResponse | None = None
        out: DirectWriter | None = None
        segment = 0
        resume: Continuation | None = None
        while True:
            api, body = self._engine_body(flight, reader, segment, resume)
            path = ENGINE_PATH[api]
            if flight.record.state is _S.PREFILL_READY:
                self.ledger.move(flight, _S.PREFILL_RUNNING)
            ending, lost = Ending.BROKEN, False
            try:
                async with self.engine.open(path, body) as stream:
                    if stream.status != 200:
                        payload = await stream.body()
                        if response is None:
                            self._end(flight, _S.ABORTED, FinishReason.ERROR, "engine_refused")
                            return web.Response(
                                status=stream.status,
                                body=payload,
                                content_type="application/json",
                            )
                        lost = True
                    else:
                        if out is None:
                            out = await DirectWriter.open(
                                request,
                                {
                                    wire.REQUEST_ID: flight.rid,
                                    wire.CLIENT_REQUEST_ID: request_id_of(flight.rid),
                                },
                            )
                            response = out.response
                        watch = LedgerWatch(reader, flight, self.ledger, self._note_tokens, base)
                        ending = await Relay(reader, watch).run(stream.push, out)
            except (EngineError, MalformedEventError) as exc:
                log.warning("request %s lost its engine stream: %s", flight.rid, exc)
                lost = True
            if reader.ids_delta is not None:
                self.ids_delta = reader.ids_delta  # learnt once per engine
            finish = "deadline" if ending is Ending.DEADLINE else reader.finish
            if not finish and not lost:
                lost = True  # the stream ended without a finish: the engine went away
            if response is None:
                # Nothing reached the client yet: let the router try elsewhere.
                self._end(flight, _S.ABORTED, FinishReason.ERROR, "engine_unavailable")
                return web.Response(
                    status=503,
                    body=_error("engine_unavailable", "the engine did not answer"),
                    content_type="application/json",
                    headers={"Retry-After": "1"},
                )
            mode = flight.preempt_mode
            if finish == "deadline":
                await self._end_stream(
                    response, flight, "deadline", "the request's deadline passed"
                )
                return response
            if finish and not (finish == "abort" and mode):
                await response.write_eof(DONE_FRAME)
                self._finish(flight, finish_reason(finish))
                return response
            if lost and not mode and flight.record.migratable and flight.record.state in _RESUMABLE:
                # The router can resume it elsewhere at once: waiting here for the engine
                # to come back would stall the client's stream, perhaps for good.
                mode = "migrate"
            if lost and not mode:
                if not (flight.record.recomputable and self._resumable(flight)):
                    await self._end_stream(
                        response, flight, "engine_lost", "the engine stream broke"
                    )
                    return response
                mode = "recompute"
                if not await self._engine_back():
                    await self._end_stream(response, flight, "engine_lost", "the engine is gone")
                    return response
            self._preempted(flight, mode)
            if mode == "migrate":
                await self._hand_back(response, flight, await self.continuation(flight, reader))
                return response
            if mode == "terminate":
                await self._end_stream(response, flight, "aborted", "terminated by relief policy")
                return response
            resume = await self.continuation(flight, reader)
            reader.next_segment(resume.resume_api)
            try:
                await self.ledger.admit(flight)
            except OverloadError as exc:
                self._note_admission(flight, exc)
                if flight.record.migratable:
                    # No room here in time: the router, which can place it elsewhere (or
                    # here again later), takes it back rather than the client losing it.
                    await self._hand_back(response, flight, resume)
                else:
                    message = f"could not resume: {exc}"
                    await self._end_stream(response, flight, "overload", message)
                return response
            finally:
                flight.offloaded = 0  # resumed or ended: its host pages are claimed no more
            self._note_admission(flight)
            if mode == "offload":
                self.host_prefixes.loaded(flight.prefix_block)
            self.metrics.count(
                "weir_sidecar_offloaded_tokens_total"
                if mode == "offload"
                else "weir_sidecar_recomputed_tokens_total",
                amount=flight.record.prompt_tokens + flight.record.generated_tokens,
            )
            segment += 1

    async def _hand_back(
        self, response: web.StreamResponse, flight: Flight, cont: Continuation
    ) -> None:
        """End this response with the continuation, for the router to resume elsewhere."""
        data = encode_json(cont)
        await response.write_eof(preempted_frame(data))
        self.metrics.count("weir_sidecar_transferred_bytes_total", amount=len(data))
        self._note(flight, "handed_back", continuation_bytes=len(data))
        self._end(flight, _S.FINISHED, FinishReason.PREEMPTED)

    def _too_large(self, flight: Flight) -> web.Response:
        """400 for a request whose prompt and least growth exceed what this endpoint's KV
        can ever hold (as SGLang and OpenAI answer a prompt over the context length)."""
        rec = flight.record
        capacity = self.ledger.capacity_tokens
        usable = capacity - self.policy.kv.safety_tokens(capacity)
        outlook = SequenceOutlook(rec.generated_tokens, rec.max_new_tokens, flight.predicted_total)
        needed = rec.prompt_tokens + growth_reserve(outlook, self.policy.kv.growth_horizon_steps)
        counted = (
            "" if flight.intake.prompt_ids else " (counted as its UTF-8 bytes, an upper bound)"
        )
        message = (
            f"the prompt of {rec.prompt_tokens} tokens{counted} needs {needed} tokens of KV "
            f"with the output growth admission reserves; this endpoint's KV cache can hold "
            f"at most {usable} (of {capacity}): shorten the prompt"
        )
        return web.Response(
            status=400,
            body=_error("invalid_request", message, reason=TOO_LARGE),
            content_type="application/json",
        )

    def _resumable(self, flight: Flight) -> bool:
        return (
            flight.record.state in _RESUMABLE
            and flight.record.preemptions < self.policy.scheduling.max_preemptions_per_request
        )

    async def _engine_back(self, timeout_s: float = 30.0) -> bool:
        """Wait (polling) until the engine answers again, after its stream broke."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                await self.engine.load()
                return True
            except EngineError:
                await asyncio.sleep(0.1)
        return False

    def _preempted(self, flight: Flight, mode: str) -> None:
        self.ledger.move(flight, _S.DECODE_PREEMPTED)
        flight.preempt_mode = ""
        if mode == "offload":
            flight.offloaded = flight.record.prompt_tokens + flight.record.generated_tokens
            self.host_prefixes.offloaded(flight.prefix_block, flight.offloaded)
        self.metrics.count("weir_sidecar_preemptions_total", mode)

    async def _end_stream(
        self, response: web.StreamResponse, flight: Flight, kind: str, message: str
    ) -> None:
        """End a stream the client has already started receiving, with an error event."""
        reason = {"aborted": FinishReason.ABORTED, "deadline": FinishReason.DEADLINE}.get(
            kind, FinishReason.ERROR
        )
        if flight.record.state in COMMITTED:
            await self._abort_engine(flight)
        if not flight.record.state.is_final:
            self._end(flight, _S.ABORTED, reason, kind)
        body = error_body(kind, message, request_id=request_id_of(flight.rid))
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof(sse(body) + DONE_FRAME)

    async def _unary(self, flight: Flight) -> web.Response:
        reader = Splicer(flight.intake.api)
        self.ledger.move(flight, _S.PREFILL_RUNNING)
        api, body = self._engine_body(flight, reader, 0, None)
        async with self.engine.open(ENGINE_PATH[api], body) as stream:
            status, payload = stream.status, await stream.body()
        if status != 200:
            self._end(flight, _S.ABORTED, FinishReason.ERROR, "engine_refused")
            return web.Response(status=status, body=payload, content_type="application/json")
        finish = reader.take_answer(payload)
        if reader.engine_prompt_tokens:
            self.ledger.set_prompt_tokens(flight, reader.engine_prompt_tokens)
        self._note_tokens(flight, reader.generated)
        self._finish(flight, finish_reason(finish))
        return web.Response(
            body=payload,
            content_type="application/json",
            headers={wire.REQUEST_ID: flight.rid},
        )

    # -- endings -------------------------------------------------------------------------

    def _finish(self, flight: Flight, reason: FinishReason) -> None:
        rec = flight.record
        now = self.ledger.clock()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            error = self.ledger.finished_naturally(flight)
            self.metrics.observe("weir_sidecar_output_length_prediction_error_tokens", error)
            buckets = (length_bucket(rec.prompt_tokens), length_bucket(rec.max_new_tokens))
            self.metrics.observe("weir_sidecar_e2e_seconds", now - flight.arrived_mono, *buckets)
            if rec.generated_tokens > 1 and flight.first_token_mono:
                tpot = (now - flight.first_token_mono) / (rec.generated_tokens - 1)
                self.metrics.observe("weir_sidecar_tpot_seconds", tpot, *buckets)
                self.ledger.observe_tpot(tpot)
            self._end(flight, _S.FINISHED, reason)
        else:
            self._end(flight, _S.ABORTED, reason)

    def _end(
        self, flight: Flight, state: RequestState, reason: FinishReason, why: str = ""
    ) -> None:
        if flight.record.state.is_final:
            return
        self.ledger.move(flight, state, reason)
        rec = flight.record
        self._note(
            flight, "end", state=state.value, reason=reason.value, why=why,
            prompt_tokens=rec.prompt_tokens, generated_tokens=rec.generated_tokens,
            preemptions=rec.preemptions,
        )  # fmt: skip
        if state is _S.REJECTED:
            self.metrics.count("weir_sidecar_admission_rejections_total", why or reason.value)
        else:
            self.metrics.sequence_ended(flight.record.priority, flight.record.tenant)
        self.metrics.count("weir_sidecar_requests_finished_total", reason.value)
        self._release_quota(flight)

    def _note(self, flight: Flight, event: str, **fields: Any) -> None:
        self.trail.record(request_id_of(flight.rid), event, rid=flight.rid, **fields)

    def _note_admission(self, flight: Flight, refused: OverloadError | None = None) -> None:
        """The admission verdict and its arithmetic (tokens needed against available)."""
        decision = flight.admission
        fields: dict[str, Any] = {
            "since_arrival_s": round(self.ledger.clock() - flight.arrived_mono, 6)
        }
        if decision is not None:
            fields.update(
                first_verdict=decision.verdict.value, first_reason=decision.reason,
                needed_tokens=decision.needed_tokens, available_tokens=decision.available_tokens,
            )  # fmt: skip
        if refused is None:
            self._note(flight, "admitted", **fields)
        else:
            self._note(flight, "refused", reason=refused.reason, message=str(refused), **fields)

    def _release_quota(self, flight: Flight) -> None:
        if self.quota is not None and self.quota.holds(flight):
            self._spawn(self.quota.release(flight))

    async def settled(self) -> None:
        """Wait for the background work requests left behind (quota releases, aborts)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run `coro` in the background, tracked so that `settled()` can wait for it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _abort_engine(self, flight: Flight) -> None:
        if not flight.engine_rid:
            return
        try:
            await self.engine.abort(flight.engine_rid)
        except EngineError as exc:
            log.warning("abort of %s failed: %s", flight.engine_rid, exc)

    async def _cancel(self, flight: Flight) -> None:
        """The client went away: abort in the engine at once and release everything."""
        if flight.record.state.is_final:
            return
        flight.cancelled_mono = self.ledger.clock()
        held = flight.record.state in COMMITTED
        if held:
            await self._abort_engine(flight)
        self._end(flight, _S.CANCELLED, FinishReason.CANCELLED)
        if held:
            freed_ms = (self.ledger.clock() - flight.cancelled_mono) * 1000.0
            self.metrics.observe("weir_sidecar_cancel_to_freed_ms", freed_ms)

    # -- actions -------------------------------------------------------------------------

    def begin_preempt(self, rid: str, mode: str, why: str) -> Flight | None:
        """Mark a decoding request for preemption (recompute, offload, migrate or
        terminate) for the reason `why` (recorded); the engine abort follows. None when it
        is not decoding, already being preempted, over its preemption cap, or the mode is
        not allowed for it."""
        flight = self.ledger.flights.get(rid)
        if flight is None or flight.preempt_mode or flight.record.state is not _S.DECODING:
            return None
        rec = flight.record
        if mode == "migrate" and not rec.migratable:
            return None
        if mode == "recompute" and not (rec.recomputable and self._may_recompute):
            return None
        if mode == "offload" and not (rec.recomputable and self._may_offload):
            return None
        if mode != "terminate" and not self._resumable(flight):
            return None
        flight.preempt_mode = mode
        self._note(flight, "preempt", mode=mode, why=why, generated_tokens=rec.generated_tokens)
        return flight

    async def preempt(self, rid: str, mode: str, why: str) -> bool:
        flight = self.begin_preempt(rid, mode, why)
        if flight is None:
            return False
        await self._abort_engine(flight)
        return True

    async def execute(self, command: Command) -> bool:
        """Carry out a control-plane command; False when it did not apply."""
        kind = command.kind
        if kind is CommandKind.DRAIN:
            self._spawn(self.drain(command.deadline_s or 30.0))
            return True
        if kind in (CommandKind.PAUSE_ADMISSION, CommandKind.RESUME_ADMISSION):
            self.ledger.set_admission(kind is CommandKind.RESUME_ADMISSION)
            return True
        if kind is CommandKind.PREEMPT_REQUEST:
            return await self._preempt_best(command.request_id)
        if kind is CommandKind.PREEMPT_TENANT:
            rids = [r for r, f in self.ledger.flights.items() if f.record.tenant == command.tenant]
            done = [await self._preempt_best(rid) for rid in rids]
            return any(done)
        if kind is CommandKind.SET_PRIORITY:
            flight = self.ledger.flights.get(command.request_id)
            if flight is None:
                return False
            flight.record = replace(flight.record, priority=command.priority)
            return True
        return False  # type: ignore[unreachable]  # a newer contract's command kind

    async def _preempt_best(self, rid: str) -> bool:
        """Migrate when the request can move, else recompute in place."""
        why = "ordered by the control plane"
        return await self.preempt(rid, "migrate", why) or await self.preempt(rid, "recompute", why)

    async def relieve(
        self, peers: Sequence[EndpointState] = (), reserve: Reserve | None = None
    ) -> list[str]:
        """One pass of the relief ladder; starts preemptions and returns explanations.
        `peers`: the other endpoints a continuation may migrate to (lease valid, same
        role), as last published; `reserve` asks one to hold room. Without them (no
        control plane) nothing migrates. A migrating victim is aborted only once its
        target holds room for it; when none does, it takes its fallback."""
        ledger = self.ledger
        rooms = peer_rooms(peers, self.policy.kv) if reserve is not None else {}
        plan = plan_relief(
            ledger.usage(), ledger.watermark, ledger.candidates(), self.policy, ledger.clock(),
            rooms, self.relief_costs(),
        )  # fmt: skip
        notes = []
        chosen = {victim.rid for victim in plan.victims}
        passed_over = [
            f"{rid}: {score.explain()}" for rid, score in plan.ranked if rid not in chosen
        ]
        targets = TargetRooms(rooms)
        by_id = {peer.endpoint_id: peer for peer in peers}
        for victim in plan.victims:
            mode: Rung | None = victim.mode
            why = (
                f"relief at {plan.watermark} needs {plan.needed_tokens} tokens; "
                f"{victim.score.explain()}; over {len(passed_over)} other(s): "
                + ("; ".join(passed_over[:3]) or "none")
            )
            held: tuple[str, str] | None = None
            if mode is Rung.MIGRATE:
                assert reserve is not None  # no rooms, no migration
                held = await self._reserve_target(victim, targets, by_id, reserve)
                if held is None:
                    mode = victim.fallback
                    why += f"; no peer held {victim.tokens} tokens for it"
                else:
                    why += f"; {held[0]} holds {victim.tokens} tokens for it ({held[1]})"
            if mode is None:
                notes.append(f"{victim.rid} left running: {why}")
                continue
            notes.append(f"{victim.rid} → {mode.value}: {victim.score.explain()}")
            flight = self.begin_preempt(victim.rid, mode.value, why)
            if flight is not None:
                flight.target, flight.target_reservation = held or ("", "")
                self._spawn(self._abort_engine(flight))
        for note in notes:
            log.info("relief (%s, needs %d tokens): %s", plan.watermark, plan.needed_tokens, note)
        return notes

    async def _reserve_target(
        self,
        victim: VictimChoice,
        targets: TargetRooms,
        peers: dict[str, EndpointState],
        reserve: Reserve,
    ) -> tuple[str, str] | None:
        """(target, reservation id) of the first peer, in `targets`' order, that holds
        room for the victim's continuation; None when none does."""
        asked = RoomReservation(
            request_id=request_id_of(victim.rid), tokens=victim.tokens, ttl_s=RESERVATION_TTL_S
        )
        while (target := targets.pick(victim.tokens)) is not None:
            granted, room = await reserve(peers[target], asked)
            targets.answered(target, victim.tokens, granted is not None, room)
            if granted is not None:
                return target, granted.reservation_id
        return None

    def observe_host_bandwidth(self, bytes_per_s: float) -> None:
        """The engine's measured device-host bandwidth replaces the default (0: it has
        timed no copy yet)."""
        if bytes_per_s > 0 and self.host_tier_tokens:
            self.costs = replace(self.costs, host_bytes_per_s=bytes_per_s)

    def relief_costs(self) -> ReliefCosts:
        """The costs relief weighs, with the host room offloads may still claim: the host
        pool less what offloaded requests not yet resumed left there."""
        held = sum(f.offloaded for f in self.ledger.flights.values())
        room = max(0, self.host_tier_tokens - held) if self._may_offload else 0
        return replace(self.costs, host_room_tokens=room)

    async def drain(self, deadline_s: float) -> dict[str, int]:
        """Stop admitting; let in-flight requests finish until the deadline, then migrate
        those that can move and abort the rest. Returns how many ended which way."""
        self.draining = True
        self.ledger.set_admission(False)
        before = len(self.ledger.flights)  # now: some may finish while on_drain runs
        if self.on_drain is not None:
            await self.on_drain()
        await self.ledger.wait_idle(deadline_s)
        migrated = aborted = 0
        for rid, flight in list(self.ledger.flights.items()):
            if flight.record.migratable and await self.preempt(rid, "migrate", "drain"):
                migrated += 1
            elif await self.preempt(rid, "terminate", "drain deadline"):
                aborted += 1
            else:
                await self._abort_engine(flight)
                aborted += 1
        await self.ledger.wait_idle(10.0)
        return {
            "in_flight": before,
            "finished": before - migrated - aborted,
            "migrated": migrated,
            "aborted": aborted,
        }


def _decode_continuation(raw: bytes) -> Continuation:
    return decode_json(raw, Continuation)


def _decode_reservation(raw: bytes) -> RoomReservation:
    return decode_json(raw, RoomReservation)


def _parse_json_or_empty(raw: bytes) -> dict[str, Any]:
    return parse_json(raw or b"{}")


def _prefix_block(header: str | None) -> int:
    """The router's key of the prompt (16 hex digits; 0: none sent)."""
    if header is None:
        return 0
    if not _HEX16.fullmatch(header):
        raise RequestError(f"{wire.PREFIX_BLOCK} must be 16 hex digits, got {header!r}")
    return int(header, 16)


def _deadline(header: str | None) -> float:
    """The relative deadline, in seconds, a router passes in milliseconds (0: none)."""
    if header is None:
        return 0.0
    try:
        value = float(header)
    except ValueError:
        raise RequestError(
            f"{wire.DEADLINE_MS} must be a number of milliseconds, got {header!r}"
        ) from None
    if not 0.0 < value <= 86_400_000.0:
        raise RequestError(f"{wire.DEADLINE_MS} must be in (0, 86400000], got {header!r}")
    return value / 1000.0
