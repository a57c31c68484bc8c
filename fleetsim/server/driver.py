"""The engine model in real time: one task steps it, sleeping each iteration's duration over
the speed factor, and wakes the HTTP handlers whose requests moved.

Handlers never touch the step loop; they submit, wait on their `Stream`'s event, and read
the request's `output_ids`. Several iterations' tokens coalesce into one chunk when a
client reads slower than the engine writes, as SGLang's detokenizer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from fleetsim.engine import EngineModel, EngineRequest, StepResult, decode
from fleetsim.server.metrics import EngineMetrics

log = logging.getLogger(__name__)


class Stream:
    """A handler's view of one request: woken whenever it got tokens or finished."""

    __slots__ = ("event", "last_emit", "req", "sent", "sent_text")

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.event = asyncio.Event()
        self.sent = 0  # output tokens already written to the client
        self.sent_text = 0  # characters of output text already written
        self.last_emit = -1.0

    def delta(self, last: bool) -> tuple[list[int], str]:
        """The ids and text not yet written, marked as written. Generated tokens are ASCII
        bytes (ids and characters match 1:1), so text is decoded from the new ids only;
        until the end, what could still become a stop string is held back, and the final
        text stops before a matched one."""
        req = self.req
        if last:
            upto = len(req.output_ids)
            text = req.output_text()[self.sent_text :]
        else:
            upto = max(self.sent, len(req.output_ids) - max(0, req.stop_window - 1))
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
        self.last_output_at = -1.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.ready_at = self._loop.time() + model.config.startup_s
        self.crashed: BaseException | None = None

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
    def submit(self, req: EngineRequest) -> Stream:
        """Queue the request and return its stream; a refused request (queue full) comes
        back already finished."""
        stream = Stream(req)
        if self.model.submit(req, self.now()):
            self.streams[id(req)] = stream
            self._wake.set()
        else:
            self.metrics.finished(req)
        return stream

    def cancel(self, req: EngineRequest) -> None:
        """The client went away: end exactly this request (not its rid's prefix)."""
        if req.finish is None:
            self._ended(self.model.abort_request(req, self.now()))

    def abort(self, rid: str, abort_all: bool) -> int:
        victims = self.model.abort(rid, abort_all=abort_all, now=self.now())
        self._ended(victims)
        return len(victims)

    def pause(self, mode: str) -> None:
        self._ended(self.model.pause(mode, self.now()))
        self.metrics.refresh()

    def resume(self) -> None:
        self.model.resume()
        self._wake.set()

    def _ended(self, reqs: Iterable[EngineRequest]) -> None:
        for req in reqs:
            self.metrics.finished(req)
            stream = self.streams.pop(id(req), None)
            if stream is not None:
                stream.event.set()
        if not self.model.has_work:
            self.metrics.refresh()

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
                model.step(loop.time())  # idle: SGLang resets its new-token ratio
                self.metrics.refresh()
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            start = loop.time()
            result = model.step(start)
            deadline = max(deadline, start) + result.duration / self.speed_factor
            if result.idle:
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

    def _publish(self, result: StepResult, t: float) -> None:
        streams, metrics = self.streams, self.metrics
        ttft, itl = metrics.ttft, metrics.itl
        if result.emitted:
            self.last_output_at = t
        for req in result.emitted:
            stream = streams.get(id(req))
            if stream is None:
                continue
            if stream.last_emit < 0:
                ttft.observe(t - req.arrival)
            else:
                itl.observe(t - stream.last_emit)
            stream.last_emit = t
            stream.event.set()
        for req in result.finished:
            metrics.finished(req)
            stream = streams.pop(id(req), None)
            if stream is not None:
                stream.event.set()
