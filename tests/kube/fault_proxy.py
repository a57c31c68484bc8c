"""A proxy in front of the real API server that fails chosen calls, once each.

The API server answers every call as it would in production; a test that needs one call
to fail (a 409 on a status write, a 500 on an apply) arms a fault, and the next request
that matches is answered with that status and a Kubernetes Status body instead of being
forwarded. Everything else, watches included, streams through unchanged. It runs in a
thread with its own event loop, so a test that blocks (kubectl, helm) stalls nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from weir.local.ports import free_port

# Hop-by-hop headers, and those aiohttp sets itself (it also decompresses the body).
_SKIP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    left: int = 1
    hits: int = 0


class FaultProxy:
    def __init__(self, upstream: str, ca: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(ca))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._stop: asyncio.Event | None = None

    def fail(self, method: str, path: str, status: int, times: int = 1) -> Fault:
        """Answer the next `times` requests `method` whose path matches `path` (a regular
        expression) with `status`."""
        fault = Fault(method.upper(), re.compile(path), status, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            self._http = http
            self._ready.set()
            await self._stop.wait()
        # The session closed first: relayed watches end, so the server stops at once.
        await runner.cleanup()

    def _take(self, request: web.Request) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if (
                    fault.left
                    and fault.method == request.method
                    and fault.path.search(request.path)
                ):
                    fault.left -= 1
                    fault.hits += 1
                    return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._take(request)
        if fault is not None:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                      "message": f"injected by the test: HTTP {fault.status}",
                      "reason": "Conflict" if fault.status == 409 else "InternalError",
                      "code": fault.status}  # fmt: skip
            return web.Response(
                status=fault.status, body=json.dumps(status), content_type="application/json"
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        body = await request.read()
        async with self._http.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,  # an empty body would get a content type of aiohttp's
            ssl=self._ssl,
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
