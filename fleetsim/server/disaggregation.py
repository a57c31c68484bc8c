"""The reference engine's half of SGLang's P/D protocol (docs/disaggregation.md).

A request naming a peer (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`) is one half
of a handoff, and the same body goes to both engines:

- A **prefill** engine keeps it in the bootstrap queue until its decode peer asks for the
  KV, prefills it, and holds its KV while the transfer runs: the KV's bytes over the link
  (`EngineConfig.kv_link_bytes_per_s`, the hardware profile's by default, as in the fleet
  simulator), over the speed factor. Then the decode peer gets the KV, and the client its
  one token with SGLang's `length 0`.
- A **decode** engine keeps it in the prealloc queue until its pool has room, takes the
  prompt's pages, and asks the prefill engine's bootstrap server for the KV, holding the
  pages while it travels (the transfer queue). When it lands, the request continues from
  the prefill's first token; its stream carries every token, that one first.

Between two reference engines the KV moves over loopback HTTP, standing in for SGLang's
transfer backends (Mooncake, NIXL), through the prefill engine's bootstrap server on
`--disaggregation-bootstrap-port` (which also answers SGLang's `GET /health`):

    decode → POST /weir/v1/kv/{room}        {"rid", "input_ids_hash"}   on arrival: the
             handshake, held open until the KV has shipped: 200 {"output_id",
             "cached_tokens", "kv_bytes", "input_ids_hash"}, or 409 {"error": {"message"}}
             when the prefill half failed
    decode → POST /weir/v1/kv/{room}/pages  {}   once its pages exist: the prefill half
             may prefill now (SGLang's sender leaves `Bootstrapping` for `WaitingForInput`)

The decode side checks the prompt's hash against its own (SGLang checks the room in the
metadata it receives). Either side failing fails the other with SGLang's 500, and at once:
a decode request that ends closes its handshake, a prefill request that ends answers it.
A half whose peer never comes gives up after `bootstrap_timeout_s`.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, Phase
from fleetsim.server.driver import EngineDriver, Stream
from fleetsim.server.metrics import DisaggregationMetrics
from fleetsim.server.protocol import Bootstrap

KV_PATH = "/weir/v1/kv/{room}"
PAGES_PATH = KV_PATH + "/pages"
_JSON = "application/json"
# How long past its bootstrap wait a peer may take to answer before it counts as gone.
_SILENT_PEER_S = 5.0


def input_ids_hash(req: EngineRequest) -> int:
    """What both halves of a handoff must agree on: the prompt."""
    return zlib.crc32(msgspec.json.encode(req.input_ids))


def _error(message: str, status: int = 409) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@dataclass(eq=False)
class _Room:
    """One handoff as the prefill engine's bootstrap server keeps it: whether the decode
    peer has handshaken and has pages for the KV, the prefill request, and the answer the
    peer's handshake gets."""

    shipped: asyncio.Future[web.Response]
    asked: bool = False
    pages: bool = False
    req: EngineRequest | None = None


