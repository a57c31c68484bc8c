"""The reference engine's HTTP server: SGLang's protocol (0.5.5 or 0.5.23) over the engine
model, stepping in real time.

    from fleetsim.engine import EngineConfig
    from fleetsim.server import serve_engine

    async with serve_engine(EngineConfig(max_total_tokens=8192, speed_factor=50)) as eng:
        eng.url            # http://127.0.0.1:<port>
        eng.engine         # the EngineModel: eng.engine.loads(), eng.engine.check()
        await eng.kill()   # drop the listener and every connection, as a crashed pod
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from fleetsim.engine import EngineConfig, EngineModel
from fleetsim.engine.backends import TokenBackend
from fleetsim.server.app import API_VERSIONS, EngineServer
from fleetsim.server.disaggregation import PrefillSide
from fleetsim.server.driver import EngineDriver
from fleetsim.server.metrics import EngineMetrics

__all__ = ["API_VERSIONS", "RunningEngine", "make_backend", "serve_engine"]


def make_backend(config: EngineConfig) -> TokenBackend | None:
    """The token backend the config names (None: the model's default hash backend)."""
    if config.token_backend == "torch":
        from fleetsim.engine.torch_backend import TorchBackend

        return TorchBackend(config)
    return None


class RunningEngine:
    """A served engine. `close()` shuts down gracefully; `kill()` abruptly."""

    def __init__(
        self,
        server: EngineServer,
        listeners: list[tuple[web.AppRunner, web.TCPSite]],
        url: str,
    ) -> None:
        self.server = server
        self.config = server.config
        self.engine: EngineModel = server.model
        self.driver = server.driver
        self.api_version = server.api_version
        self.url = url
        # The HTTP server, and a prefill engine's bootstrap server.
        self._listeners = listeners
        self._closed = False

    async def kill(self) -> None:
        """Stop listening, reset every open connection and stop stepping: what clients of a
        crashed pod see."""
        if self._closed:
            return
        self._closed = True
        # The listener closes first, before anything here waits: no connection is
        # accepted while the engine dies. One accepted just before gets its transport in
        # one loop iteration and registers its handler in the next; without these pauses
        # it would escape the reset and linger as an unclosed socket.
        for _, site in self._listeners:
            await site.stop()
        servers = [runner.server for runner, _ in self._listeners]
        for _ in range(3):
            await asyncio.sleep(0)
        for http in servers:
            self._reset_connections(http)
        await self.driver.stop()
        for runner, _ in self._listeners:
            await runner.cleanup()
        for http in servers:
            self._reset_connections(http)
        await asyncio.sleep(0)  # aborted transports close their sockets on the next turn

    @staticmethod
    def _reset_connections(http: web.Server | None) -> None:
        for handler in http.connections if http is not None else ():
            transport = handler.transport
            if transport is not None:
                transport.abort()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.driver.abort("", abort_all=True)
        await self.driver.stop()
        for runner, _ in reversed(self._listeners):
            await runner.cleanup()


@asynccontextmanager
async def serve_engine(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_version: str = "0.5.23",
) -> AsyncIterator[RunningEngine]:
    """Serve an engine on (host, port) (0: a free port) until the block exits."""
    running = await start_engine(config, host=host, port=port, api_version=api_version)
    try:
        yield running
    finally:
        await running.close()


async def start_engine(
    config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0, api_version: str = "0.5.23"
) -> RunningEngine:
    if api_version not in API_VERSIONS:
        raise ValueError(f"api_version must be one of {API_VERSIONS}, got {api_version!r}")
    # The scheduler follows the version whose surface is served; a decode engine runs
    # without a prefix cache, as SGLang's does unless asked (its KV arrives by transfer).
    config = config.replace(sglang_version=api_version)
    if config.disaggregation_mode == "decode":
        config = config.replace(disable_radix_cache=True)
    model = EngineModel(config, make_backend(config))
    metrics = EngineMetrics(model, api_version)
    driver = EngineDriver(model, metrics, config.speed_factor)
    server = EngineServer(model, driver, metrics, api_version)
    listeners = [await _listen(server.app(), host, port)]
    server.host, server.port = host, _bound(listeners[0][0], port)
    if isinstance(server.handoffs, PrefillSide):
        # SGLang's bootstrap server, where decode engines ask for the KV (0: a free port).
        boot = config.disaggregation_bootstrap_port
        listeners.append(await _listen(server.handoffs.app(), host, boot))
        server.bootstrap_port = _bound(listeners[1][0], boot)
    driver.start()
    await asyncio.sleep(0)
    return RunningEngine(server, listeners, f"http://{host}:{server.port}")


async def _listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, web.TCPSite]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site


def _bound(runner: web.AppRunner, port: int) -> int:
    sockets = runner.addresses
    return int(sockets[0][1]) if sockets else port
