"""The engine model in real time: one task steps it, sleeping each iteration's duration over
the speed factor, and wakes the HTTP handlers whose requests moved.

An iteration's tokens exist in the model from the moment it is stepped, but a client may
see them only when the iteration ends, as with SGLang, which streams each decode step's
token after its forward pass (stream_interval 1): each `Stream` keeps how much of its
request has been published (`shown`, `finished`), and handlers read no further. After
publishing, the loop yields before stepping again, so a handler writes each step's token
on its own; several steps' tokens coalesce into one chunk only when a client reads slower
than the engine writes, as SGLang's tokenizer manager does.

While paused, new requests wait here rather than in the model's queue: SGLang holds them
in its tokenizer manager until /continue_generation.

P/D: the driver moves a prefill export or a decode handoff through the model's phases on
the server's word (`peer_ready`, `kv_arrived`, `transfer_done`, `handoff_failed`) and
tells the server when the model moved one itself: `on_exported` when an export's first
token is computed (its KV ships now), `on_preallocated` when a handoff got its pages
(its KV may be fetched now), `on_ended` whenever a request ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from fleetsim.engine import EngineModel, EngineRequest, StepResult, decode
from fleetsim.server.metrics import EngineMetrics

log = logging.getLogger(__name__)


class Stream:
    """A handler's view of one request: woken whenever it got tokens or finished."""

    __slots__ = (
        "event",
        "finished",
        "first_sent_at",
        "last_emit",
        "measured",
        "req",
        "sent",
        "sent_text",
        "shown",
        "step_from",
        "streaming",
    )

    def __init__(self, req: EngineRequest, streaming: bool, measured: bool = True) -> None:
        self.req = req
        self.streaming = streaming
        self.measured = measured  # counted in /metrics (SGLang's health checks are not)
        self.event = asyncio.Event()
        self.shown = 0  # output tokens published to handlers
        self.step_from = 0  # where the latest publish's tokens start
        self.finished = False  # the finish is published
        self.sent = 0  # output tokens already written to the client
        self.sent_text = 0  # characters of output text already written
        self.last_emit = -1.0
        self.first_sent_at = -1.0  # when the first chunk went out (SGLang's response_sent)

    def publish(self, finished: bool = False) -> None:
        shown = len(self.req.output_ids)
        if shown > self.shown:
            self.step_from, self.shown = self.shown, shown
        self.finished = self.finished or finished
        self.event.set()

    def delta(self, last: bool) -> tuple[list[int], str]:
        """The published ids and text not yet written, marked as written. Generated
        tokens are ASCII bytes (ids and characters match 1:1), so text is decoded from
        the new ids only; until the end, what could still become a stop string is held
        back, and the final text stops before a matched one."""
        req = self.req
        if last:
            upto = self.shown
            text = req.output_text()[self.sent_text :]
        else:
            upto = max(self.sent, self.shown - max(0, req.stop_window - 1))
            text = decode(req.output_ids[self.sent : upto])
        ids = req.output_ids[self.sent : upto]
        self.sent = upto
        self.sent_text += len(text)
        return ids, text

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class EngineDriver:
    def __init__(self, model: EngineModel, metrics: EngineMetrics, speed_factor: float) -> None:
        self.model = model
        self.metrics = metrics
        self.speed_factor = speed_factor
        self.streams: dict[int, Stream] = {}
        self.held: list[Stream] = []  # submitted while paused
        self.last_output_at = -1.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.ready_at = self._loop.time() + model.config.startup_s
        self.crashed: BaseException | None = None
        self.on_exported: Callable[[EngineRequest], None] | None = None
        self.on_preallocated: Callable[[EngineRequest], None] | None = None
        self.on_ended: Callable[[EngineRequest], None] | None = None

    def now(self) -> float:
        return self._loop.time()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-step-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def ready(self) -> bool:
        """Past startup and stepping: what /health and /ready report."""
        return self.alive and self.now() >= self.ready_at

    # -- requests ----------------------------------------------------------------------
    def submit(self, req: EngineRequest, streaming: bool, measured: bool = True) -> Stream:
        """Queue the request (or hold it while paused) and return its stream; a refused
        request (queue full) comes back already finished."""
        stream = Stream(req, streaming, measured)
        if self.model.paused:
            self.held.append(stream)
        else:
            self._queue(stream)
        return stream

    def submit_prefill(self, req: EngineRequest, streaming: bool) -> Stream:
        """P/D prefill side: the export waits for `peer_ready`."""
        stream = Stream(req, streaming)
        self.streams[id(req)] = stream
        self.model.submit_prefill(req, self.now())
        return stream

    def peer_ready(self, req: EngineRequest) -> None:
        if req.finish is not None:
            return
        if self.model.peer_ready(req, self.now()):
            self._wake.set()
        else:
            self._ended([req])

    def transfer_done(self, req: EngineRequest) -> None:
        """The export's KV has shipped: it ends, and its first token goes out."""
        if req.finish is not None:
            return
        now = self.now()
        self.model.transfer_done(req, now)
        self.last_output_at = now
        stream = self.streams.get(id(req))
        if stream is not None and stream.measured:
            self.metrics.first_token(req, stream.streaming, now)
        self._ended([req])

    def submit_handoff(self, req: EngineRequest, streaming: bool) -> Stream:
        """P/D decode side: the handoff waits for pages, then for `kv_arrived`."""
        stream = Stream(req, streaming)
        self.streams[id(req)] = stream
        self.model.submit_handoff(req, self.now())
        self._preallocate()
        return stream

    def kv_arrived(self, req: EngineRequest, output_id: int, cached_tokens: int) -> None:
        """The handoff's KV landed: its first token (the prefill's) is published now."""
        if req.finish is not None:
            return
        now = self.now()
        self.model.kv_arrived(req, output_id, cached_tokens, now)
        self.last_output_at = now
        stream = self.streams.get(id(req))
        if stream is not None:
            if stream.measured:
                self.metrics.first_token(req, stream.streaming, now)
            stream.last_emit = now
            stream.publish()
        if req.finished:  # the handoff token ended it
            self._ended([req])
        self._wake.set()

    def handoff_failed(self, req: EngineRequest, message: str) -> None:
        """The other side of a handoff failed: the request ends with SGLang's 500."""
        if req.finish is None and self.model.requests.get(req.rid) is req:
            self.model.abort_request(req, self.now(), message, status_code=500)
            self._ended([req])

    def _preallocate(self) -> None:
        if self.model.prealloc and self.on_preallocated is not None:
            for req in self.model.preallocate():
                self.on_preallocated(req)

    def _queue(self, stream: Stream) -> None:
        req = stream.req
        self.streams[id(req)] = stream
        if self.model.submit(req, self.now()):
            self._wake.set()
        else:
            self._ended([req])

    def cancel(self, req: EngineRequest) -> None:
        """The client went away: end exactly this request (not its rid's prefix)."""
        if req.finish is not None:
            return
        held = next((s for s in self.held if s.req is req), None)
        if held is not None:
            self.held.remove(held)
            return
        self._ended(self.model.abort_request(req, self.now()))

    def abort(self, rid: str, abort_all: bool) -> None:
        """SGLang's /abort_request: its tokenizer manager forwards an abort only for a
        live request with exactly this rid; its scheduler then aborts every rid it
        prefixes (sglang/srt/managers/tokenizer_manager.py, scheduler.py)."""
        if not abort_all and rid not in self.model.requests:
            return
        self._ended(self.model.abort(rid, abort_all=abort_all, now=self.now()))

    def pause(self, mode: str) -> None:
        """Requests already held stay held: SGLang's abort reaches only its scheduler."""
        self._ended(self.model.pause(mode, self.now()))
        self.metrics.refresh()

    def resume(self) -> None:
        self.model.resume()
        held, self.held = self.held, []
        for stream in held:
            self._queue(stream)
        self._preallocate()  # handoffs that waited for pages while paused
        self._wake.set()

    def _ended(self, reqs: Iterable[EngineRequest]) -> None:
        for req in reqs:
            stream = self.streams.pop(id(req), None)
            if stream is not None:
                self._finished(stream)
        self._preallocate()  # pages an ending request freed may take a handoff
        if not self.model.has_work:
            self.metrics.refresh()

    def _finished(self, stream: Stream) -> None:
        stream.publish(finished=True)
        if stream.measured:
            self.metrics.finished(stream.req, stream.streaming)
        if self.on_ended is not None:
            self.on_ended(stream.req)

    # -- the step loop ----------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._step_forever()
        except Exception as exc:
            # A bug, not a load condition: fail every request loudly instead of hanging.
            log.exception("engine step loop crashed")
            self.crashed = exc
            self._ended(self.model.abort(abort_all=True, now=self.now(),
                                         message=f"Engine crashed: {exc!r}"))  # fmt: skip

    async def _step_forever(self) -> None:
        model, loop = self.model, self._loop
        interval = model.config.decode_log_interval
        deadline = loop.time()
        while True:
            if not model.has_work:
                self._publish(model.step(loop.time()), loop.time())  # idle: resets the ratio
                self.metrics.refresh()
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            start = loop.time()
            result = model.step(start)
            deadline = max(deadline, start) + result.duration / self.speed_factor
            for req in result.admitted:
                stream = self.streams.get(id(req))
                if stream is not None and stream.measured:
                    self.metrics.queue_time.observe(max(0.0, start - req.queued_at))
            if result.idle:
                self._publish(result, start)  # what ended without running (a full queue)
                # Nothing could run (e.g. every admitted prefill waits for pages): let the
                # handlers run before trying again.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.005)
                continue
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._publish(result, loop.time())
            if result.prefill_tokens or (
                result.decode_tokens and model.decode_steps % interval == 0
            ):
                self.metrics.refresh()
            await asyncio.sleep(0)  # the woken handlers write this step's tokens first

    def _publish(self, result: StepResult, t: float) -> None:
        streams, metrics = self.streams, self.metrics
        if result.emitted:
            self.last_output_at = t
        for req in result.emitted:
            stream = streams.get(id(req))
            if stream is None or req.kv_export:
                continue  # an export's token goes out once its KV has shipped
            if stream.measured:
                if stream.last_emit < 0:
                    metrics.first_token(req, stream.streaming, t)
                else:
                    metrics.itl.observe(t - stream.last_emit)
            stream.last_emit = t
            stream.publish()
        for req in result.retracted:
            metrics.retracted(req)
        for req in result.finished:
            stream = streams.pop(id(req), None)
            if stream is not None:
                self._finished(stream)
        if result.exported and self.on_exported is not None:
            for req in result.exported:
                self.on_exported(req)
        if result.finished or result.retracted:
            self._preallocate()