@dataclass
class PrefillSide:
    """A prefill engine's bootstrap server and its exports."""

    driver: EngineDriver
    metrics: DisaggregationMetrics
    config: EngineConfig
    rooms: dict[int, _Room] = field(default_factory=dict)
    _rooms_of: dict[int, int] = field(default_factory=dict)  # id(request) → its room
    _shipping: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.driver.on_exported = self._export
        self.driver.on_ended = self._ended

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post(KV_PATH, self._asked)
        app.router.add_post(PAGES_PATH, self._paged)
        return app

    def taken(self, room: int) -> bool:
        known = self.rooms.get(room)
        return known is not None and known.req is not None

    def submit(self, peer: Bootstrap, req: EngineRequest, streaming: bool) -> Stream:
        room = self._room(peer.room)
        stream = self.driver.submit_prefill(req, streaming)
        if room.req is not None:  # taken since the request was checked
            self.driver.handoff_failed(req, f"bootstrap_room {peer.room} is already in use")
            return stream
        room.req = req
        self._rooms_of[id(req)] = peer.room
        if room.pages:
            self.driver.peer_ready(req)
        else:
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.bootstrap_timeout_s, self._bootstrap_timeout, req)
        return stream

    def _room(self, room: int) -> _Room:
        known = self.rooms.get(room)
        if known is None:
            known = self.rooms[room] = _Room(asyncio.get_running_loop().create_future())
        return known

    def _bootstrap_timeout(self, req: EngineRequest) -> None:
        if req.phase is Phase.BOOTSTRAP:
            self.metrics.bootstrap_failed.inc()
            message = (
                f"Prefill bootstrap failed for request rank=0 req.rid={req.rid!r}: no decode "
                f"peer within {self.config.bootstrap_timeout_s} s"
            )
            self.driver.handoff_failed(req, message)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    @staticmethod
    def _number(request: web.Request) -> int | None:
        try:
            return int(request.match_info["room"])
        except ValueError:
            return None

    async def _paged(self, request: web.Request) -> web.Response:
        """The decode peer has pages for the KV: the prefill half may run."""
        number = self._number(request)
        if number is None:
            return _error("the room must be an integer", 400)
        room = self._room(number)
        if room.shipped.done():
            return await asyncio.shield(room.shipped)  # it failed already: say why
        room.pages = True
        if room.req is not None and room.req.phase is Phase.BOOTSTRAP:
            self.driver.peer_ready(room.req)
        return web.json_response({})

    async def _asked(self, request: web.Request) -> web.Response:
        """The decode peer's handshake: answered once the KV has shipped, or failed."""
        number = self._number(request)
        if number is None:
            return _error("the room must be an integer", 400)
        room = self._room(number)
        if room.asked:
            return _error(f"bootstrap_room {number} already has a decode peer")
        room.asked = True
        try:
            return await asyncio.wait_for(
                asyncio.shield(room.shipped), self.config.bootstrap_timeout_s
            )
        except TimeoutError:
            return _error(f"no prefill request for bootstrap_room {number}")
        except asyncio.CancelledError:
            # The decode peer went away: this half of the handoff fails with it.
            req = room.req
            if req is not None:
                self.metrics.transfer_failed.inc()
                self.driver.handoff_failed(req, self._failure(req, "the decode side went away"))
            raise
        finally:
            if self.rooms.get(number) is room:
                del self.rooms[number]

    def _export(self, req: EngineRequest) -> None:
        """The export's first token is computed: its KV ships now."""
        number = self._rooms_of.get(id(req))
        if number is not None:
            self._shipping[id(req)] = asyncio.create_task(self._ship(req, self.rooms[number]))

    async def _ship(self, req: EngineRequest, room: _Room) -> None:
        tokens = len(req.input_ids)
        kv_bytes = tokens * self.config.timing.model.kv_bytes_per_token
        seconds = self.config.timing.kv_transfer_s(tokens, self.config.kv_link_bytes_per_s)
        await asyncio.sleep(seconds / self.config.speed_factor)
        self._shipping.pop(id(req), None)
        if req.finish is not None or room.shipped.done():
            return
        self.metrics.transferred(kv_bytes, seconds)
        room.shipped.set_result(
            web.json_response(
                {
                    "output_id": req.output_ids[-1],
                    "cached_tokens": req.cached_tokens,
                    "kv_bytes": kv_bytes,
                    "input_ids_hash": input_ids_hash(req),
                }
            )
        )
        self.driver.transfer_done(req)

    def _ended(self, req: EngineRequest) -> None:
        """A request ended: an export that did not ship fails its decode peer at once."""
        number = self._rooms_of.pop(id(req), None)
        shipping = self._shipping.pop(id(req), None)
        if shipping is not None:
            shipping.cancel()
        if number is None:
            return
        room = self.rooms.get(number)
        if room is None or room.shipped.done():
            return
        reason = req.finish.message if req.finish is not None else "ended"
        room.shipped.set_result(_error(self._failure(req, reason)))
        if not room.asked:
            # Kept a while, so that a peer asking late learns at once.
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.bootstrap_timeout_s, self._forget, number, room)

    def _forget(self, number: int, room: _Room) -> None:
        if self.rooms.get(number) is room:
            del self.rooms[number]

    @staticmethod
    def _failure(req: EngineRequest, reason: str) -> str:
        return f"Prefill transfer failed for request rank=0 req.rid={req.rid!r}: {reason}"


