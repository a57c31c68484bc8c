"""The HTTP surface of SGLang 0.5.5 and 0.5.23 over the engine model.

Answers have the shapes SGLang's own server gives them (sglang/srt/entrypoints/
http_server.py; meta_info from srt/managers/tokenizer_manager.py; OpenAI chunks from
srt/entrypoints/openai/serving_chat.py and serving_completions.py), as
tests/sglang/test_reference_fidelity.py checks against a real server of each version;
docs/reference-engine.md lists what is deliberately different.

Between the two surfaces: 0.5.23 adds `/server_info`, `/model_info`, `/ready` and
`/v1/loads` (which replaces `/get_load`), takes pause modes in a required JSON body (an
empty body is refused with 400 and changes nothing), labels metrics by `is_streaming` and
`moe_ep_rank` and adds the `sglang:kv_*` gauges; 0.5.5 ignores any pause body (it aborts
everything), streams `/generate`'s output_ids per chunk rather than cumulatively, and
calls the retraction count `total_retractions`.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from controlplane.transport.event_stream import EventStreamResponse
from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, EngineRequestError, decode
from fleetsim.server.disaggregation import DecodeSide, PrefillSide, handoff_side
from fleetsim.server.driver import EngineDriver, Stream
from fleetsim.server.metrics import EngineMetrics, exposition
from fleetsim.server.protocol import (
    BadRequestError,
    Bootstrap,
    GenerateSpec,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json,
)

API_VERSIONS = ("0.5.5", "0.5.23")
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
_DONE = b"data: [DONE]\n\n"
_HEALTH_POLL_S = 1.0  # SGLang's /health checks for output once a second
# 0.5.5 sends a non-streaming request's output every this many tokens, and times its first
# token only from such an intermediate output (scheduler_output_processor_mixin.py).
_FORCE_STREAM_INTERVAL = 50
_WEIGHT_VERSION = "default"
# Priorities an unprioritised request gets under priority scheduling: last in line.
_LAST_PRIORITY = {True: 2**63 - 1, False: -(2**63)}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Chunks = Callable[[Stream, bool], list[object]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def _sse(data: object) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _native_error(message: str, status: int = 400) -> web.Response:
    """A /generate handler's ValueError."""
    return _json({"error": {"message": message}}, status)


def _openai_error(message: str, status: int = 400) -> web.Response:
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    return _json(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status,
    )


def _schema_error(message: str) -> web.Response:
    """What SGLang's FastAPI layer answers a body it cannot validate (any endpoint)."""
    return _json(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        400,
    )


def _http_error(message: str, status: int) -> web.Response:
    """An HTTPException: how SGLang ends a unary request its scheduler aborted with a
    status (a full queue's 503, say)."""
    return _json(
        {"object": "error", "message": message, "type": str(status), "param": None,
         "code": status},
        status,
    )  # fmt: skip


