"""`weir operator`: run the InferencePool operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse

NAME = "operator"
HELP = "Run the InferencePool operator: children, status, drain-first scaling, cleanup."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--namespace", action="append", default=[], dest="namespaces",
        help="watch only this namespace (repeatable); default: every namespace")  # fmt: skip
    add("--liveness", default="http://0.0.0.0:8080/healthz",
        help="kopf's liveness endpoint for the kubelet's probe")  # fmt: skip
    add("--peering", default="",
        help="kopf peering object name for several operator replicas; empty runs standalone")  # fmt: skip
    add("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from fleet_operator.config import OperatorConfig
    from fleet_operator.handlers import build_registry

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(
        kopf.operator(
            registry=build_registry(OperatorConfig.from_env()),
            clusterwide=not args.namespaces,
            namespaces=args.namespaces,
            standalone=not args.peering,
            peering_name=args.peering or None,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0
