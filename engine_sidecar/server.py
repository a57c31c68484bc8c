"""Running a sidecar: configuration, the HTTP server and its background loops.

`serve_sidecar(config)` is the in-process entry point (tests, `weir up`); `weir sidecar`
runs the same thing as a process. Background loops: the engine poll (its load report,
reconciled with the sidecar's own accounting), the relief loop (woken when the watermark
reaches exhausted) and, with a Redis URL, the control-plane link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import yaml
from aiohttp import web

from controlplane.contract import PoolPolicy, Role, SchemaError, WatermarkState, decode_json
from controlplane.contract import headers as wire
from controlplane.store.connection import RedisSettings, connect
from controlplane.trace.middleware import request_ids
from controlplane.transport.guard import ServerLimits
from engine_sidecar.control import ControlLink
from engine_sidecar.engine import EngineAdapter, EngineError, EngineInfo, SGLangEngine
from engine_sidecar.service import SidecarService

log = logging.getLogger("weir.sidecar")


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    engine_url: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    # Empty: no control plane (local admission only). Not in repr: it holds a password.
    redis_url: str = field(default="", repr=False)
    pool: str = "default"
    endpoint_id: str = ""  # empty: derived from the host name and port
    advertise_url: str = ""  # empty: the URL the sidecar listens on
    policy: PoolPolicy | None = None  # None: defaults, with the engine's model
    heartbeat_s: float = 1.0
    lease_ttl_s: float = 5.0
    engine_poll_s: float = 0.5
    engine_wait_s: float = 900.0  # a large model can take many minutes to load
    # Bearer token for the admin routes (/weir/v1/state, /preempt, /drain); empty leaves
    # them open (a local fleet), with a warning at start.
    admin_token: str = field(default="", repr=False)
    # What the sidecar reads from routers: body size (by default sized to the context
    # length), bytes in flight, header/body/idle timeouts, connections.
    server: ServerLimits = field(default_factory=ServerLimits)


def load_policy(path: str | Path) -> PoolPolicy:
    """A PoolPolicy from a JSON or YAML file (the operator's ConfigMap), strictly checked."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            text = msgspec.json.encode(yaml.safe_load(text)).decode()
        except (yaml.YAMLError, TypeError) as exc:
            raise SchemaError(f"malformed PoolPolicy YAML: {exc}") from exc
    return decode_json(text, PoolPolicy)


@dataclass
class RunningSidecar:
    url: str
    service: SidecarService
    link: ControlLink | None
    _stop: asyncio.Event

    def close(self) -> None:
        """Ask the sidecar to stop (the context manager's exit cleans up)."""
        self._stop.set()

    async def wait_closed(self) -> None:
        await self._stop.wait()


# How long one ask for the engine's server info may go unanswered while it starts: an
# SGLang server can accept a connection and hold the request until its warmup is done, or
# for good when a warmup stalls; asked again, it may answer.
_INFO_ASK_S = 10.0


async def _engine_info(
    engine: EngineAdapter, wait_s: float, ask_s: float = _INFO_ASK_S
) -> EngineInfo:
    """The engine's server info, waiting while it starts (it answers 503, refuses the
    connection, or holds the request unanswered); each wait over 10 s is logged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    next_log = loop.time() + 10.0
    while True:
        try:
            return await asyncio.wait_for(engine.server_info(), min(ask_s, wait_s))
        except (EngineError, TimeoutError) as exc:
            now = loop.time()
            if now > deadline:
                if isinstance(exc, TimeoutError):
                    raise EngineError(f"no server info within {wait_s:g} s") from None
                raise
            if now > next_log:
                why = exc if isinstance(exc, EngineError) else f"no answer in {ask_s:g} s"
                log.info("waiting for the engine: %s", why)
                next_log = now + 10.0
            await asyncio.sleep(0.2)


async def _poll_engine(service: SidecarService, every_s: float) -> None:
    while True:
        try:
            load = await service.engine.load()
            service.ledger.observe_engine(load.used_tokens, load.sampled_at, load.waiting_requests)
            service.engine_ok = True
        except EngineError as exc:
            log.debug("engine load: %s", exc)
            service.engine_ok = False
        await asyncio.sleep(every_s)


async def _relief(service: SidecarService, link: ControlLink | None) -> None:
    ledger = service.ledger
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ledger.pressure.wait(), timeout=0.25)
        ledger.pressure.clear()
        if ledger.watermark is WatermarkState.EXHAUSTED:
            await read_host_bandwidth(service)
            if link is None:
                await service.relieve()
                continue
            peers = await link.peers()
            if ledger.watermark is WatermarkState.EXHAUSTED:
                await service.relieve(peers)


async def read_host_bandwidth(service: SidecarService) -> None:
    """Relief weighs offload by the host bandwidth the engine has measured, read as it
    plans (rarely: only at exhaustion); the default stands while it has timed no copy,
    or cannot say."""
    if not service.host_tier_tokens:
        return
    try:
        service.observe_host_bandwidth(await service.engine.host_bandwidth())
    except EngineError as exc:
        log.debug("engine host bandwidth: %s", exc)


def _check_role(policy: PoolPolicy, info: EngineInfo, engine_url: str) -> None:
    """A P/D pool's engines must serve its half (SGLang's --disaggregation-mode), and a
    mixed pool's neither: a mismatch would hang or fail every request."""
    mode = "null" if policy.role is Role.MIXED else policy.role.value
    if info.disaggregation_mode != mode:
        raise EngineError(
            f"pool {policy.pool!r} is a {policy.role.value} pool but {engine_url} runs "
            f"--disaggregation-mode {info.disaggregation_mode}: launch it with "
            f"--disaggregation-mode {mode}"
        )