@web.middleware
async def _json_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and methods answer as FastAPI does: {"detail": "Not Found"}."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405):
            raise
        return _json({"detail": exc.reason}, exc.status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise BadRequestError(
            "Input should be a dictionary: only 'application/json' is allowed.", schema=True
        )
    return parse_json(await request.read())


class EngineServer:
    """Routes and handlers; the step loop lives in `EngineDriver`."""

    def __init__(
        self, model: EngineModel, driver: EngineDriver, metrics: EngineMetrics, api_version: str
    ) -> None:
        if api_version not in API_VERSIONS:
            raise ValueError(f"api_version must be one of {API_VERSIONS}, got {api_version!r}")
        self.model = model
        self.config: EngineConfig = model.config
        self.driver = driver
        self.metrics = metrics
        self.api_version = api_version
        self.host = ""
        self.port = 0
        self.health_timeout_s = 20.0
        self.started = time.time()
        self._clock_offset = time.time() - driver.now()  # the driver's clock to epoch
        # This engine's half of a P/D pair (None: a mixed engine).
        self.handoffs: PrefillSide | DecodeSide | None = handoff_side(model, driver, metrics.pd)
        self.bootstrap_port = self.config.disaggregation_bootstrap_port

    @property
    def new_api(self) -> bool:
        return self.api_version != "0.5.5"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_json_http_errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_route("*", "/get_server_info", self.server_info)
        r.add_route("*", "/get_model_info", self.model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/metrics", self.prometheus)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        if self.new_api:
            r.add_route("*", "/server_info", self.server_info)
            r.add_route("*", "/model_info", self.model_info)
            r.add_get("/ready", self.ready)
            r.add_get("/v1/loads", self.v1_loads)
        else:
            r.add_get("/get_load", self.get_load)
        if isinstance(self.handoffs, DecodeSide):
            decode = self.handoffs

            async def close_handoffs(_app: web.Application) -> None:
                await decode.close()

            app.on_cleanup.append(close_handoffs)
        return app

    def _wall(self, t: float) -> float:
        return t + self._clock_offset

    # -- shared request path ------------------------------------------------------------
    def _peer(self, spec: GenerateSpec) -> Bootstrap | None:
        """The request's P/D peer, when it is half of a handoff here. A P/D engine serves a
        request without one only with SGLang's fake bootstrap host or transfer backend."""
        cfg = self.config
        peer = spec.bootstrap
        if self.handoffs is None or cfg.disaggregation_transfer_backend == "fake":
            return None
        if peer is None:
            raise EngineRequestError(
                f"This is a P/D {cfg.disaggregation_mode} server: a request needs "
                "bootstrap_host, bootstrap_port and bootstrap_room."
            )
        if peer.fake:
            return None
        if isinstance(self.handoffs, PrefillSide) and self.handoffs.taken(peer.room):
            raise EngineRequestError(f"bootstrap_room {peer.room} is already in use.")
        return peer

    def _submit(self, spec: GenerateSpec, req: EngineRequest, streaming: bool) -> Stream:
        """Queue the request, or its half of a handoff (`spec.bootstrap`, which `_request`
        kept only when this engine serves it as one)."""
        peer = spec.bootstrap
        if self.handoffs is None or peer is None:
            return self.driver.submit(req, streaming)
        return self.handoffs.submit(peer, req, streaming)

    def _request(self, spec: GenerateSpec) -> EngineRequest:
        """The engine's request for a parsed body (EngineRequestError when it refuses it). A
        prefill engine's half of a handoff asks for the first token only."""
        if spec.rid in self.model.requests or any(s.req.rid == spec.rid for s in self.driver.held):
            raise EngineRequestError(f"Duplicate request ID detected: {spec.rid}")
        spec.bootstrap = self._peer(spec)
        exported = isinstance(self.handoffs, PrefillSide) and spec.bootstrap is not None
        cfg = self.config
        if not cfg.enable_priority_scheduling:
            priority = 0
        elif spec.priority is None:
            priority = _LAST_PRIORITY[cfg.schedule_low_priority_values_first]
        else:
            priority = spec.priority
        return self.model.make_request(
            spec.rid,
            spec.input_ids,
            1 if exported else spec.max_new_tokens,
            ignore_eos=spec.ignore_eos,
            min_new_tokens=spec.min_new_tokens,
            stop=spec.stop,
            stop_token_ids=spec.stop_token_ids,
            priority=priority,
            cache_salt=spec.cache_salt,
            now=self.driver.now(),
        )

    async def _follow(self, stream: Stream) -> AsyncIterator[bool]:
        """Yield whenever the request has new published tokens or finished (True on the
        last); abort it if the client goes away first."""
        try:
            while True:
                if not stream.finished:
                    await stream.wait()
                last = stream.finished
                if last or stream.shown > stream.sent:
                    yield last
                if last:
                    return
        finally:
            if not stream.finished:
                self.driver.cancel(stream.req)

    async def _stream(
        self,
        request: web.Request,
        spec: GenerateSpec,
        req: EngineRequest,
        chunks: Chunks,
        *,
        native: bool,
    ) -> web.StreamResponse:
        # SGLang's /generate sends its headers at once, before the request is scheduled
        # (0.5.5 and 0.5.23: 200 within 0.03 s, the first event after the queue,
        # tests/sglang/test_reference_fidelity.py); so does a decode half while its KV
        # is on its way. An OpenAI stream's headers leave with its first event.
        at_once = native or (isinstance(self.handoffs, DecodeSide) and spec.bootstrap is not None)
        kind = web.StreamResponse if at_once else EventStreamResponse
        response = kind(headers=_SSE_HEADERS)
        await response.prepare(request)
        # Queued only now, with nothing left to wait for before following it: the first
        # token cannot be published before this handler listens.
        stream = self._submit(spec, req, streaming=True)
        try:
            async for last in self._follow(stream):
                for chunk in chunks(stream, last):
                    await response.write(_sse(chunk))
            await response.write(_DONE)
        except ConnectionResetError:
            self.driver.cancel(stream.req)
        return response

    async def _sse_error(self, request: web.Request, message: str) -> web.StreamResponse:
        """A /generate stream's ValueError: HTTP 200, one error event, then [DONE]."""
        error: dict[str, object] = {"message": message}
        if self.new_api:
            error.update(type="invalid_request_error", code=400, retryable=False)
        response = EventStreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        await response.write(_sse({"error": error}) + _DONE)
        return response

    async def _complete(self, stream: Stream) -> None:
        async for _ in self._follow(stream):
            stream.sent = stream.shown

    @staticmethod
    def _aborted_with_status(req: EngineRequest) -> tuple[str, int] | None:
        """An abort the scheduler gave a status (a full queue, no memory): a unary request
        then answers with that status instead of a body."""
        finish = req.finish
        if finish is None or finish.kind != "abort" or finish.status_code is None:
            return None
        return finish.message, finish.status_code

    # -- /generate ----------------------------------------------------------------------
    def _meta(self, stream: Stream, first: bool) -> dict[str, object]:
        """meta_info as SGLang's tokenizer manager builds it for this chunk: the timing
        keys only with --enable-metrics, the end-of-request ones on the last chunk."""
        req, done = stream.req, stream.finished
        meta: dict[str, object] = {
            "id": req.rid,
            "finish_reason": req.finish.to_json() if done and req.finish else None,
            "prompt_tokens": req.prompt_tokens,
            "weight_version": _WEIGHT_VERSION,
        }
        if self.new_api:
            self._meta_0523(meta, stream, first)
        else:
            self._meta_055(meta, stream, first)
        return meta

    def _meta_0523(self, meta: dict[str, object], stream: Stream, first: bool) -> None:
        req, done, n, wall = stream.req, stream.finished, stream.shown, self._wall
        metrics = self.config.enable_metrics
        meta["num_retractions"] = req.retractions
        if metrics:
            meta.update(storage_prefetch_wait=0.0, storage_staging_wait=0.0)
            if req.admitted_at >= 0:
                meta["forward_entry_time"] = wall(req.admitted_at)
            if req.first_token_at >= 0:
                meta["prefill_finished_time"] = wall(req.first_token_at)
            admitted = req.admitted_at if req.admitted_at >= 0 else req.finished_at
            meta["queue_time"] = max(0.0, admitted - req.arrival)
        meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=req.cached_tokens)
        if done:
            meta["weight_versions"] = [{"version": _WEIGHT_VERSION, "start": 0, "end": n}]
        cached = req.cached_tokens
        meta["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
        meta["dp_rank"] = None
        if first or done:
            meta["response_sent_to_client_ts"] = wall(self._sent_at(stream))
        if not done:
            return
        meta["e2e_latency"] = max(0.0, req.finished_at - req.arrival)
        if metrics:
            meta["request_received_ts"] = wall(req.arrival)
            if req.first_token_at > req.arrival:
                meta["first_token_latency"] = req.first_token_at - req.arrival
            meta["api_server_dispatch_finish_ts"] = wall(req.arrival)
            meta["request_finished_ts"] = wall(req.finished_at)
            decoding = req.finished_at - req.first_token_at
            if n > 1 and req.first_token_at >= 0 and decoding > 0:
                meta["decode_throughput"] = (n - 1) / decoding

    def _meta_055(self, meta: dict[str, object], stream: Stream, first: bool) -> None:
        req, done, n, wall = stream.req, stream.finished, stream.shown, self._wall
        meta["total_retractions"] = req.retractions
        admitted = req.admitted_at if req.admitted_at >= 0 else req.finished_at
        first_token = req.first_token_at if req.first_token_at >= 0 else req.finished_at
        meta.update(
            queue_time=max(0.0, admitted - req.arrival),
            prefill_delay=max(0.0, admitted - req.arrival),
            prefill_latency=max(0.0, first_token - admitted),
            completion_tokens=n,
            cached_tokens=req.cached_tokens,
        )
        if first and not done:
            meta["response_sent_ts"] = wall(self._sent_at(stream))
        if not done:
            return
        meta.update(
            e2e_latency=max(0.0, req.finished_at - req.arrival),
            request_received_ts=wall(req.arrival),
            request_scheduled_ts=wall(admitted),
        )
        # Its tokenizer times the first token from an output before the last one.
        timed = n > 1 if stream.streaming else n > _FORCE_STREAM_INTERVAL
        if timed:
            meta["prefill_finished_ts"] = wall(first_token)
        meta["response_sent_ts"] = wall(self._sent_at(stream))
        meta["decode_finished_ts"] = wall(req.finished_at)
        meta["forward_time"] = max(0.0, req.finished_at - admitted)
        decoding = req.finished_at - first_token
        if timed and decoding > 0:
            meta["decode_throughput"] = n / decoding
            meta["time_per_token"] = decoding / n

    def _sent_at(self, stream: Stream) -> float:
        if stream.first_sent_at < 0:
            stream.first_sent_at = self.driver.now()
        return stream.first_sent_at

    def _native_body(self, stream: Stream) -> dict[str, object]:
        req = stream.req
        return {
            "text": req.output_text(),
            "output_ids": list(req.output_ids),
            "meta_info": self._meta(stream, first=False),
        }

    def _native_chunk(self, stream: Stream, last: bool) -> list[object]:
        """Cumulative text; output_ids cumulative on 0.5.23, on 0.5.5 only those of the
        latest step: its tokenizer manager keeps each step's new ids in a list and a
        stream reads only the list's last entry, so when steps coalesce (a client slower
        than the engine) the ids of all but the last are lost, as there. With
        --incremental-streaming-output (0.5.23) only the new text and ids."""
        req, shown = stream.req, stream.shown
        first = stream.first_sent_at < 0
        if self.new_api and self.config.incremental_streaming_output:
            ids, text = stream.delta(last)
            if not (ids or text or last):
                return []
        else:
            text = req.output_text() if last else decode(req.output_ids[:shown])
            ids = req.output_ids[0 if self.new_api else max(stream.sent, stream.step_from) : shown]
            stream.sent = shown
        return [{"text": text, "output_ids": ids, "meta_info": self._meta(stream, first)}]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(request)
        except BadRequestError as exc:
            return _schema_error(str(exc))
        streaming = body.get("stream") is True
        try:
            spec = parse_generate(body)
            req = self._request(spec)
        except BadRequestError as exc:
            if exc.schema:
                return _schema_error(str(exc))
            message = str(exc)
        except EngineRequestError as exc:
            message = str(exc)
        else:
            if spec.stream:
                return await self._stream(request, spec, req, self._native_chunk, native=True)
            stream = self._submit(spec, req, streaming=False)
            await self._complete(stream)
            refused = self._aborted_with_status(stream.req)
            if refused is not None:
                message, status = refused
                return _native_error(message) if status == 400 else _http_error(message, status)
            return _json(self._native_body(stream))
        if streaming:
            return await self._sse_error(request, message)
        return _native_error(message)

    # -- OpenAI ------------------------------------------------------------------------
    def _usage(self, req: EngineRequest, chat: bool, streamed: bool) -> dict[str, object]:
        usage: dict[str, object] = {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "completion_tokens": req.completion_tokens,
        }
        if chat or not streamed:
            # Cached tokens are reported only with --enable-cache-report.
            usage["prompt_tokens_details"] = None
        usage["reasoning_tokens"] = 0
        if self.new_api and (chat or not streamed):
            usage["completion_tokens_details"] = None
        return usage

    @staticmethod
    def _finish_reason(req: EngineRequest) -> tuple[str | None, object]:
        if req.finish is None:
            return None, None
        matched = req.finish.matched if req.finish.kind == "stop" else None
        return req.finish.openai, matched

    def _delta(self, content: str | None, role: bool = False) -> dict[str, object]:
        """A chat chunk's delta: 0.5.23 leaves out what it does not carry, 0.5.5 sends
        every field."""
        if self.new_api:
            delta: dict[str, object] = {"reasoning_content": None}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            return delta
        return {
            "role": "assistant" if role else None,
            "content": content,
            "reasoning_content": None,
            "tool_calls": None,
        }

    def _openai_chunks(self, spec: GenerateSpec, chat: bool) -> Chunks:
        created = int(time.time())
        model = spec.model or self.config.model
        obj = "chat.completion.chunk" if chat else "text_completion"
        role_sent = False

        def chunk(req: EngineRequest, body: object, finish: tuple[str | None, object]) -> object:
            """One choice's chunk: `body` is its delta (chat) or text (completions)."""
            reason, matched = finish
            choice = {
                "index": 0,
                "delta" if chat else "text": body,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            out: dict[str, object] = {
                "id": req.rid, "object": obj, "created": created, "model": model,
                "choices": [choice],
            }  # fmt: skip
            if spec.include_usage and spec.continuous_usage:
                out["usage"] = self._usage(req, chat, streamed=True)
            elif not (chat and self.new_api):
                out["usage"] = None
            return out

        def chunks(stream: Stream, last: bool) -> list[object]:
            nonlocal role_sent
            req = stream.req
            out: list[object] = []
            running: tuple[str | None, object] = (None, None)
            if chat and not role_sent:
                role_sent = True
                out.append(chunk(req, self._delta("", role=True), running))
            _, text = stream.delta(last)
            finish = self._finish_reason(req) if last else running
            if chat:
                if text:
                    out.append(chunk(req, self._delta(text), running))
                if last:  # the finish comes in a chunk of its own
                    out.append(chunk(req, self._delta(None), finish))
            elif text or last:
                out.append(chunk(req, text, finish))
            if last and spec.include_usage:
                usage = self._usage(req, chat, streamed=True)
                out.append(
                    {"id": req.rid, "object": obj, "created": created, "model": model,
                     "choices": [], "usage": usage}
                )  # fmt: skip
            return out

        return chunks

    def _metadata(self, req: EngineRequest) -> dict[str, object]:
        metadata: dict[str, object] = {"weight_version": _WEIGHT_VERSION}
        if self.new_api:
            end = req.completion_tokens
            metadata["weight_versions"] = [{"version": _WEIGHT_VERSION, "start": 0, "end": end}]
        return metadata

    async def _openai(
        self,
        request: web.Request,
        parse: Callable[[dict[str, Any]], GenerateSpec],
        chat: bool,
    ) -> web.StreamResponse:
        try:
            spec = parse(await _json_body(request))
            req = self._request(spec)
        except BadRequestError as exc:
            return _schema_error(str(exc)) if exc.schema else _openai_error(str(exc))
        except EngineRequestError as exc:
            return _openai_error(str(exc))
        if spec.stream:
            chunks = self._openai_chunks(spec, chat)
            return await self._stream(request, spec, req, chunks, native=False)
        stream = self._submit(spec, req, streaming=False)
        await self._complete(stream)
        refused = self._aborted_with_status(req)
        if refused is not None:
            return _openai_error(*refused)
        reason, matched = self._finish_reason(req)
        choice: dict[str, object] = {"index": 0}
        if chat:
            message: dict[str, object] = {
                "role": "assistant", "content": req.output_text(), "reasoning_content": None,
            }  # fmt: skip
            if not self.new_api:
                message["tool_calls"] = None
            choice["message"] = message
        else:
            choice["text"] = req.output_text()
        choice.update(logprobs=None, finish_reason=reason, matched_stop=matched)
        return _json(
            {
                "id": req.rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": spec.model or self.config.model,
                "choices": [choice],
                "usage": self._usage(req, chat, streamed=False),
                "metadata": self._metadata(req),
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, parse_completion, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, parse_chat, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "sglang",
                        "root": self.config.model,
                        "parent": None,
                        "max_model_len": self.model.context_len,
                    }
                ],
            }
        )

    # -- state -------------------------------------------------------------------------
    def _launch_args(self) -> dict[str, object]:
        """The launch flags that mean something here, under SGLang's names."""
        cfg = self.config
        args: dict[str, object] = {
            "model_path": cfg.model,
            "tokenizer_path": cfg.model,
            "served_model_name": cfg.model,
            "host": self.host,
            "port": self.port,
            "context_length": cfg.context_length,
            "max_total_tokens": cfg.max_total_tokens,
            "page_size": cfg.page_size,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_prefill_tokens": cfg.max_prefill_tokens,
            "max_running_requests": cfg.max_running_requests,
            "max_queued_requests": cfg.max_queued_requests,
            "enable_priority_scheduling": cfg.enable_priority_scheduling,
            "schedule_low_priority_values_first": cfg.schedule_low_priority_values_first,
            "priority_scheduling_preemption_threshold": (
                cfg.priority_scheduling_preemption_threshold
            ),
            "schedule_policy": cfg.schedule_policy,
            "disable_radix_cache": cfg.disable_radix_cache,
            "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
            "hicache_ratio": cfg.hicache_ratio,
            "hicache_size": cfg.hicache_size,
            "hicache_write_policy": cfg.hicache_write_policy,
            "enable_mixed_chunk": cfg.enable_mixed_chunk,
            "enable_metrics": cfg.enable_metrics,
            "enable_cache_report": False,
            "decode_log_interval": cfg.decode_log_interval,
            "tp_size": 1,
            "dp_size": 1,
            "disaggregation_mode": cfg.disaggregation_mode,
            "disaggregation_transfer_backend": cfg.disaggregation_transfer_backend,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "num_reserved_decode_tokens": cfg.num_reserved_decode_tokens,
        }
        if self.new_api:
            args.update(
                disable_priority_preemption=cfg.disable_priority_preemption,
                retraction_policy=cfg.retraction_policy,
                incremental_streaming_output=cfg.incremental_streaming_output,
            )
        return args

    def _memory_usage(self) -> dict[str, object]:
        timing, tokens = self.config.timing, self.model.total_tokens
        usage: dict[str, object] = {
            "weight": round(timing.model.params * timing.model.bytes_per_param / 1e9, 3),
            "kvcache": round(tokens * timing.model.kv_bytes_per_token / 1e9, 3),
            "token_capacity": tokens,
        }
        if self.new_api:
            graphs = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                      "draft_extend")  # fmt: skip
            startup = round(timing.hardware.hbm_capacity_bytes / 1e9, 3)
            usage.update(
                startup_available=startup,
                token_capacity_swa=None,
                graph=dict.fromkeys(graphs, 0.0),
            )
        else:
            usage["graph"] = 0
        return usage

    async def server_info(self, request: web.Request) -> web.Response:
        cfg, model = self.config, self.model
        timing = cfg.timing
        launch = self._launch_args()
        internal: dict[str, object] = {
            **launch,
            "last_gen_throughput": model.gen_throughput,
            "memory_usage": self._memory_usage(),
        }
        if self.new_api:
            internal["effective_max_running_requests_per_dp"] = cfg.running_limit
        return _json(
            {
                **launch,
                "status": "ready",
                "max_total_num_tokens": model.total_tokens,
                "max_req_input_len": cfg.max_req_input_len,
                "version": self.api_version,
                "internal_states": [internal],
                "weir_reference_engine": {
                    "speed_factor": cfg.speed_factor,
                    "startup_s": cfg.startup_s,
                    "token_backend": cfg.token_backend,
                    "model_profile": timing.model.name,
                    "hardware_profile": timing.hardware.name,
                },
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        model = self.config.model
        info: dict[str, object] = {
            "model_path": model,
            "tokenizer_path": model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": _WEIGHT_VERSION,
        }
        if self.new_api:
            info.update(
                served_model_name=model,
                load_format="auto",
                reasoning_parser=None,
                tool_call_parser=None,
                disaggregation_mode=self.config.disaggregation_mode,
                has_image_understanding=False,
                has_audio_understanding=False,
                model_type="llama",
                architectures=["LlamaForCausalLM"],
            )
        return _json(info)

    async def get_load(self, request: web.Request) -> web.Response:
        loads = self.model.loads()
        return _json(
            [
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "dp_rank": None,
                    "num_reqs": loads.num_running_reqs + loads.num_waiting_reqs,
                    "num_waiting_reqs": loads.num_waiting_reqs,
                    "num_tokens": loads.num_used_tokens,
                }
            ]
        )

    def _disaggregation(self) -> dict[str, object]:
        """`/v1/loads`' per-rank P/D block, as SGLang's load inquirer fills it."""
        loads, pd = self.model.loads(), self.metrics.pd
        return {
            "mode": self.config.disaggregation_mode,
            "prefill_bootstrap_queue_reqs": loads.num_bootstrap_reqs,
            "prefill_inflight_queue_reqs": loads.num_inflight_reqs,
            "decode_prealloc_queue_reqs": loads.num_prealloc_reqs,
            "decode_transfer_queue_reqs": loads.num_transfer_reqs,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": round(pd.last_speed_gb_s, 3) if pd else 0.0,
            "kv_transfer_latency_ms": round(pd.last_latency_ms, 3) if pd else 0.0,
        }

    async def v1_loads(self, request: web.Request) -> web.Response:
        model, loads = self.model, self.model.loads()
        now = time.time()
        waiting = sum(r.total_len for r in model.waiting)
        memory = self._memory_usage()
        # SGLang counts its P/D queues as waiting: bootstrap (prefill), prealloc and
        # transfer (decode).
        handoffs = loads.num_bootstrap_reqs + loads.num_prealloc_reqs + loads.num_transfer_reqs
        rank = {
            "timestamp": now,
            "dp_rank": 0,
            "num_running_reqs": loads.num_running_reqs,
            "num_waiting_reqs": loads.num_waiting_reqs + handoffs,
            "num_waiting_uncached_tokens": loads.num_waiting_uncached_tokens,
            "num_used_tokens": loads.num_used_tokens,
            "num_total_tokens": loads.num_used_tokens + waiting,
            "num_active_tokens": loads.num_used_tokens + waiting,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": loads.max_total_num_tokens,
            "max_running_requests": self.config.running_limit,
            "token_usage": round(loads.token_usage, 4),
            "gen_throughput": round(loads.gen_throughput, 2),
            "cache_hit_rate": round(loads.cache_hit_rate, 4),
            "utilization": 0.0,
            "total_prefill_uncached_tokens": model.prompt_tokens_total - model.cached_tokens_total,
            "total_prefill_busy_us": model.prefill_busy_us,
            "decode_moments": list(model.decode_moments) if model.decode_moments[0] else None,
            "memory": {
                "weight_gb": memory["weight"],
                "kv_cache_gb": memory["kvcache"],
                "graph_gb": 0.0,
                "token_capacity": loads.max_total_num_tokens,
            },
            "disaggregation": self._disaggregation(),
            "queues": {
                "waiting": loads.num_waiting_reqs,
                "grammar": 0,
                "paused": len(self.driver.held),
                "retracted": 0,
                "prealloc_ready": 0,
            },
        }
        stamp = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
        return _json(
            {
                "timestamp": stamp,
                "version": self.api_version,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [rank],
            }
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        if not self.config.enable_metrics:
            raise web.HTTPNotFound()  # not served without --enable-metrics
        return web.Response(
            body=exposition(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.driver.ready else 503)

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's health check: 503 while starting; else a one-token generation, and
        200 once any output came back — checked once a second, up to
        `health_timeout_s` (http_server.health_generate)."""
        if not self.driver.ready:
            return web.Response(status=503)
        driver = self.driver
        asked = driver.now()
        req = self.model.make_request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], 1, now=asked)
        driver.submit(req, streaming=False, measured=False)
        deadline = asked + self.health_timeout_s
        while driver.now() < deadline:
            await asyncio.sleep(_HEALTH_POLL_S)
            if driver.last_output_at > asked:
                return web.Response(status=200)
        driver.cancel(req)
        return web.Response(status=503)

    # -- control -----------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequestError as exc:
            return _schema_error(str(exc))
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _schema_error("rid must be a string and abort_all a boolean.")
        self.driver.abort(rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = "abort"
        if self.new_api:
            try:
                body = await _json_body(request)
            except BadRequestError as exc:
                return _schema_error(str(exc))
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return _schema_error(
                    f"Input should be 'abort', 'retract' or 'in_place', got {mode!r}."
                )
        self.driver.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.new_api:
            try:
                await _json_body(request)
            except BadRequestError as exc:
                return _schema_error(str(exc))
        self.driver.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.model.flush_cache():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        if self.new_api:
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(
            status=400,
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
        )
