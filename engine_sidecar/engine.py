"""The engine adapter: the few things the sidecar needs from an inference engine.

`EngineAdapter` is the interface (server info, load, streamed and plain requests, abort by
rid, pause/continue); `SGLangEngine` implements it over SGLang's HTTP server, for both
0.5.5 and 0.5.23, as tests/sglang/test_adapter.py checks against both real servers:

- server info: `/server_info` (0.5.23) or `/get_server_info` (0.5.5);
- load: `/v1/loads?include=all` (0.5.23) or `/get_load` (0.5.5) — which one answers decides
  the version when `version` is missing from server info;
- pause: 0.5.23 takes `{"mode": ...}`, 0.5.5 takes no body;
- the host tier's bandwidth: 0.5.23's `/metrics` counts the bytes its device-host copies
  moved and the time they took (`sglang:load_back_bytes_total` over
  `sglang:load_back_duration_seconds`, and the same for write-back); 0.5.5 has no such
  families.

Streams are server-sent events, handed over in batches — every event that arrived in one
network read — each as its raw frame (so the proxy forwards bytes it need not change, and
writes a batch to the client at once) and its unparsed JSON data. Batches are pushed to a
callback from inside the connection's read callback (`EngineStream.push`): relaying a
token wakes no task.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from controlplane.trace.spans import CLIENT, TRACER, outgoing
from controlplane.transport import HTTPClient, Response, SSEEvent, TransportError

_json_decode = msgspec.json.Decoder().decode
_JSON = {"Content-Type": "application/json"}


class EngineError(RuntimeError):
    """The engine could not be reached or answered something the sidecar cannot use."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    version: str
    model: str
    kv_capacity_tokens: int
    page_size: int
    context_length: int
    max_req_input_len: int
    loads_api: str  # "v1_loads" (0.5.23) or "get_load" (0.5.5)
    incremental_streaming: bool = False  # --incremental-streaming-output
    # The hierarchical cache's host pool (--enable-hierarchical-cache): --hicache-size
    # GB when given, else --hicache-ratio times the device pool; 0 and 0.0 without one.
    hicache_size_gb: int = 0
    hicache_ratio: float = 0.0
    # P/D (--disaggregation-mode, --disaggregation-bootstrap-port): "null" on a mixed engine.
    disaggregation_mode: str = "null"
    bootstrap_port: int = 0
    # KV bytes a token takes on one rank: the KV pool's size over its token capacity
    # (server info's `memory_usage`); 0 where the engine does not say.
    kv_bytes_per_token: int = 0

    def host_tier_tokens(self, kv_bytes_per_token: int) -> int:
        """The host pool's capacity in tokens (0: no host tier)."""
        if self.hicache_size_gb > 0:
            return int(self.hicache_size_gb * 1e9 // kv_bytes_per_token)
        return int(self.hicache_ratio * self.kv_capacity_tokens)

    @property
    def pause_takes_mode(self) -> bool:
        return self.loads_api == "v1_loads"

    @property
    def openai_token_ids(self) -> bool:
        """OpenAI streams can carry token ids: `return_token_ids` on completions and
        `return_*_ids_in_sglext` on chat, which SGLang 0.5.23 has and 0.5.5 has not."""
        return _version(self.version) >= (0, 5, 23)


def _hicache(info: dict[str, Any]) -> dict[str, Any]:
    """The host pool's size flags from server info, when the hierarchical cache is on
    (SGLang reports the ratio unresolved, None, when it was left to its default of 2)."""
    if not info.get("enable_hierarchical_cache"):
        return {}
    ratio = info.get("hicache_ratio")
    size = info.get("hicache_size")
    return {
        "hicache_ratio": float(ratio) if isinstance(ratio, int | float) else 2.0,
        "hicache_size_gb": size if isinstance(size, int) else 0,
    }


def pool_bytes_per_token(info: dict[str, Any]) -> int:
    """The KV pool's bytes over its token capacity, from `memory_usage` (GB), top-level
    or rank 0's; 0 where either is missing, or where the pool is under 0.1 GB: SGLang
    rounds the size to 3 decimals, which would be more than half a percent off."""
    usage = info.get("memory_usage")
    states = info.get("internal_states")
    if not isinstance(usage, dict) and isinstance(states, list) and states:
        usage = states[0].get("memory_usage") if isinstance(states[0], dict) else None
    if not isinstance(usage, dict):
        return 0
    gigabytes, tokens = usage.get("kvcache"), _int(usage.get("token_capacity"))
    if not isinstance(gigabytes, int | float) or gigabytes < 0.1 or tokens <= 0:
        return 0
    return round(gigabytes * 1e9 / tokens)


# SGLang's host-tier copy families: bytes moved, and the histogram of the time it took.
_COPIES = (
    ("sglang:load_back_bytes_total", "sglang:load_back_duration_seconds_sum"),
    ("sglang:hicache_backup_bytes_total", "sglang:hicache_backup_duration_seconds_sum"),
)


def copy_bandwidth(metrics: str) -> float:
    """The host tier's bandwidth in bytes a second from an SGLang `/metrics` text: all
    copies' bytes over their time, SGLang's "bytes-weighted active bandwidth", per rank
    (a rank copies its own shard, over its own link) and averaged over the ranks; 0.0
    when no copy has been timed."""
    wanted = {name for pair in _COPIES for name in pair}
    moved: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            rank = tuple(sorted((k, v) for k, v in sample.labels.items() if k.endswith("_rank")))
            totals = moved.setdefault(rank, [0.0, 0.0])  # bytes, seconds
            totals[sample.name.endswith("_sum")] += sample.value
    rates = [nbytes / seconds for nbytes, seconds in moved.values() if nbytes > 0 and seconds > 0]
    return sum(rates) / len(rates) if rates else 0.0


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("0.5.23rc1" is (0, 5, 23))."""
    numbers = []
    for part in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    used_tokens: int
    running_requests: int
    waiting_requests: int
    sampled_at: float  # time.monotonic() when the question was sent


# One SSE `data:` event: the frame as received (ending in a blank line) and its data, not
# parsed here: the reader decodes only what it needs.
StreamEvent = SSEEvent


class EngineStream(Protocol):
    status: int

    async def push(
        self,
        on_batch: Callable[[list[StreamEvent]], bool],
        on_wire: Callable[[bytes, StreamEvent], bool | None] | None = None,
    ) -> bool:
        """Hand each read's events to `on_batch` until the stream ends (returns True) or
        `on_batch` returns True (returns False; call again to go on). `on_wire` takes
        reads undecoded, as `Response.push_events` says."""
        ...

    async def body(self) -> bytes: ...


class EngineAdapter(Protocol):
    async def server_info(self) -> EngineInfo: ...

    async def load(self) -> EngineLoad: ...

    def open(self, path: str, body: dict[str, Any]) -> Any:
        """An async context manager yielding an `EngineStream` for POST `path`."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def tokenize(self, text: str) -> list[int]:
        """The token ids the engine makes of `text` (as it would of a prompt)."""
        ...

    async def host_bandwidth(self) -> float:
        """Bytes a second the engine's device-host copies have run at, per rank (0.0: it
        has reported none)."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def close(self) -> None: ...


class _HTTPStream:
    def __init__(self, url: str, response: Response) -> None:
        self._url = url
        self._response = response
        self.status = response.status

    async def push(
        self,
        on_batch: Callable[[list[StreamEvent]], bool],
        on_wire: Callable[[bytes, StreamEvent], bool | None] | None = None,
    ) -> bool:
        try:
            return await self._response.push_events(on_batch, on_wire)
        except TransportError as exc:
            raise EngineError(f"{self._url}: the stream broke: {exc}") from exc

    async def body(self) -> bytes:
        try:
            return await self._response.read()
        except TransportError as exc:
            raise EngineError(f"{self._url}: the answer broke: {exc}") from exc


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class SGLangEngine:
    """An SGLang HTTP server at `url`."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._http = HTTPClient(connect_timeout_s=5.0, read_timeout_s=timeout_s)
        self._info: EngineInfo | None = None

    async def _get(self, path: str) -> tuple[int, Any]:
        try:
            async with await self._http.request("GET", self.url + path) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return resp.status, None
                return resp.status, _json_decode(raw) if raw else None
        except (TransportError, msgspec.DecodeError) as exc:
            raise EngineError(f"GET {self.url}{path}: {exc}") from exc

    async def _post(self, path: str, body: dict[str, Any] | None) -> int:
        try:
            data = b"" if body is None else msgspec.json.encode(body)
            async with await self._http.request("POST", self.url + path, data, _JSON) as resp:
                await resp.read()
                return resp.status
        except TransportError as exc:
            raise EngineError(f"POST {self.url}{path}: {exc}") from exc

    async def server_info(self) -> EngineInfo:
        status, info = await self._get("/server_info")
        if status != 200:
            status, info = await self._get("/get_server_info")
        if status != 200 or not isinstance(info, dict):
            raise EngineError(f"{self.url}: no server info (HTTP {status})")
        loads_status, _ = await self._get("/v1/loads")
        capacity = _int(info.get("max_total_num_tokens"))
        if capacity <= 0:
            # Some builds report it only per rank, under internal_states.
            states = info.get("internal_states") or []
            if isinstance(states, list) and states and isinstance(states[0], dict):
                capacity = _int(states[0].get("max_total_num_tokens"))
        model = info.get("served_model_name") or info.get("model_path") or ""
        self._info = EngineInfo(
            version=str(info.get("version", "")),
            model=str(model),
            kv_capacity_tokens=capacity,
            page_size=max(1, _int(info.get("page_size"), 1)),
            context_length=_int(info.get("context_length")),
            max_req_input_len=_int(info.get("max_req_input_len")),
            loads_api="v1_loads" if loads_status == 200 else "get_load",
            incremental_streaming=bool(info.get("incremental_streaming_output", False)),
            disaggregation_mode=str(info.get("disaggregation_mode") or "null"),
            bootstrap_port=_int(info.get("disaggregation_bootstrap_port")),
            kv_bytes_per_token=pool_bytes_per_token(info),
            **_hicache(info),
        )
        return self._info

    async def host_bandwidth(self) -> float:
        try:
            async with await self._http.request("GET", self.url + "/metrics") as resp:
                text = (await resp.read()).decode("utf-8", "replace")
                status = resp.status
        except TransportError as exc:
            raise EngineError(f"GET {self.url}/metrics: {exc}") from exc
        if status != 200:
            raise EngineError(f"{self.url}: /metrics answered HTTP {status}")
        return copy_bandwidth(text)

    async def load(self) -> EngineLoad:
        info = self._info or await self.server_info()
        # The report describes the engine at some moment after the request left: stamp it
        # with the sending time so it never looks newer than a release that raced it.
        sent_at = time.monotonic()
        if info.loads_api == "v1_loads":
            status, body = await self._get("/v1/loads?include=all")
            ranks = body.get("loads", body) if isinstance(body, dict) else body
            used_key, running_key = "num_used_tokens", "num_running_reqs"
        else:
            status, ranks = await self._get("/get_load")
            used_key, running_key = "num_tokens", "num_reqs"
        if status != 200 or not isinstance(ranks, list):
            raise EngineError(f"{self.url}: no load report (HTTP {status})")
        rows = [r for r in ranks if isinstance(r, dict)]
        return EngineLoad(
            used_tokens=sum(_int(r.get(used_key)) for r in rows),
            running_requests=sum(_int(r.get(running_key)) for r in rows),
            waiting_requests=sum(_int(r.get("num_waiting_reqs")) for r in rows),
            sampled_at=sent_at,
        )

    @asynccontextmanager
    async def open(self, path: str, body: dict[str, Any]) -> AsyncIterator[_HTTPStream]:
        url = self.url + path
        # One span per engine segment (a resume in place is a second one), named by the
        # engine rid, which SGLang's own logs print.
        with TRACER.start_as_current_span(
            "weir.sidecar.engine", kind=CLIENT,
            attributes={"weir.engine_rid": str(body.get("rid", "")), "http.route": path},
        ):  # fmt: skip
            headers = outgoing(dict(_JSON))
            try:
                response = await self._http.request("POST", url, msgspec.json.encode(body), headers)
            except TransportError as exc:
                raise EngineError(f"POST {url}: {exc}") from exc
            # Errors inside the block are the caller's (a client that went away, say):
            # only reading the engine's answer turns into EngineError, in _HTTPStream.
            async with response:
                yield _HTTPStream(url, response)

    async def abort(self, rid: str) -> None:
        status = await self._post("/abort_request", {"rid": rid, "abort_all": False})
        if status != 200:
            raise EngineError(f"{self.url}: abort_request answered HTTP {status}")

    async def tokenize(self, text: str) -> list[int]:
        try:
            async with await self._http.request(
                "POST", self.url + "/v1/tokenize", msgspec.json.encode({"prompt": text}), _JSON
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except TransportError as exc:
            raise EngineError(f"POST {self.url}/v1/tokenize: {exc}") from exc
        try:
            reply = _json_decode(raw) if status == 200 and raw else None
        except msgspec.DecodeError:
            reply = None
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineError(f"{self.url}: /v1/tokenize answered HTTP {status} without tokens")
        return tokens

    async def pause(self) -> None:
        info = self._info or await self.server_info()
        body = {"mode": "abort"} if info.pause_takes_mode else None
        status = await self._post("/pause_generation", body)
        if status != 200:
            raise EngineError(f"{self.url}: pause_generation answered HTTP {status}")

    async def resume(self) -> None:
        # An empty JSON object, not an empty body: 0.5.23 answers an empty body 400 "Field
        # required" and stays paused; both versions take `{}`.
        status = await self._post("/continue_generation", {})
        if status != 200:
            raise EngineError(f"{self.url}: continue_generation answered HTTP {status}")

    async def close(self) -> None:
        await self._http.close()
