"""A TCP byte relay: the least a process in front of an engine can do. `weir bench sidecar`
runs it beside the sidecar, on the same workload, as the machine's floor for CPU per chunk.

Each accepted connection opens one upstream connection; bytes go both ways untouched (the
client's are held until the upstream connects), and either side closing closes the other.
A side whose peer cannot keep up stops reading until the peer's write buffer drains."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from typing import cast


class _Side(asyncio.Protocol):
    """One socket of a relayed pair; what it receives is written to its peer. An accepted
    side is given the upstream address and opens its peer's connection."""

    def __init__(self, peer: _Side | None, upstream: tuple[str, int] | None = None) -> None:
        self.peer = peer
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # bytes for this side from before it connected
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.upstream is not None:
            peer = self.peer = _Side(self)
            self.connecting = asyncio.ensure_future(self._connect(peer, self.upstream))
            return
        self.transport.writelines(self.early)
        self.early.clear()
        if self.peer is not None and self.peer.closed:
            self.transport.close()

    async def _connect(self, peer: _Side, upstream: tuple[str, int]) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: peer, *upstream)
        except OSError:
            cast(asyncio.Transport, self.transport).close()

    def _peer_transport(self) -> asyncio.Transport | None:
        transport = self.peer.transport if self.peer is not None else None
        return None if transport is None or transport.is_closing() else transport

    def data_received(self, data: bytes) -> None:
        if (transport := self._peer_transport()) is not None:
            transport.write(data)
        elif self.peer is not None and self.peer.transport is None:
            self.peer.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if (transport := self._peer_transport()) is not None:
            transport.close()  # after its buffered bytes are written

    def pause_writing(self) -> None:
        if (transport := self._peer_transport()) is not None:
            transport.pause_reading()

    def resume_writing(self) -> None:
        if (transport := self._peer_transport()) is not None:
            transport.resume_reading()


async def _serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Side(None, upstream), "127.0.0.1", port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m weir.benchmarks._byte_relay")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="host:port")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    uvloop.run(_serve(args.port, (host, int(port))))


if __name__ == "__main__":
    main()