@dataclass
class DecodeSide:
    """A decode engine's handoffs: each asks its prefill peer for the KV once it has pages."""

    driver: EngineDriver
    metrics: DisaggregationMetrics
    config: EngineConfig
    _peers: dict[int, Bootstrap] = field(default_factory=dict)  # id(request) → its peer
    _fetching: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    _signals: set[asyncio.Task[None]] = field(default_factory=set)
    _http: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.driver.on_preallocated = self._preallocated
        self.driver.on_ended = self._ended

    def submit(self, peer: Bootstrap, req: EngineRequest, streaming: bool) -> Stream:
        """The handoff handshakes with its prefill peer at once and waits for pages."""
        self._peers[id(req)] = peer
        self._fetching[id(req)] = asyncio.create_task(self._fetch(req, peer))
        return self.driver.submit_handoff(req, streaming)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:  # loopback only: no proxy from the environment
            self._http = aiohttp.ClientSession(trust_env=False)
        return self._http

    @staticmethod
    def _url(peer: Bootstrap, path: str) -> str:
        return f"http://{peer.host}:{peer.port}{path.format(room=peer.room)}"

    async def close(self) -> None:
        for task in (*self._fetching.values(), *self._signals):
            task.cancel()
        if self._http is not None:
            await self._http.close()

    def _preallocated(self, req: EngineRequest) -> None:
        peer = self._peers.get(id(req))
        if peer is None:
            return
        self.metrics.alloc.observe(max(0.0, self.driver.now() - req.arrival) * 1e3)
        signal = asyncio.create_task(self._paged(req, peer))
        self._signals.add(signal)
        signal.add_done_callback(self._signals.discard)

    async def _call(self, peer: Bootstrap, path: str, payload: object) -> tuple[int, object]:
        # The prefill side answers when its own wait ends; this bound is for a peer gone
        # silent, with room past that wait for a busy machine (twice the wait alone let a
        # loaded one time out before the prefill side's own answer came).
        timeout = aiohttp.ClientTimeout(total=self.config.bootstrap_timeout_s + _SILENT_PEER_S)
        url = self._url(peer, path)
        async with self._session().post(url, json=payload, timeout=timeout) as reply:
            return reply.status, await reply.json(content_type=None)

    async def _paged(self, req: EngineRequest, peer: Bootstrap) -> None:
        try:
            status, body = await self._call(peer, PAGES_PATH, {})
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            status, body = 0, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        if status != 200:
            self._failed(req, peer, _message(status, body))

    async def _fetch(self, req: EngineRequest, peer: Bootstrap) -> None:
        ours = input_ids_hash(req)
        try:
            status, body = await self._call(peer, KV_PATH, {"rid": req.rid, "input_ids_hash": ours})
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._failed(req, peer, f"{type(exc).__name__}: {exc}")
            return
        if status != 200 or not isinstance(body, dict):
            self._failed(req, peer, _message(status, body))
            return
        if body.get("input_ids_hash") != ours:
            self._failed(req, peer, "Metadata corruption detected - bootstrap_room mismatch")
            return
        self._fetching.pop(id(req), None)  # ending now must not cancel this task
        self.driver.kv_arrived(req, int(body["output_id"]), int(body.get("cached_tokens", 0)))

    def _failed(self, req: EngineRequest, peer: Bootstrap, reason: str) -> None:
        if req.finish is not None:
            return
        self.metrics.transfer_failed.inc()
        message = (
            f"Decode transfer failed for request rank=0 req.rid={req.rid!r} "
            f"req.bootstrap_room={peer.room}: {reason}"
        )
        self.driver.handoff_failed(req, message)

    def _ended(self, req: EngineRequest) -> None:
        """A handoff that ends before its KV lands stops asking for it."""
        self._peers.pop(id(req), None)
        fetching = self._fetching.pop(id(req), None)
        if fetching is not None:
            fetching.cancel()


def _message(status: int, body: object) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message or f"the prefill engine answered {status}")


def handoff_side(
    model: EngineModel, driver: EngineDriver, metrics: DisaggregationMetrics | None
) -> PrefillSide | DecodeSide | None:
    """The P/D half this engine serves, by its `--disaggregation-mode`."""
    config = model.config
    if metrics is None or config.disaggregation_mode == "null":
        return None
    if config.disaggregation_mode == "prefill":
        return PrefillSide(driver, metrics, config)
    return DecodeSide(driver, metrics, config)
