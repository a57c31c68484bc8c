"""Each request's way through the engine: the sidecar's per-request state machine.

A request is admitted (its tenant's KV quota, then the ledger's admission), then served
in segments: each segment one engine request (rid `<sidecar rid>sNNN`), streamed to the
client through one `Relay`. A segment that ends without a finish was preempted (an
action ordered it: `engine_sidecar.actions`) or lost its engine: the request then
resumes in place in a new segment (recompute or offload, once admission allows), is handed
back to the router as a `weir.preempted` continuation (migrate), or ends. Every ending
settles the ledger, the quota, the metrics and the request's trail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from controlplane.contract import Continuation, EngineAPI, FinishReason, Role, encode_json
from controlplane.contract import headers as wire
from controlplane.contract.vocabulary import DONE_FRAME, error_body, preempted_frame, sse
from controlplane.stream import Asks, MalformedEventError, Splicer, ask_for_counts, finish_reason
from controlplane.stream.relay import Ending, Relay
from controlplane.telemetry.catalog import length_bucket
from controlplane.trace.middleware import REQUEST_ID
from controlplane.trace.trail import carried_request_id, request_id_of, sidecar_rid
from controlplane.transport.event_stream import DirectWriter
from engine_sidecar.engine import EngineError
from engine_sidecar.errors import TOO_LARGE, bad_request, error_json, overload_response
from engine_sidecar.forward import LedgerWatch
from engine_sidecar.intake import ENGINE_PATH, Intake, RequestError
from engine_sidecar.ledger import COMMITTED, Flight, OverloadError, Preemption
from engine_sidecar.policy import (
    RequestRecord,
    RequestState,
    engine_priority,
)

if TYPE_CHECKING:
    from engine_sidecar.service import SidecarService

log = logging.getLogger("weir.sidecar")
_S = RequestState
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_RESUMABLE = frozenset({_S.DECODING, _S.DECODE_READY})
_PREDICTION_ERROR = "weir_sidecar_latency_prediction_error_ratio"


@dataclass
class Origin:
    """How the request first entered Weir, for building its continuation."""

    body: dict[str, Any]
    prompt_ids: tuple[int, ...]


class Segments:
    """The sidecar's requests in flight, each served segment by segment; and the
    background work they leave behind (quota releases, aborts)."""

    def __init__(self, service: SidecarService) -> None:
        self._service = service  # what changes while it runs: quota, draining
        self.engine = service.engine
        self.info = service.info
        self.policy = service.policy
        self.ledger = service.ledger
        self.metrics = service.metrics
        self.trail = service.trail
        self._origins: dict[str, Origin] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Whether the engine's /generate streams carry each event's ids only (SGLang
        # 0.5.5) or all so far (0.5.23): learnt from the first stream that shows it.
        self.ids_delta: bool | None = None

    async def serve(
        self,
        request: web.Request,
        intake: Intake,
        origin: Origin,
        reader: Splicer | None = None,
        preemptions: int = 0,
        client_rid: str = "",
        *,
        resumed: bool = False,
        reservation: str = "",
    ) -> web.StreamResponse:
        tenant = request.headers.get(wire.TENANT, "default")
        if not _TENANT.match(tenant):
            return bad_request(
                RequestError(f"{wire.TENANT} must be a short name ([A-Za-z0-9_.:-])")
            )
        try:
            deadline_s = _deadline(request.headers.get(wire.DEADLINE_MS))
            prefix_block = _prefix_block(request.headers.get(wire.PREFIX_BLOCK))
        except RequestError as exc:
            return bad_request(exc)
        if self._service.draining:
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
            and (self._service.may_recompute or self._service.may_offload),
            migratable=streamed
            and self._service.may_migrate
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
            if self._service.quota is not None:
                retry_after = await self._service.quota.charge(flight)
                if retry_after is not None:
                    self._end(flight, _S.REJECTED, FinishReason.OVERLOAD, "tenant_kv_quota")
                    return overload_response(
                        "tenant_kv_quota", retry_after, f"tenant {tenant} is out of KV quota"
                    )
            if resumed:
                self.note(flight, "continuation", offset_tokens=record.prompt_tokens)
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
            await asyncio.shield(self.spawn(self._cancel(flight)))
            raise
        except Exception:
            log.exception("request %s failed", record.rid)
            if flight.record.state is _S.WAITING_ADMISSION:
                # Failed before admission (the quota's charge, say): the engine never saw it.
                self._end(flight, _S.REJECTED, FinishReason.ERROR, "internal_error")
            elif not flight.record.state.is_final:
                await asyncio.shield(self.spawn(self._abort_and_end(flight)))
            raise
        finally:
            self._origins.pop(record.rid, None)

    async def _abort_and_end(self, flight: Flight) -> None:
        await self.abort_engine(flight)
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

    async def _continuation(self, flight: Flight, reader: Splicer) -> Continuation:
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

    def _note_tokens(self, flight: Flight, generated_here: int, cached_tokens: int) -> None:
        """`cached_tokens`: the prompt tokens the engine reported served from its cache."""
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
                error = self.ledger.first_token_latency(flight, cached_tokens)
                if error is not None:
                    self.metrics.observe(_PREDICTION_ERROR, error, "ttft")
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
                    body=error_json("engine_unavailable", "the engine did not answer"),
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
                mode = Preemption.MIGRATE
            if mode is None:  # so lost: no preemption was ordered, the engine went away
                if not (flight.record.recomputable and self.resumable(flight)):
                    await self._end_stream(
                        response, flight, "engine_lost", "the engine stream broke"
                    )
                    return response
                mode = Preemption.RECOMPUTE
                if not await self._engine_back():
                    await self._end_stream(response, flight, "engine_lost", "the engine is gone")
                    return response
            self._preempted(flight, mode)
            if mode is Preemption.MIGRATE:
                await self._hand_back(response, flight, await self._continuation(flight, reader))
                return response
            if mode is Preemption.TERMINATE:
                await self._end_stream(response, flight, "aborted", "terminated by relief policy")
                return response
            resume = await self._continuation(flight, reader)
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
            if mode is Preemption.OFFLOAD:
                self._service.host_prefixes.loaded(flight.prefix_block)
            self.metrics.count(
                "weir_sidecar_offloaded_tokens_total"
                if mode is Preemption.OFFLOAD
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
        self.note(flight, "handed_back", continuation_bytes=len(data))
        self._end(flight, _S.FINISHED, FinishReason.PREEMPTED)

    def _too_large(self, flight: Flight) -> web.Response:
        """400 for a request whose prompt and output limit exceed what this endpoint's KV
        can ever hold, even alone (as SGLang and OpenAI answer a prompt over the context
        length)."""
        rec = flight.record
        assert flight.admission is not None  # the decision that refused it
        counted = (
            "" if flight.intake.prompt_ids else " (counted as its UTF-8 bytes, an upper bound)"
        )
        message = (
            f"the prompt of {rec.prompt_tokens} tokens{counted} and up to "
            f"{rec.max_new_tokens} output tokens need {flight.admission.needed_tokens} tokens "
            f"of KV; this endpoint's KV cache holds {self.ledger.capacity_tokens}: shorten "
            f"the prompt or lower max_tokens"
        )
        return web.Response(
            status=400,
            body=error_json("invalid_request", message, reason=TOO_LARGE),
            content_type="application/json",
        )

    def resumable(self, flight: Flight) -> bool:
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

    def _preempted(self, flight: Flight, mode: Preemption) -> None:
        self.ledger.move(flight, _S.DECODE_PREEMPTED)
        flight.preempt_mode = None
        if mode is Preemption.OFFLOAD:
            flight.offloaded = flight.record.prompt_tokens + flight.record.generated_tokens
            self._service.host_prefixes.offloaded(flight.prefix_block, flight.offloaded)
        self.metrics.count("weir_sidecar_preemptions_total", mode)

    async def _end_stream(
        self, response: web.StreamResponse, flight: Flight, kind: str, message: str
    ) -> None:
        """End a stream the client has already started receiving, with an error event."""
        reason = {"aborted": FinishReason.ABORTED, "deadline": FinishReason.DEADLINE}.get(
            kind, FinishReason.ERROR
        )
        if flight.record.state in COMMITTED:
            await self.abort_engine(flight)
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
        self._note_tokens(flight, reader.generated, reader.cached_tokens or 0)
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
            latency = self.ledger.finished_latency(flight, now)
            if latency is not None:
                self.metrics.observe(_PREDICTION_ERROR, latency, "tpot")
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
        self.note(
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

    def note(self, flight: Flight, event: str, **fields: Any) -> None:
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
            self.note(flight, "admitted", **fields)
        else:
            self.note(flight, "refused", reason=refused.reason, message=str(refused), **fields)

    def _release_quota(self, flight: Flight) -> None:
        if self._service.quota is not None and self._service.quota.holds(flight):
            self.spawn(self._service.quota.release(flight))

    async def settled(self) -> None:
        """Wait for the background work requests left behind (quota releases, aborts)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run `coro` in the background, tracked so that `settled()` can wait for it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def abort_engine(self, flight: Flight) -> None:
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
            await self.abort_engine(flight)
        self._end(flight, _S.CANCELLED, FinishReason.CANCELLED)
        if held:
            freed_ms = (self.ledger.clock() - flight.cancelled_mono) * 1000.0
            self.metrics.observe("weir_sidecar_cancel_to_freed_ms", freed_ms)


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
