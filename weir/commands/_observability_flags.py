"""Logging flags of the request-path services (`weir router`, `weir sidecar`): the level,
and the per-request decision records (`controlplane.trace.trail`); and their tracing,
which the standard OpenTelemetry variables configure (`controlplane.trace.spans`)."""

from __future__ import annotations

import argparse


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument(
        "--log-decisions",
        action="store_true",
        help="log every decision about every request (route, admission, relief, resume, "
        "finish) as one JSON line on the weir.decisions logger",
    )


def configure_observability(args: argparse.Namespace, service: str) -> None:
    from controlplane.trace.spans import configure_tracing
    from controlplane.trace.trail import configure_logging

    configure_logging(args.log_level, args.log_decisions)
    configure_tracing(service)
