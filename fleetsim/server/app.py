"""The HTTP surface of SGLang 0.5.5 and 0.5.23 over the engine model.

Differences between the two surfaces, as in SGLANG_CONTRACT.md: 0.5.23 adds `/server_info`,
`/model_info`, `/ready`, `/v1/loads` (which replaces `/get_load`), pause modes, and the
`sglang:kv_*` gauges; 0.5.5's `/pause_generation` takes no body and aborts everything.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.transport.event_stream import EventStreamResponse
from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, RequestError
from fleetsim.server.driver import EngineDriver, Stream
from fleetsim.server.metrics import EngineMetrics
from fleetsim.server.protocol import (
    BadRequestError,
    GenerateSpec,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json,
)

API_VERSIONS = ("0.5.5", "0.5.23")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
_RECENT_OUTPUT_S = 5.0  # /health passes without generating when tokens flowed this recently

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def _sse(data: object) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _native_error(message: str, status: int) -> web.Response:
    return _json({"error": {"message": message}}, status)


def _openai_error(message: str, status: int) -> web.Response:
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    return _json(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status,
    )


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

    @property
    def new_api(self) -> bool:
        return self.api_version != "0.5.5"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
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
        return app

    # -- shared request path ------------------------------------------------------------
    def _submit(self, spec: GenerateSpec) -> Stream:
        """Validate against the engine (RequestError → 400) and queue."""
        req = self.model.make_request(
            spec.rid,
            spec.input_ids,
            spec.max_new_tokens,
            ignore_eos=spec.ignore_eos,
            min_new_tokens=spec.min_new_tokens,
            stop=spec.stop,
            stop_token_ids=spec.stop_token_ids,
            priority=spec.priority if self.config.enable_priority_scheduling else 0,
            cache_salt=spec.cache_salt,
            now=self.driver.now(),
        )
        return self.driver.submit(req)

    async def _accept(
        self,
        request: web.Request,
        parse: Callable[[dict[str, Any]], GenerateSpec],
        error: Callable[[str, int], web.Response],
    ) -> tuple[Stream, GenerateSpec] | web.Response:
        try:
            spec = parse(parse_json(await request.read()))
            stream = self._submit(spec)
        except BadRequestError as exc:
            return error(str(exc), exc.status)
        except RequestError as exc:
            return error(str(exc), 400)
        finish = stream.req.finish
        if finish is not None and finish.status_code is not None:
            return error(finish.message, finish.status_code)
        return stream, spec

    async def _follow(self, stream: Stream) -> AsyncIterator[bool]:
        """Yield whenever the request has new tokens or finished (True on the last);
        abort it if the client goes away first."""
        req = stream.req
        try:
            while True:
                if req.finish is None:
                    await stream.wait()
                last = req.finish is not None
                if last or len(req.output_ids) > stream.sent:
                    yield last
                if last:
                    return
        finally:
            if req.finish is None:
                self.driver.cancel(req)

    async def _stream(
        self,
        request: web.Request,
        stream: Stream,
        chunks: Callable[[Stream, bool], list[object]],
    ) -> web.StreamResponse:
        response = EventStreamResponse(headers=_SSE_HEADERS)  # as a real server's first write
        await response.prepare(request)
        try:
            async for last in self._follow(stream):
                for chunk in chunks(stream, last):
                    await response.write(_sse(chunk))
            await response.write(_DONE)
        except ConnectionResetError:
            self.driver.cancel(stream.req)
        return response

    async def _complete(self, stream: Stream) -> None:
        async for _ in self._follow(stream):
            stream.sent = len(stream.req.output_ids)

    # -- /generate ----------------------------------------------------------------------
    def _meta(self, req: EngineRequest) -> dict[str, object]:
        meta: dict[str, object] = {
            "id": req.rid,
            "finish_reason": req.finish.to_json() if req.finish else None,
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.completion_tokens,
            "cached_tokens": req.cached_tokens,
            "num_retractions": req.retractions,
        }
        if req.finish is not None:
            meta["e2e_latency"] = max(0.0, req.finished_at - req.arrival)
        return meta

    def _native_body(self, req: EngineRequest) -> dict[str, object]:
        return {
            "text": req.output_text(),
            "output_ids": list(req.output_ids),
            "meta_info": self._meta(req),
        }

    def _native_chunk(self, stream: Stream, last: bool) -> list[object]:
        """Cumulative text and ids, or only the new ones with SGLang's
        --incremental-streaming-output."""
        req = stream.req
        if not self.config.incremental_streaming_output:
            stream.sent = len(req.output_ids)
            return [self._native_body(req)]
        ids, text = stream.delta(last)
        if not (ids or text or last):
            return []
        return [{"text": text, "output_ids": ids, "meta_info": self._meta(req)}]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        accepted = await self._accept(request, parse_generate, _native_error)
        if isinstance(accepted, web.Response):
            return accepted
        stream, spec = accepted
        if spec.stream:
            return await self._stream(request, stream, self._native_chunk)
        await self._complete(stream)
        return _json(self._native_body(stream.req))

    # -- OpenAI ------------------------------------------------------------------------
    @staticmethod
    def _usage(req: EngineRequest) -> dict[str, object]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.completion_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    @staticmethod
    def _finish_reason(req: EngineRequest) -> tuple[str | None, object]:
        if req.finish is None:
            return None, None
        matched = req.finish.matched if req.finish.kind == "stop" else None
        return req.finish.openai, matched

    def _openai_chunks(
        self, spec: GenerateSpec, kind: str
    ) -> Callable[[Stream, bool], list[object]]:
        created = int(time.time())
        model = spec.model or self.config.model
        role_sent = False
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunks(stream: Stream, last: bool) -> list[object]:
            nonlocal role_sent
            req = stream.req
            out: list[object] = []
            base = {"id": req.rid, "object": obj, "created": created, "model": model}
            if chat and not role_sent:
                role_sent = True
                role = {"role": "assistant", "content": ""}
                out.append(
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                        ],
                    }
                )
            _, delta = stream.delta(last)
            reason, matched = self._finish_reason(req)
            if delta or last:
                choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": reason}
                if chat:
                    choice["delta"] = {"content": delta} if delta else {}
                else:
                    choice["text"] = delta
                if last:
                    choice["matched_stop"] = matched
                chunk: dict[str, object] = {**base, "choices": [choice]}
                if spec.include_usage and spec.continuous_usage:
                    chunk["usage"] = self._usage(req)
                out.append(chunk)
            if last and spec.include_usage:
                out.append({**base, "choices": [], "usage": self._usage(req)})
            return out

        return chunks

    async def completions(self, request: web.Request) -> web.StreamResponse:
        accepted = await self._accept(request, parse_completion, _openai_error)
        if isinstance(accepted, web.Response):
            return accepted
        stream, spec = accepted
        if spec.stream:
            return await self._stream(request, stream, self._openai_chunks(spec, "text"))
        await self._complete(stream)
        req = stream.req
        reason, matched = self._finish_reason(req)
        return _json(
            {
                "id": req.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": spec.model or self.config.model,
                "choices": [
                    {
                        "index": 0,
                        "text": req.output_text(),
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
            }
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        accepted = await self._accept(request, parse_chat, _openai_error)
        if isinstance(accepted, web.Response):
            return accepted
        stream, spec = accepted
        if spec.stream:
            return await self._stream(request, stream, self._openai_chunks(spec, "chat"))
        await self._complete(stream)
        req = stream.req
        reason, matched = self._finish_reason(req)
        return _json(
            {
                "id": req.rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": spec.model or self.config.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": req.output_text(),
                            "reasoning_content": None,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(req),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang",
                        "root": self.config.model,
                        "max_model_len": self.model.context_len,
                    }
                ],
            }
        )

    # -- state -------------------------------------------------------------------------
    def _launch_args(self) -> dict[str, object]:
        cfg = self.config
        return {
            "model_path": cfg.model,
            "tokenizer_path": cfg.model,
            "served_model_name": cfg.model,
            "host": self.host,
            "port": self.port,
            "context_length": cfg.context_length,
            "max_total_tokens": cfg.max_total_tokens,
            "page_size": cfg.page_size,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_running_requests": cfg.max_running_requests,
            "max_queued_requests": cfg.max_queued_requests,
            "enable_priority_scheduling": cfg.enable_priority_scheduling,
            "schedule_low_priority_values_first": cfg.schedule_low_priority_values_first,
            "schedule_policy": cfg.schedule_policy,
            "disable_radix_cache": cfg.disable_radix_cache,
            "enable_mixed_chunk": cfg.enable_mixed_chunk,
            "enable_metrics": cfg.enable_metrics,
            "decode_log_interval": cfg.decode_log_interval,
            "incremental_streaming_output": cfg.incremental_streaming_output,
            "tp_size": 1,
            "dp_size": 1,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        cfg, model = self.config, self.model
        timing = cfg.timing
        return _json(
            {
                **self._launch_args(),
                "max_total_num_tokens": model.total_tokens,
                "max_req_input_len": cfg.max_req_input_len,
                "version": self.api_version,
                "internal_states": [
                    {
                        "memory_usage": {
                            "weight": timing.model.params * timing.model.bytes_per_param / 1e9,
                            "kvcache": model.total_tokens * timing.model.kv_bytes_per_token / 1e9,
                            "token_capacity": model.total_tokens,
                            "graph": 0.0,
                        },
                        "effective_max_running_requests_per_dp": cfg.running_limit,
                        "last_gen_throughput": model.gen_throughput,
                        "new_token_ratio": model.new_token_ratio,
                    }
                ],
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
        return _json(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        loads = self.model.loads()
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": loads.num_running_reqs + loads.num_waiting_reqs,
                    "num_waiting_reqs": loads.num_waiting_reqs,
                    "num_tokens": loads.num_used_tokens,
                }
            ]
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        loads = self.model.loads()
        rank = {
            "dp_rank": 0,
            "num_running_reqs": loads.num_running_reqs,
            "num_waiting_reqs": loads.num_waiting_reqs,
            "num_waiting_uncached_tokens": loads.num_waiting_uncached_tokens,
            "num_used_tokens": loads.num_used_tokens,
            "num_evictable_tokens": loads.num_evictable_tokens,
            "num_available_tokens": loads.num_available_tokens,
            "max_total_num_tokens": loads.max_total_num_tokens,
            "token_usage": loads.token_usage,
            "gen_throughput": loads.gen_throughput,
            "cache_hit_rate": loads.cache_hit_rate,
            "num_retracted_reqs": loads.num_retracted_reqs,
            "paused": loads.paused,
        }
        return _json({"version": self.api_version, "dp_rank_count": 1, "loads": [rank]})

    async def prometheus(self, request: web.Request) -> web.Response:
        if not self.config.enable_metrics:
            raise web.HTTPNotFound(text="Metrics are disabled; launch with --enable-metrics.")
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def ready(self, request: web.Request) -> web.Response:
        if not self.driver.ready:
            return _json({"status": "not ready"}, 503)
        return _json({"status": "ready"})

    async def health(self, request: web.Request) -> web.Response:
        """A one-token generation, unless tokens flowed moments ago (as SGLang does);
        503 while starting."""
        if not self.driver.ready:
            return web.Response(status=503)
        if self.driver.last_output_at >= 0 and (
            self.driver.now() - self.driver.last_output_at < _RECENT_OUTPUT_S
        ):
            return web.Response(status=200)
        req = self.model.make_request(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", [ord("1")], 1, ignore_eos=True,
            now=self.driver.now(),
        )  # fmt: skip
        stream = self.driver.submit(req)
        try:
            await asyncio.wait_for(self._complete(stream), self.health_timeout_s)
        except TimeoutError:
            return web.Response(status=503)
        ok = req.finish is not None and req.finish.kind != "abort"
        return web.Response(status=200 if ok else 503)

    # -- control -----------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        return parse_json(raw) if raw.strip() else {}

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except BadRequestError as exc:
            return _native_error(str(exc), exc.status)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _native_error("rid must be a string and abort_all a boolean.", 400)
        self.driver.abort(rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = "abort"
        if self.new_api:
            try:
                body = await self._body(request)
            except BadRequestError as exc:
                return _native_error(str(exc), exc.status)
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return _native_error(
                    f"Unknown pause mode {mode!r}: use abort, retract or in_place.", 400
                )
        self.driver.pause(mode)
        return _json({"message": "Generation paused successfully.", "mode": mode})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.driver.resume()
        return _json({"message": "Generation continued successfully."})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.model.flush_cache():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(
            status=400,
            text="Cache not flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
        )
