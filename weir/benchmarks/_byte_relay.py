"""A TCP byte relay: the least a process in front of an engine can do. `weir bench sidecar`
runs it beside the sidecar, on the same workload, as the machine's floor for CPU per chunk.

Each accepted connection opens one upstream connection; bytes go both ways untouched (the
client's are held until the upstream connects), and either side closing closes the other.
A side whose peer's write buffer is full stops reading until it drains."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from typing import cast


class _Side(asyncio.Protocol):
    """One socket of a relayed pair; what it receives is written to its peer."""

    def __init__(self, peer: _Side | None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # bytes for this side from before it connected
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.writelines(self.early)
        self.early.clear()
        if self.peer is not None and self.peer.closed:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        assert self.peer is not None  # set before any byte can arrive
        if self.peer.transport is None:
            self.peer.early.append(data)
        else:
            self.peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()  # after its buffered bytes are written

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Side):
    """An accepted connection, which opens its upstream one."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(None)
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = _Side(self)
        self.connecting = asyncio.ensure_future(self._connect(self.peer))

    async def _connect(self, peer: _Side) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: peer, *self.upstream)
        except OSError:
            assert self.transport is not None
            self.transport.close()


async def _serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), "127.0.0.1", port)
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
