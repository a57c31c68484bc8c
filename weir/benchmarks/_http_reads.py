"""What the engine-stream HTTP client (`controlplane.transport.http`) spends on one
network read, for `weir bench router`.

A streamed `/generate` response, one cumulative event a read as the reference engine
writes them, is fed to the client's connection protocol in push mode, as the router's
and the sidecar's relays read it: decoded (each read's payload handed to the sink) and
cut through (a read of whole chunks handed on as it came). In the same process, stream
by stream in turn: llhttp alone on the same reads (the parse itself; the rest is the
protocol's Python) and, given a file, another version of the client module — `git show
REV:controlplane/transport/http.py > FILE` — so that a change to the client is an A/B
on one machine at one moment rather than two runs an hour apart.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httptools
import msgspec

from weir.benchmarks._report import Figure, Report, median_p99

_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_STREAMS_PER_RUN = 200


def http_reads(report: Report, runs: int, baseline: str = "", tokens: int = 64) -> None:
    from controlplane.transport import http

    reads = _stream_reads(tokens)
    clients = {"client": http}
    if baseline:
        clients["baseline"] = _load(baseline)
    samples: dict[str, list[float]] = {}
    asyncio.run(_measure(clients, reads, runs, samples))
    floor = median_p99(samples["llhttp"])
    report.add(Figure("llhttp alone, per read of a /generate stream", floor[0], "µs", p99=floor[1]))
    for mode in ("decoded", "cut through"):
        median, p99 = median_p99(samples[f"client {mode}"])
        note = f"{median / floor[0]:.1f}x llhttp alone"
        if baseline:
            old, old_p99 = median_p99(samples[f"baseline {mode}"])
            note += (
                f"; the client in {baseline}: {old:.2f} µs (p99 {old_p99:.2f}), "
                f"this one {median / old:.2f}x that"
            )
        report.add(Figure(f"HTTP client, per read of a /generate stream, {mode}", median, "µs",
                          p99=p99, note=note))  # fmt: skip


def _stream_reads(tokens: int) -> list[bytes]:
    """The body reads of a streamed /generate response of `tokens` events, one chunk a
    read, then `[DONE]` and the terminator."""
    reads = []
    for n in range(1, tokens + 1):
        event = msgspec.json.encode({
            "text": "weir " * (n // 5), "output_ids": list(range(1000, 1000 + n)),
            "meta_info": {"id": "bench", "finish_reason": None, "prompt_tokens": 12,
                          "completion_tokens": n, "cached_tokens": 0},
        })  # fmt: skip
        frame = b"data: " + event + b"\n\n"
        reads.append(b"%x\r\n%b\r\n" % (len(frame), frame))
    reads.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    return reads


def _load(path: str) -> ModuleType:
    """Another version of `controlplane/transport/http.py`, as a module of its own."""
    if not Path(path).is_file():
        raise SystemExit(f"--http-baseline: no file {path}")
    spec = importlib.util.spec_from_file_location("_http_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--http-baseline: {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def _measure(
    clients: dict[str, ModuleType], reads: list[bytes], runs: int, samples: dict[str, list[float]]
) -> None:
    for _ in range(runs * _STREAMS_PER_RUN):
        samples.setdefault("llhttp", []).append(_llhttp(reads))
        for name, module in clients.items():
            for mode, cut in (("decoded", False), ("cut through", True)):
                key = f"{name} {mode}"
                samples.setdefault(key, []).append(await _client(module, reads, cut))


def _llhttp(reads: list[bytes]) -> float:
    body: list[bytes] = []

    class Sink:
        on_body = body.append

    parser = httptools.HttpResponseParser(Sink())
    parser.feed_data(_HEAD)
    started = time.thread_time_ns()
    for data in reads:
        parser.feed_data(data)
    return (time.thread_time_ns() - started) / len(reads) / 1000


class _Wire:
    """A transport that goes nowhere."""

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def _go_on(*_: object) -> bool:
    return False


async def _client(module: ModuleType, reads: list[bytes], cut: bool) -> float:
    """µs per read of `module`'s connection protocol, in push mode."""
    conn: Any = module._Connection(asyncio.get_running_loop(), 60.0, lambda _: None)
    conn.connection_made(_Wire())
    conn.send(b"")
    conn.data_received(_HEAD)
    wire_sink: Callable[..., bool] | None = _go_on if cut else None
    push = asyncio.ensure_future(conn.push(_go_on, wire_sink))
    await asyncio.sleep(0)  # the sinks are in place
    started = time.thread_time_ns()
    for data in reads:
        conn.data_received(data)
    elapsed = time.thread_time_ns() - started
    if not await push:
        raise RuntimeError("the stream did not end")
    return elapsed / len(reads) / 1000
