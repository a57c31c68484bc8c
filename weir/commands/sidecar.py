"""`weir sidecar`: run the engine sidecar next to an SGLang server, or drain one.

    WEIR_REDIS_URL=redis://… weir sidecar --engine-url http://127.0.0.1:30000 --port 8001 \
        --pool chat --endpoint-id pod-a --advertise-url http://10.0.0.5:8001 \
        --policy-file /etc/weir/policy.yaml --heartbeat-s 1 --lease-ttl-s 5 \
        --admin-token-file /var/run/secrets/weir/admin/token
    weir sidecar drain --url http://127.0.0.1:8001 --deadline-s 30 \
        --admin-token-file /var/run/secrets/weir/admin/token      # preStop hook

The operator and `weir up` spawn it with exactly these flags.

The admin routes (`/weir/v1/state`, `/weir/v1/requests/{id}`, `/weir/v1/preempt`,
`/weir/v1/drain`) need the
admin token when one is configured: read from `--admin-token-file` (a mounted Secret),
else from the environment variable `WEIR_ADMIN_TOKEN`, never from the command line.
Without either they stay open, and the sidecar warns at start. The control plane's Redis
URL likewise comes from `--redis-url-file` or `$WEIR_REDIS_URL` (`--redis-url` wins when
given, but shows its password in process listings); none: local admission only.
"""

from __future__ import annotations

import argparse
import sys

from weir.commands._admin_token import add_admin_token_flag, admin_token
from weir.commands._observability_flags import add_logging_flags, configure_observability
from weir.commands._redis_url import add_redis_url_flags, redis_url
from weir.commands._server_flags import add_server_flags, server_limits

NAME = "sidecar"
HELP = "Run the engine sidecar (proxy, KV admission, preemption, heartbeats), or drain one."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("run", "drain"),
        default="run",
        help="run the sidecar (default) or drain a running one (preStop)",
    )
    parser.add_argument("--engine-url", help="the SGLang server this sidecar fronts")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on")
    add_redis_url_flags(parser, "control-plane Redis (none: local admission only)")
    parser.add_argument("--pool", default="default", help="InferencePool name")
    parser.add_argument(
        "--endpoint-id", default="", help="endpoint id (default: hostname, port and a suffix)"
    )
    parser.add_argument("--advertise-url", default="", help="URL routers use to reach it")
    parser.add_argument("--policy-file", default="", help="PoolPolicy as JSON or YAML")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period")
    parser.add_argument("--lease-ttl-s", type=float, default=5.0, help="lease time to live")
    parser.add_argument("--url", default="", help="drain: the sidecar's URL")
    parser.add_argument(
        "--deadline-s", type=float, default=30.0, help="drain: how long in-flight may run"
    )
    add_admin_token_flag(
        parser, "the admin routes (/weir/v1/state, /requests, /preempt, /drain); drain: the token "
        "it sends",
    )  # fmt: skip
    add_logging_flags(parser)
    add_server_flags(parser, max_connections=4096)


def _drain(url: str, deadline_s: float, token: str) -> int:
    import json
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        url.rstrip("/") + "/weir/v1/drain",
        data=json.dumps({"deadline_s": deadline_s}).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=deadline_s + 30) as response:
            sys.stdout.write(response.read().decode() + "\n")
    except urllib.error.HTTPError as exc:
        sys.stderr.write(f"weir sidecar drain: {url} answered {exc.code}: {exc.read().decode()}\n")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        token = admin_token(args.admin_token_file)
    except ValueError as exc:
        sys.stderr.write(f"weir sidecar: {exc}\n")
        return 2
    if args.action == "drain":
        if not args.url:
            sys.stderr.write("weir sidecar drain: --url is required\n")
            return 2
        return _drain(args.url, args.deadline_s, token)
    if not args.engine_url:
        sys.stderr.write("weir sidecar: --engine-url is required\n")
        return 2
    try:
        control_plane = redis_url(args, NAME)
        limits = server_limits(args)
    except ValueError as exc:
        sys.stderr.write(f"weir sidecar: {exc}\n")
        return 2
    import asyncio
    import logging
    import signal

    import uvloop

    from engine_sidecar.server import SidecarConfig, load_policy, serve_sidecar

    configure_observability(args, "weir-sidecar")
    from controlplane.contract import SchemaError

    try:
        policy = load_policy(args.policy_file) if args.policy_file else None
    except (OSError, SchemaError, ValueError) as exc:
        sys.stderr.write(f"weir sidecar: bad --policy-file {args.policy_file}: {exc}\n")
        return 2
    if policy is not None and policy.pool != args.pool and args.pool != "default":
        sys.stderr.write(f"weir sidecar: --pool {args.pool} but the policy is for {policy.pool}\n")
        return 2
    config = SidecarConfig(
        engine_url=args.engine_url,
        host=args.host,
        port=args.port,
        redis_url=control_plane,
        pool=policy.pool if policy else args.pool,
        endpoint_id=args.endpoint_id,
        advertise_url=args.advertise_url,
        policy=policy,
        heartbeat_s=args.heartbeat_s,
        lease_ttl_s=args.lease_ttl_s,
        admin_token=token,
        server=limits,
    )

    async def main() -> None:
        async with serve_sidecar(config) as sidecar:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, sidecar.close)
            logging.getLogger("weir.sidecar").info("listening on %s", sidecar.url)
            await sidecar.wait_closed()

    uvloop.run(main())
    return 0
