"""`weir operator`: run the InferencePool operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse

from weir.commands._redis_url import add_redis_url_flags, redis_url

NAME = "operator"
HELP = "Run the InferencePool operator: children, status, drain-first scaling, cleanup."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--namespace", action="append", default=[], dest="namespaces",
        help="watch only this namespace (repeatable); default: every namespace")  # fmt: skip
    add("--liveness", default="http://127.0.0.1:8080/healthz",
        help="kopf's liveness endpoint; in a pod, listen on 0.0.0.0 so the kubelet's probe "
             "reaches it (the chart does); empty: none")  # fmt: skip
    add("--peering", default="",
        help="kopf peering object name for several operator replicas; empty runs standalone")  # fmt: skip
    add("--log-format", choices=("plain", "full", "json"), default="full",
        help="log lines as text (plain: message only; full: time, level, logger) or JSON; "
             "every line about a pool names it")  # fmt: skip
    add_redis_url_flags(parser, "the control plane the operator reads status from and drains")
    add("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import logging
    import sys

    import kopf

    from controlplane.store.connection import redact_url
    from fleet_operator.config import OperatorConfig
    from fleet_operator.handlers import build_registry

    try:
        config = OperatorConfig.from_env()
        if url := redis_url(args, NAME):
            config = dataclasses.replace(config, redis_url=url)
    except ValueError as exc:
        print(f"weir operator: {exc}", file=sys.stderr)
        return 2

    # kopf's own set-up: its formatter prefixes each line about a pool with
    # `[namespace/name]` (JSON: a field), which a plain logging config would drop.
    kopf.configure(
        verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()], log_prefix=True
    )
    if not args.verbose:
        # kopf reports every status pass of every pool at INFO; failures stay visible.
        logging.getLogger("kopf.objects").addFilter(
            lambda record: (
                not str(record.msg).startswith("Timer ")
                or not str(record.msg).endswith(" succeeded.")
            )
        )
    logging.getLogger("weir.operator").info("control plane: %s", redact_url(config.redis_url))
    asyncio.run(
        kopf.operator(
            registry=build_registry(config),
            clusterwide=not args.namespaces,
            namespaces=args.namespaces,
            standalone=not args.peering,
            peering_name=args.peering or None,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0