@asynccontextmanager
async def serve_sidecar(config: SidecarConfig) -> AsyncIterator[RunningSidecar]:
    engine = SGLangEngine(config.engine_url)
    tasks: list[asyncio.Task[None]] = []
    runner: web.AppRunner | None = None
    link: ControlLink | None = None
    service: SidecarService | None = None
    try:
        info = await _engine_info(engine, config.engine_wait_s)
        policy = config.policy or PoolPolicy(pool=config.pool, model=info.model)
        if info.kv_capacity_tokens <= 0:
            raise EngineError(f"{config.engine_url} reports no KV capacity")
        _check_role(policy, info, config.engine_url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        port = sock.getsockname()[1]
        url = f"http://{config.host}:{port}"
        endpoint_id = config.endpoint_id or f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:6]}"
        # Bodies are sized to the longer of the two contexts: the limit bounds memory, and
        # validation, not it, refuses a prompt over the engine's context.
        context = max(policy.context_length, info.context_length or 0)
        service = SidecarService(
            engine, info, policy, config.pool, endpoint_id, admin_token=config.admin_token,
            server_limits=config.server.for_context(context),
        )  # fmt: skip
        if not config.admin_token:
            log.warning(
                "no admin token: /weir/v1/state, /weir/v1/requests, /weir/v1/preempt, "
                "/weir/v1/drain and /weir/v1/reserve are "
                "open to anyone who reaches %s (set --admin-token-file or WEIR_ADMIN_TOKEN)",
                url,
            )
        guard = service.guard
        # The router's request id first; a client that calls the sidecar directly may
        # give its own.
        ids = request_ids(
            SidecarService.REQUEST_PATHS,
            (wire.REQUEST_ID, wire.CLIENT_REQUEST_ID),
            "weir.sidecar.request",
        )
        app = web.Application(
            client_max_size=service.continuation_limit, middlewares=[ids, guard.middleware]
        )
        app.add_routes(service.routes())
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=guard.limits.idle_timeout_s,
        )
        await runner.setup()
        await guard.start(runner, sock=sock)
        tasks.append(asyncio.create_task(_poll_engine(service, config.engine_poll_s)))
        if config.redis_url:
            link = ControlLink(
                service,
                connect(
                    RedisSettings.from_url(config.redis_url, client_name=f"weir-sidecar-{port}")
                ),
                config.pool,
                endpoint_id,
                config.advertise_url or url,
                config.heartbeat_s,
                config.lease_ttl_s,
                config.admin_token,
            )
            service.on_drain = link.drain
            link.start()  # not awaited: an unreachable Redis must not hold up serving
        tasks.append(asyncio.create_task(_relief(service, link)))
        yield RunningSidecar(url, service, link, asyncio.Event())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()  # ends in-flight requests: aborts, quota releases
        if service is not None:
            await service.settled()
        if link is not None:
            try:  # bounded: with Redis gone, the lease simply expires
                await asyncio.wait_for(link.close(), timeout=max(1.0, config.lease_ttl_s))
            except TimeoutError:
                log.warning("left without deregistering (Redis did not answer)")
        await engine.close()
