"""What `weir router` and `weir sidecar` read from their clients: flags for the server's
limits (`controlplane.transport.guard.ServerLimits`), the same for both."""

from __future__ import annotations

import argparse

from controlplane.transport.guard import (
    BODY_OVERHEAD_BYTES,
    ID_BYTES_PER_TOKEN,
    TEXT_BYTES_PER_TOKEN,
    ServerLimits,
)

_MIB = 1 << 20


def add_server_flags(parser: argparse.ArgumentParser, max_connections: int) -> None:
    group = parser.add_argument_group("limits on what clients send")
    add = group.add_argument
    add("--max-body-mib", type=float, default=0.0,
        help="the largest request body, in MiB; larger ones get 413 (default 0: sized to "
             f"the context length, {BODY_OVERHEAD_BYTES // _MIB} MiB and "
             f"{TEXT_BYTES_PER_TOKEN + ID_BYTES_PER_TOKEN} bytes a token: 2.25 MiB at "
             "32768 tokens)")  # fmt: skip
    add("--max-body-in-flight-mib", type=float, default=0.0,
        help="request bodies read and decoded at once, over all connections, in MiB; "
             "more wait, then get 503 (default 0: 4 times --max-body-mib)")  # fmt: skip
    add("--header-timeout-s", type=float, default=15.0,
        help="a request's head must arrive within this long of its first byte, else the "
             "connection is closed")  # fmt: skip
    add("--body-timeout-s", type=float, default=60.0,
        help="a request's body must arrive within this long, else 408 and the connection "
             "is closed (responses, such as event streams, are never timed)")  # fmt: skip
    add("--idle-timeout-s", type=float, default=75.0,
        help="a keep-alive connection idle this long is closed")  # fmt: skip
    add("--max-connections", type=int, default=max_connections,
        help="connections open at once; a new one past it is answered 503 and closed")  # fmt: skip


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The limits the flags give; ValueError for values out of range."""
    if args.max_body_mib < 0 or args.max_body_in_flight_mib < 0:
        raise ValueError("--max-body-mib and --max-body-in-flight-mib must be >= 0")
    return ServerLimits(
        max_body_bytes=round(args.max_body_mib * _MIB),
        max_body_bytes_in_flight=round(args.max_body_in_flight_mib * _MIB),
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
    )
